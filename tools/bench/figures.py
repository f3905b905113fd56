"""The benchmark's figures from its runs' records: ratios to stock 1F1B and DP (per round, with
their spread and whether a difference is real), scalability, memory efficiency (ME) and scaling
efficiency. Pure functions of the records ``tools.bench.analysis`` makes."""

from __future__ import annotations

import statistics

GB = 1e9


def median_or_none(xs):
    return statistics.median(xs) if xs else None


def mean_or_none(xs):
    return sum(xs) / len(xs) if xs else None


def round_ratios(num: list | None, den: list | None) -> dict:
    """Per-round ratios num[r] / den[r] (same round; rounds where either is missing are skipped)
    with their median, min and max. Pure."""
    per = [a / b if a and b else None for a, b in zip(num or [], den or [])]
    vals = [x for x in per if x is not None]
    return {
        "rounds": per,
        "median": median_or_none(vals),
        "min": min(vals, default=None),
        "max": max(vals, default=None),
        "n": len(vals),
    }


def spread_excludes(lo, hi, value: float = 1.0) -> bool | None:
    """Whether the min-max spread [lo, hi] leaves ``value`` out; None without a spread. Pure."""
    if lo is None or hi is None:
        return None
    return not (lo <= value <= hi)


def ranges_overlap(a: tuple, b: tuple) -> bool | None:
    """Whether the ranges [a0, a1] and [b0, b1] overlap; None when either is missing. Pure."""
    if None in (*a, *b):
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def summarize(runs: dict, devices: dict | None = None) -> dict:
    """Ratios and efficiencies from the per-run figures. ``runs[config][schedule]`` holds at least
    throughput_samples_s and mean_peak_training_rss_bytes (and mean_peak_saved_bytes). Pure.

    * ratio_to_1f1b / ratio_to_dp: throughput ratios on two nodes;
    * scalability = throughput / (devices x single-device throughput), devices = cores in use
      (two_nodes: 2, one_node: 1);
    * me = scalability x throughput / memory (memory: mean per-rank peak training RSS, GB);
      me_vs_dp = me / DP's me (and me_saved_vs_dp with the peak bytes saved for backward +
      the rank's parameter/gradient/optimizer state instead);
    * scaling_efficiency = throughput(two_nodes) / (2 x throughput(one_node)); with both in rounds,
      taken per round (``scaling_efficiency_rounds``, between runs of the same round) as median
      and ``scaling_efficiency_min``/``_max``.

    With rounds (``round_throughput_samples_s`` in the two-node records, ``combine_rounds``) the
    ratios are taken per round, between runs of the same round: ``ratio_to_1f1b`` is the median of
    ``ratio_to_1f1b_rounds`` and ``ratio_to_1f1b_min``/``_max`` their spread (same for dp).
    ``real_vs_1f1b``: the spread leaves 1.0 out; ``real_vs_dp``: the schedule's throughput range
    over rounds and DP's do not overlap; both None with fewer than two rounds (one run shows no
    spread to judge by). Without per-round figures the ratios are those of the throughputs."""
    devices = devices or {"two_nodes": 2, "one_node": 1}
    two, one = runs.get("two_nodes", {}), runs.get("one_node", {})
    single = (runs.get("one_device") or {}).get("dp") or {}
    thr1 = single.get("throughput_samples_s")
    out = {"single_device_throughput": thr1, "devices": devices, "schedules": {}}
    dp = two.get("dp") or {}
    dp_figures = {
        "me": _me_of(dp, thr1, devices["two_nodes"])[1],
        "me_t": _me_tensor(dp, thr1, devices["two_nodes"]),
        "range": (dp.get("throughput_samples_s_min"), dp.get("throughput_samples_s_max")),
        "several": (dp.get("rounds") or 1) > 1,
    }
    for name, r in two.items():
        out["schedules"][name] = _schedule_figures(
            name, r, two, one.get(name) or {}, thr1, devices["two_nodes"], dp_figures
        )
    return out


