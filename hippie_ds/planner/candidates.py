"""What a plan is sure of: the runner-ups beside the chosen configuration, each with its
predicted step. Pure Python.

Two kinds: other **configurations** the search simulated (another depth, micro-batch size or
schedule), and other **cuts** of the chosen configuration: each stage boundary moved by up to
:data:`REACH` layers (the others kept; at most :data:`MAX_CUTS`), re-computation chosen again;
the analytically fastest few are then simulated and priced like the plan when that is cheap
(at most :data:`CHEAP` simulated micro-batch-stages), else predicted as the plan's step scaled by
their analytic step over the plan configuration's (``predicted_by`` analytic).
Before that, :func:`climb_cuts` moves the chosen cut itself to a neighbour the simulator ranks higher
(the search balances analytic costs), so no simulated neighbour listed beats the plan.
The plan lists the best few by the step its objective compares (the raw step; a priced
objective's: ``step_time x steps_factor``) with the profile's spread (:func:`hippie_ds.planner.noise.time_spread`); its
summary says which candidates are within that spread of the plan, i.e. which the profile cannot tell
apart from it, and ``python -m tools.bench cut-sweep`` measures them on the real job.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .evaluate import choose_recompute, deferred_layers, simulate_configuration, sim_cost
from .model import _Candidate, _Estimate, _Layout, _Model
from .plan_file import Candidate

REACH = 2  # a boundary moves by up to this many layers
MAX_CUTS = 24  # neighbouring cuts evaluated at most (the nearest first)
CHEAP = 256  # simulated micro-batch-stages up to which a cut is simulated and priced as the plan was
CLIMB_ROUNDS = 4  # boundary moves the plan's cut makes at most (climb_cuts)


def evaluate(
    model: _Model,
    lay: _Layout,
    b: int,
    M: int,
    schedule: str,
    objective: str,
    simulate_budget: int,
    cap: float,
    price: float,
) -> tuple[_Candidate, _Estimate, dict] | None:
    """One configuration as the plan's is evaluated: re-computation, then the simulator (within
    ``simulate_budget``) and the deferred layers as ``objective`` chooses them (``price``: the
    staleness price); None when it does not fit."""
    got = choose_recompute(model, lay, schedule, b, M, objective)
    if got is None:
        return None
    score, ks, est = got
    cand = _Candidate(score, (lay.K, b, schedule), lay, b, M, schedule, ks, est)
    delayed: dict = {}
    if sim_cost(lay, M, schedule) <= simulate_budget:
        est = simulate_configuration(model, lay, b, M, schedule, ks, est.deferred, auto_limit=simulate_budget)
        est, delayed = deferred_layers(model, lay, b, M, schedule, ks, est, price, objective)
    if max(est.memory) > cap:
        return None
    return cand, est, delayed


def neighbour_cuts(parts: Sequence[int], reach: int = REACH, limit: int = MAX_CUTS) -> list[list[int]]:
    """Every partition with one interior boundary of ``parts`` moved by 1..``reach`` layers (still
    strictly increasing), the smallest moves first, at most ``limit``."""
    out = []
    for d in range(1, reach + 1):
        for i in range(1, len(parts) - 1):
            for step in (-d, d):
                moved = list(parts)
                moved[i] += step
                if moved[i - 1] < moved[i] < moved[i + 1]:
                    out.append(moved)
    return out[:limit]


def analytic_cuts(model: _Model, chosen: _Candidate, objective: str, seen: set) -> list[tuple]:
    """The chosen configuration's neighbouring cuts not in ``seen`` (each added to it), re-computation
    chosen again, by analytic step: [(step, parts, layout)], the fastest first."""
    out = []
    for parts in neighbour_cuts(chosen.lay.parts):
        key = (chosen.lay.K, chosen.b, chosen.schedule, tuple(parts))
        if key in seen:
            continue
        seen.add(key)
        if any(sum(model.params[a:e]) <= 0 for a, e in zip(parts, parts[1:])) and sum(model.params) > 0:
            continue  # a stage without parameters: DeepSpeed's optimizer refuses an empty parameter list
        lay = model.layout(chosen.lay.K, parts)
        got = choose_recompute(model, lay, chosen.schedule, chosen.b, chosen.M, objective)
        if got is not None:
            out.append((got[2].step, parts, lay))
    out.sort(key=lambda x: (x[0], x[1]))
    return out


def climb_cuts(
    model: _Model,
    chosen: _Candidate,
    est: _Estimate,
    delayed: dict,
    objective: str,
    simulate_budget: int,
    cap: float,
    price: float,
    count: int = 5,
    rounds: int = CLIMB_ROUNDS,
    evaluated: dict | None = None,
) -> tuple[_Candidate, _Estimate, dict, int]:
    """Hill-climb the chosen cut: evaluate its ``count`` analytically best neighbouring cuts as the
    plan was (simulated, deferral chosen) and move to the best that the objective ranks higher;
    repeat from there, at most ``rounds`` moves. The search's partition balances analytic costs;
    this is where the simulator's step (bubbles, link sharing, the deferred all-reduces) moves a
    boundary, so a neighbour the plan lists as a runner-up never beats it. Only where a cut is
    cheap to simulate (:data:`CHEAP`) and for one model chunk per stage. ``evaluated``: {parts:
    :func:`evaluate`'s result}, filled here so that :func:`runner_ups` does not simulate a cut again.
    (chosen, est, delayed, moves made)."""
    from .evaluate import objective_value

    if chosen.lay.v != 1 or sim_cost(chosen.lay, chosen.M, chosen.schedule) > CHEAP:
        return chosen, est, delayed, 0
    value = objective_value(model, est, objective)
    seen = {(chosen.lay.K, chosen.b, chosen.schedule, tuple(chosen.lay.parts))}
    for moves in range(rounds):
        best = None
        for _, parts, lay in analytic_cuts(model, chosen, objective, seen)[:count]:
            got = _evaluate_cut(model, chosen, lay, parts, objective, simulate_budget, cap, price, evaluated)
            if got is None:
                continue
            v = objective_value(model, got[1], objective)
            if v > value * (1 + 1e-9) and (best is None or v > best[0]):
                best = (v, *got)
        if best is None:
            return chosen, est, delayed, moves
        value, chosen, est, delayed = best
    return chosen, est, delayed, rounds


def _evaluate_cut(model, chosen, lay, parts, objective, simulate_budget, cap, price, evaluated: dict | None):
    """:func:`evaluate` of the chosen configuration at another cut, once per cut (``evaluated``)."""
    key = (chosen.lay.K, chosen.b, chosen.M, chosen.schedule, tuple(parts))
    if evaluated is not None and key in evaluated:
        return evaluated[key]
    got = evaluate(model, lay, chosen.b, chosen.M, chosen.schedule, objective, simulate_budget, cap, price)
    if evaluated is not None:
        evaluated[key] = got
    return got


def checkpointed(lay: _Layout, ks: Sequence[int]) -> list[int]:
    if lay.v == 1:
        return sorted(i for s in range(lay.K) for i in lay.rec[s].layers(ks[s]))
    return sorted(
        i for s in range(lay.K) for c, rec in enumerate(lay.rec[s].chunks) for i in rec.layers(lay.rec[s]._k(ks[s])[c])
    )


def describe(kind: str, cand: _Candidate, est: _Estimate, model: _Model, objective_value: float) -> Candidate:
    lay = cand.lay
    return Candidate(
        kind=kind,
        pipeline_depth=lay.K,
        data_parallel=lay.r,
        micro_batch_size=cand.b,
        micro_batches=cand.M,
        schedule=cand.schedule,
        virtual_stages=lay.v,
        boundaries=list(lay.parts),
        checkpointed_layers=checkpointed(lay, cand.ks),
        step_time=est.step,
        steps_factor=est.steps_factor,
        objective_value=objective_value,
        memory_max=max(est.memory),
        predicted_by=est.predicted_by,
    )


def runner_ups(
    model: _Model,
    chosen: _Candidate,
    plan_est: _Estimate,
    ranked: Sequence[tuple],
    objective: str,
    simulate_budget: int,
    cap: float,
    price: float,
    count: int,
    evaluated: dict | None = None,
) -> list[Candidate]:
    """The best ``count`` candidates beside ``chosen`` by the step the objective compares: the other simulated
    configurations (``ranked``: (score, candidate, estimate, delayed) from the search) and the
    chosen configuration's neighbouring cuts."""
    from .evaluate import objective_value
    from .objectives import priced

    seen = {(chosen.lay.K, chosen.b, chosen.schedule, tuple(chosen.lay.parts))}
    out = []
    for value, cand, est, _ in ranked:
        key = (cand.lay.K, cand.b, cand.schedule, tuple(cand.lay.parts))
        if key not in seen:
            seen.add(key)
            out.append(describe("configuration", cand, est, model, value))
    if chosen.lay.v == 1:  # the neighbouring cuts: analytic first, the best ``count`` evaluated as the plan was
        cheap = sim_cost(chosen.lay, chosen.M, chosen.schedule) <= CHEAP
        for step, parts, lay in analytic_cuts(model, chosen, objective, seen)[:count]:
            if cheap:
                got = _evaluate_cut(model, chosen, lay, parts, objective, simulate_budget, cap, price, evaluated)
            else:  # the plan's step scaled by the analytic ratio (its deferral and price kept)
                got = choose_recompute(model, lay, chosen.schedule, chosen.b, chosen.M, objective)
                if got is not None:
                    ratio = step / chosen.est.step if chosen.est.step > 0 else 1.0
                    got = (
                        _Candidate(got[0], chosen.key, lay, chosen.b, chosen.M, chosen.schedule, got[1], got[2]),
                        dataclasses.replace(
                            got[2],
                            step=plan_est.step * ratio,
                            steps_factor=plan_est.steps_factor,
                            predicted_by="analytic",
                        ),
                        {},
                    )
            if got is not None:
                cand, est, _ = got
                out.append(describe("cut", cand, est, model, objective_value(model, est, objective)))
    factor = priced(objective)
    out.sort(key=lambda c: (c.step_time * (c.steps_factor if factor else 1.0), c.pipeline_depth, c.boundaries))
    return out[:count]
