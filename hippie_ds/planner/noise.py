"""Profiles that survive a busy machine: robust per-layer times, identical layers pooled,
and the warning a noisy profile gives. Pure Python; both profilers (``hippie-ds profile``,
:mod:`hippie_ds.profiler`, and ``hippie.profile``, :mod:`hippie_ds.adapter.profiling.profile_in_place`) hand
their raw timed runs here, and ``hippie-ds plan`` asks :func:`noise_warning` and :func:`time_spread`.

* **Robust times**: a layer's forward and backward are the medians of all its timed runs (every
  repeat of every measured step and replica, pooled), not a mean: a run that a busy machine
  stretched moves a median little. Its ``spread`` is the inter-quartile range of forward +
  backward over their median (IQR(F) + IQR(B)) / (median F + median B): what a quiet run of the
  same layer may differ by.
* **Groups**: layers that are the same work (same name, i.e. class; same parameter shapes and
  dtypes; same input shapes and dtypes: the profilers' ``work_key``) are one group: their runs
  are pooled and every member gets the pooled medians (its ``backward_weight`` the members' median
  W, at most the pooled backward), so four identical transformer blocks get one time, not four
  draws of the machine's load. Tied layers and lambdas are never grouped (the same name need not
  be the same work). Each member keeps ``own_ratio``, its own median forward + backward over the
  pooled one.
* **Noisy**: a group whose members' own medians part by more than :data:`NOISE_MARGIN` (25%:
  max own / min own - 1), by time that matters (:data:`MATERIAL`: the members' distances from
  their median own time add up to 1% of the model's forward + backward or more: a disagreement
  that could move a cut) is noisy; the profilers print :func:`noise_warning` when they write such
  a profile and ``hippie-ds plan`` when it plans from one.
* **Inferred groups**: a profile that records no groups (written before groups existed, imported
  from PipeDream, built by a tool) is checked on inferred groups: same name, parameter bytes,
  input bytes and output bytes (a max-pool and a ReLU can share a name, no parameters and an
  output size, not their input), from their recorded times. A first layer whose input the profile
  does not size (the loaded data) joins the one group that matches it on the rest, if one does.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

NOISE_MARGIN = 0.25  # identical layers whose own medians part by more than this: a noisy profile
MATERIAL = 0.01  # ... and by this share of the model's forward + backward (summed distances from their median)
RUNS = ("forward_runs", "backward_runs")


def iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def _spread(forward: Sequence[float], backward: Sequence[float]) -> float:
    total = statistics.median(forward) + statistics.median(backward)
    return (iqr(forward) + iqr(backward)) / total if total > 0 else 0.0


def pool(records: list[dict], keys: Sequence[str | None]) -> tuple[list[dict], list[list[int]]]:
    """Per layer (``records[i]``: profile fields plus ``forward_runs`` / ``backward_runs``, every
    timed run of the layer; ``keys[i]``: its work key, None: never grouped): the records with
    robust times, ``spread`` and, in a group, the pooled times and ``own_ratio`` (runs removed),
    and the groups (two or more layers with one key, in model order)."""
    by_key: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            by_key.setdefault(key, []).append(i)
    groups = [members for members in by_key.values() if len(members) > 1]
    out = []
    for record in records:
        r = {k: v for k, v in record.items() if k not in RUNS}
        fw, bw = record["forward_runs"], record["backward_runs"]
        r["forward"] = r["recompute"] = statistics.median(fw)
        r["backward"] = statistics.median(bw)
        # a layer with no input gradient runs its whole backward as W: W is the pooled backward itself
        whole = r.pop("weight_is_backward", False)
        r["backward_weight"] = r["backward"] if whole else min(r["backward_weight"], r["backward"])
        if r.get("split_extra") is not None:  # the split's I + W over the whole backward, never below it
            r["split_extra"] = max(0.0, r["split_extra"])
        r["spread"] = _spread(fw, bw)
        out.append(r)
    for members in groups:
        fw = [t for i in members for t in records[i]["forward_runs"]]
        bw = [t for i in members for t in records[i]["backward_runs"]]
        forward, backward = statistics.median(fw), statistics.median(bw)
        weight = (
            backward
            if all(records[i].get("weight_is_backward") for i in members)
            else min(statistics.median(out[i]["backward_weight"] for i in members), backward)
        )
        spread = _spread(fw, bw)
        extras = [out[i]["split_extra"] for i in members if out[i].get("split_extra") is not None]
        for i in members:
            own = out[i]["forward"] + out[i]["backward"]
            out[i].update(
                forward=forward,
                recompute=forward,
                backward=backward,
                backward_weight=weight,
                spread=spread,
                own_ratio=own / (forward + backward) if forward + backward > 0 else 1.0,
            )
            if extras:
                out[i]["split_extra"] = statistics.median(extras)
    return out, groups


def _inferred_groups(profile) -> list[list[int]]:
    """Groups of a profile that records none: same name, parameter bytes, input bytes and output
    bytes; a first layer with no ``input_bytes`` (the loaded data, which such a profile may not
    size) joins the one group that matches it on the rest."""
    by: dict[tuple, list[int]] = {}
    inputs, unsized = profile.inputs(), None
    for i, x in enumerate(profile.layers):
        if x.tied_key is None and x.name != "<lambda>" and x.forward + x.backward > 0:
            if i == 0 and x.input_bytes is None:
                unsized = (x.name, x.param_bytes, x.output_bytes)
            else:
                by.setdefault((x.name, x.param_bytes, inputs[i], x.output_bytes), []).append(i)
    if unsized is not None:
        matches = [m for key, m in by.items() if (key[0], key[1], key[3]) == unsized]
        if len(matches) == 1:
            matches[0].insert(0, 0)
    return [m for m in by.values() if len(m) > 1]


def _material(own: Sequence[float], total: float) -> bool:
    """The members' own times part by time that matters: their distances from the median add up
    to :data:`MATERIAL` of the model's forward + backward or more."""
    middle = statistics.median(own)
    return sum(abs(t - middle) for t in own) >= MATERIAL * total