def _schedule_figures(name: str, r: dict, two: dict, one: dict, thr1, devices: int, dp: dict) -> dict:
    """One schedule's row of ``summarize``: ``two`` the two-node runs, ``one`` its one-node run,
    ``dp`` DP's ME (both kinds), throughput range and whether it ran in rounds."""
    thr = r.get("throughput_samples_s")
    one_thr = one.get("throughput_samples_s")
    scaling = _ratios_per_round(r, one, one_thr)
    scal, me = _me_of(r, thr1, devices)
    me_t = _me_tensor(r, thr1, devices)
    v1 = _ratios_per_round(r, two.get("1f1b"), (two.get("1f1b") or {}).get("throughput_samples_s"))
    vd = _ratios_per_round(r, two.get("dp"), (two.get("dp") or {}).get("throughput_samples_s"))
    own_range = (r.get("throughput_samples_s_min"), r.get("throughput_samples_s_max"))
    several = (r.get("rounds") or 1) > 1
    overlap = ranges_overlap(own_range, dp["range"]) if several and dp["several"] else None
    return {
        "throughput_samples_s": thr,
        "ratio_to_1f1b": v1["median"],
        "ratio_to_1f1b_rounds": v1["rounds"],
        "ratio_to_1f1b_min": v1["min"],
        "ratio_to_1f1b_max": v1["max"],
        "real_vs_1f1b": spread_excludes(v1["min"], v1["max"]) if v1["n"] > 1 and name != "1f1b" else None,
        "ratio_to_dp": vd["median"],
        "ratio_to_dp_rounds": vd["rounds"],
        "ratio_to_dp_min": vd["min"],
        "ratio_to_dp_max": vd["max"],
        "real_vs_dp": (not overlap) if overlap is not None and name != "dp" else None,
        "scalability": scal,
        "me": me,
        "me_vs_dp": me / dp["me"] if me and dp["me"] else None,
        "me_tensors_vs_dp": me_t / dp["me_t"] if me_t and dp["me_t"] else None,
        "one_node_throughput_samples_s": one_thr,
        "scaling_efficiency": scaling["median"] / 2 if scaling["median"] else None,
        "scaling_efficiency_rounds": [x / 2 if x else None for x in scaling["rounds"]],
        "scaling_efficiency_min": scaling["min"] / 2 if scaling["min"] else None,
        "scaling_efficiency_max": scaling["max"] / 2 if scaling["max"] else None,
    }


def _ratios_per_round(r: dict, base_run: dict | None, base_thr) -> dict:
    """``round_ratios`` of a run's throughput to a baseline's; without per-round figures (or none
    shared) the throughputs' ratio, as one round."""
    thr = r.get("throughput_samples_s")
    rr = round_ratios(r.get("round_throughput_samples_s"), (base_run or {}).get("round_throughput_samples_s"))
    if rr["n"] == 0:  # no per-round figures (or none shared): the throughputs' ratio
        x = thr / base_thr if thr and base_thr else None
        rr = {"rounds": [x] if x is not None else [], "median": x, "min": x, "max": x, "n": 1 if x else 0}
    return rr


def _me_of(r: dict, thr1, devices: int):
    """(scalability, ME) with memory = mean per-rank peak training RSS; (None, None) without figures."""
    thr = r.get("throughput_samples_s")
    mem = r.get("mean_peak_training_rss_bytes")
    if not thr or not mem or not thr1:
        return None, None
    scal = thr / (devices * thr1)
    return scal, scal * thr / (mem / GB)


def _me_tensor(r, thr1, devices):
    """ME with memory = parameters/gradients/optimizer state + peak bytes saved for backward."""
    thr, state, saved = r.get("throughput_samples_s"), r.get("mean_state_bytes"), r.get("mean_peak_saved_bytes")
    if not thr or not thr1 or state is None or saved is None or state + saved <= 0:
        return None
    scal = thr / (devices * thr1)
    return scal * thr / ((state + saved) / GB)
