"""Evaluating one planner configuration (depth, layout, micro-batches, schedule): the
re-computation it should use, its analytic or simulated estimate, and the prediction a plan
reports. Pure Python; the search (:mod:`.plan`) and the baselines (:mod:`.baselines`) share it."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from .model import _Estimate, _Layout, _Model
from .sim_costs import _costs
from .objectives import score
from .plan_file import TARGETS, Prediction
from .traits import schedule_traits


def choose_recompute(model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str,
                     targets: Sequence[float] = TARGETS) -> tuple[float, list[int], _Estimate] | None:
    """The best re-computation choice (over bottleneck targets) for a fixed configuration:
    (score, prefix per stage, estimate), or None when nothing fits."""
    K, f = lay.K, b / model.b0
    p = model.in_flight(schedule, K, M)
    zero = [0] * K
    _, F, B, c = model.compute_time(lay, schedule, f, M, zero)
    around = [(c[s - 1] if s else 0.0) + c[s] for s in range(K)]
    base = [F[s] + B[s] + 2 * around[s] for s in range(K)]
    bottleneck = max(base)
    best, seen = None, set()
    for t in targets:
        if t == 0:
            ks = list(zero)
        elif math.isinf(t):
            ks = [lay.rec[s].choose(p[s], math.inf) for s in range(K)]
        else:
            # base is one chunk's cycle with virtual stages: a stage's re-computation spreads over v
            ks = [lay.rec[s].choose(p[s], (bottleneck * t - base[s]) * lay.v / f) for s in range(K)]
        key = tuple(ks)
        if key in seen:
            continue
        seen.add(key)
        step, deferred = model.step_time(lay, schedule, f, M, ks)
        mem = model.memory(lay, f, p, ks, deferred, schedule_traits(schedule, K, M).weight_versions)
        if max(mem) > model.cap:
            continue
        value = score(objective, *model.figures(step, mem))
        if best is None or value > best[0] * (1 + 1e-12):
            best = (value, ks, _Estimate(step, mem, p, deferred))
    return best


def simulate_configuration(model: _Model, lay: _Layout, b: int, M: int, schedule: str, ks: Sequence[int],
                           deferred: Sequence[int], auto_limit: int) -> _Estimate:
    """Simulate a configuration: deferred stages by the simulator's rule when affordable
    (``auto_limit`` micro-batch-stages of repeated simulation), else ``deferred`` (the
    analytic rule's choice)."""
    from ..config import WHOLE_STAGE
    from ..schedules.resolve import Shape, resolve
    from ..schedules.simulator import simulate

    costs = _costs(model, lay, b, ks)
    traits = schedule_traits(schedule, lay.K, M)
    params: dict[str, Any] = {}
    if traits.defers:
        affordable = lay.K * M * (lay.K + 1) * 3 <= auto_limit
        params = {"deferred_stages": "auto" if affordable else list(deferred)}
    compiled = resolve(schedule, Shape(lay.K, M), params, WHOLE_STAGE, costs, validate=False).compiled
    # flush schedules repeat identically; deferred and continuous ones reach their steady state
    iterations = 3 if traits.defers or traits.continuous else 1
    res = simulate(compiled, costs, iterations=iterations, critical_path=False)
    # the simulator counts a stage's chunks together; the memory model wants each chunk's count,
    # which the compiled streams give (the same op order the simulator runs)
    p = ([max(1, x["peak_activation_microbatches"]) for x in res.per_stage] if lay.v == 1
         else model.in_flight(schedule, lay.K, M))
    d = list(compiled.params.get("deferred_stages", []))
    mem = model.memory(lay, b / model.b0, p, ks, d, traits.weight_versions)
    return _Estimate(res.step_time, mem, p, d, "simulator")


def deferred_layers(model: _Model, lay: _Layout, b: int, M: int, schedule: str, ks: Sequence[int],
                    est: _Estimate, staleness_price: float) -> tuple[_Estimate, dict]:
    """``hippie.deferred_layers: "auto"`` for a simulated configuration with deferred stages:
    (the estimate, {deferred stage: LayersChoice}) by the engine's own rule
    (:func:`hippie_ds.schedules.resolve.resolve`, the engine's one pass). A stage that delays
    nothing is no longer deferred, the step is the one simulated with the chosen layers (what
    runs) and ``steps_factor`` prices what stays stale; memory keeps each deferred stage's whole
    gradient buffer (an upper bound). Analytic estimates (too large to simulate) and layouts with
    virtual stages choose nothing: the config's value applies, unpriced."""
    if est.predicted_by != "simulator" or not est.deferred or lay.v > 1:
        # virtual stages: whole deferred stages (the engine's hippie.deferred_layers counts a
        # stage's leading layers as one contiguous range; a chunked stage's are not)
        return est, {}
    from ..config import AUTO_LAYERS
    from ..schedules.resolve import Shape, resolve

    choices = resolve(schedule, Shape(lay.K, M), {"deferred_stages": list(est.deferred)}, AUTO_LAYERS,
                      _costs(model, lay, b, ks), staleness_price=staleness_price, validate=False).choices
    kept = [s for s in est.deferred if choices[s].layers]
    memory = est.memory if kept == list(est.deferred) else model.memory(
        lay, b / model.b0, est.in_flight, ks, kept, schedule_traits(schedule, lay.K, M).weight_versions)
    first = next(iter(choices.values()))  # the step and the stale share are the pipeline's, on every choice
    return (dataclasses.replace(est, step=first.step_time, memory=memory, deferred=kept,
                                steps_factor=first.steps_factor), {s: choices[s] for s in kept})


def sim_cost(lay: _Layout, M: int, schedule: str) -> int:
    traits = schedule_traits(schedule, lay.K, M)
    return lay.K * lay.v * M * (3 if traits.defers or traits.continuous else 1)


def prediction(model: _Model, est: _Estimate) -> Prediction:
    thr, scal, m, me = model.figures(est.step, est.memory)
    return Prediction(step_time=est.step, steps_factor=est.steps_factor, throughput=thr, scalability=scal, memory=m,
                      memory_max=max(est.memory), memory_per_stage=list(est.memory), me=me,
                      fits=max(est.memory) <= model.cap, predicted_by=est.predicted_by)