def disagreements(profile, margin: float = NOISE_MARGIN) -> list[tuple[list[int], float, float]]:
    """(members, least, largest own forward + backward in seconds) of every group whose members part
    by more than ``margin``, by time that matters (:func:`_material`): recorded groups by their
    ``own_ratio``, an older profile's inferred ones by their times."""
    out, total = [], sum(x.forward + x.backward for x in profile.layers)
    for members in profile.groups or _inferred_groups(profile):
        if profile.groups:
            pooled = profile.layers[members[0]].forward + profile.layers[members[0]].backward
            own = [pooled * (profile.layers[i].own_ratio or 1.0) for i in members]
        else:
            own = [profile.layers[i].forward + profile.layers[i].backward for i in members]
        if min(own) > 0 and max(own) / min(own) - 1 > margin and _material(own, total):
            out.append((members, min(own), max(own)))
    return out


def _ranges(xs: Sequence[int]) -> str:
    return ", ".join(str(i) for i in xs)


def noise_warning(profile, margin: float = NOISE_MARGIN) -> str | None:
    """The warning a noisy profile gives (None: its identical layers agree within ``margin``)."""
    found = disagreements(profile, margin)
    if not found:
        return None
    parts = [
        f"layers {_ranges(m)} ({profile.layers[m[0]].name}) measured {lo * 1e3:.3g}-{hi * 1e3:.3g} ms "
        f"forward+backward (x{hi / lo:.2f})"
        for m, lo, hi in found
    ]
    load = profile.load
    busy = ""
    if load is not None and load.load_before is not None:
        busy = (
            f"; load average {load.load_before:.2f}"
            + (f" on {load.cpus} cores" if load.cpus else "")
            + (f", CPU/wall {load.cpu_share:.2f}" if load.cpu_share is not None else "")
        )
    pooled = (
        "their times are pooled (one median per group)"
        if profile.groups
        else "this profile predates pooling: each keeps its own time"
    )
    return (
        f"warning: profile {profile.model!r} is noisy: identical layers disagree by more than "
        f"{margin:.0%}: {'; '.join(parts)}{busy}. {pooled.capitalize()}; the machine was likely busy while "
        "measuring: profile again on a quieter machine or with more steps/repeats before trusting close cuts"
    )


def time_spread(profile) -> float | None:
    """The profile's relative spread: its layers' ``spread``, weighted by their forward + backward;
    an older profile's without spreads: the median, weighted by each layer's share of the step (its
    forward + backward), of its inferred groups' members' distances from their group's median time,
    relative to it. Weighted so that tiny layers that disagree widely do not set the spread of a
    model whose time is in large ones that agree, and a median so that one member that is other
    work under the same shapes does not either; None when it says nothing."""
    weighted = [(x.spread, x.forward + x.backward) for x in profile.layers if x.spread is not None]
    total = sum(w for _, w in weighted)
    if weighted and total > 0:
        return sum(s * w for s, w in weighted) / total
    distances = []
    for members in _inferred_groups(profile):
        own = [profile.layers[i].forward + profile.layers[i].backward for i in members]
        middle = statistics.median(own)
        distances += [(abs(t - middle) / middle, t) for t in own]
    return weighted_median(distances)


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float | None:
    """The median of (value, weight) pairs by weight (the least value holding half the weight);
    None when the weights add up to nothing."""
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    acc, ordered = 0.0, sorted(pairs)
    for value, w in ordered:
        acc += w
        if acc >= total / 2:
            return value
    return ordered[-1][0]


# Predicted steps closer than this are equal: below the planner's own error on measured rows
# (0.2-4% on the headline's), so no profiling length decides between them; a measurement does.
MIN_MARGIN = 0.005


def steps_to_separate(spread: float | None, margin: float, steps: int | None) -> int | None:
    """Profiling steps (``hippie.profile``'s ``steps``) after which a relative ``margin`` between two
    predicted steps is outside the profile's uncertainty: the uncertainty of a median falls as one
    over the square root of the runs it is taken over, and a profile of ``steps`` steps (None: one
    pass) cannot tell apart what is within its ``spread``, so ``steps x (spread / margin)^2``,
    rounded up. None: no spread recorded, or a margin under :data:`MIN_MARGIN` (predicted equal: no
    step count separates them)."""
    if spread is None or margin < MIN_MARGIN:
        return None
    return max(1, math.ceil((steps or 1) * (spread / margin) ** 2 - 1e-9))


def separating_steps(plan) -> tuple[int | None, float]:
    """(:func:`steps_to_separate` for the plan's nearest candidate, their relative margin): what a plan's
    summary states (None: no candidates, spread or margin)."""
    mine = plan.ranked_step(plan.prediction.step_time, plan.prediction.steps_factor)
    if not plan.candidates or mine <= 0:
        return None, 0.0
    margin = min(abs(plan.ranked_step(c.step_time, c.steps_factor) / mine - 1) for c in plan.candidates)
    return steps_to_separate(plan.profile_spread, margin, plan.profile_steps), margin
