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


def choose_recompute(
    model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str, targets: Sequence[float] = TARGETS
) -> tuple[float, list[int], _Estimate] | None:
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


def simulate_configuration(
    model: _Model,
    lay: _Layout,
    b: int,
    M: int,
    schedule: str,
    ks: Sequence[int],
    deferred: Sequence[int],
    auto_limit: int,
    default_deferral: bool = False,
    staleness_price: float = 0.0,
) -> _Estimate:
    """Simulate a configuration: deferred stages by the simulator's rule when affordable
    (``auto_limit`` micro-batch-stages of repeated simulation), else ``deferred`` (the
    analytic rule's choice). Each deferred stage delays its whole gradient (what the layer choice,
    :func:`deferred_layers`, starts from), or with ``default_deferral`` what a job without a plan
    delays (``hippie.deferred_layers``' default, one layer), its stale share priced at
    ``staleness_price`` in ``steps_factor`` (0: not priced, a free objective's)."""
    from ..config import DEFAULT_DEFERRED_LAYERS, WHOLE_STAGE
    from ..schedules.resolve import Shape, resolve
    from ..schedules.simulator import simulate

    costs = _costs(model, lay, b, ks)
    traits = schedule_traits(schedule, lay.K, M)
    params: dict[str, Any] = {}
    if traits.defers:
        affordable = lay.K * M * (lay.K + 1) * 3 <= auto_limit
        params = {"deferred_stages": "auto" if affordable else list(deferred)}
    layers = DEFAULT_DEFERRED_LAYERS if default_deferral and lay.v == 1 else WHOLE_STAGE
    resolved = resolve(schedule, Shape(lay.K, M), params, layers, costs, validate=False)
    compiled = resolved.compiled
    # flush schedules repeat identically; deferred and continuous ones reach their steady state
    iterations = 3 if traits.defers or traits.continuous else 1
    leading = resolved.simulator_layers() if layers != WHOLE_STAGE else {}
    res = simulate(compiled, costs, iterations=iterations, critical_path=False, deferred_layers=leading or None)
    # the simulator counts a stage's chunks together; the memory model wants each chunk's count,
    # which the compiled streams give (the same op order the simulator runs)
    p = (
        [max(1, x["peak_activation_microbatches"]) for x in res.per_stage]
        if lay.v == 1
        else model.in_flight(schedule, lay.K, M)
    )
    d = list(compiled.params.get("deferred_stages", []))
    shares = {s: costs.stages[s].delayed_part(n).fraction for s, n in leading.items()}
    mem = model.memory(lay, b / model.b0, p, ks, d, traits.weight_versions, shares)
    factor = 1.0
    if leading:
        from ..schedules.deferral import stale_share

        total = sum(st.param_bytes for st in costs.stages) or 1.0
        stale = stale_share(costs, leading, total)
        stale += sum(costs.stages[s].param_bytes for s in d if s not in leading) / total
        factor = 1.0 + staleness_price * stale
    return _Estimate(res.step_time, mem, p, d, "simulator", factor)


def _price(staleness_price: float | None) -> float:
    from ..schedules.deferral import STALENESS_PRICE

    return STALENESS_PRICE if staleness_price is None else staleness_price


def deferred_layers(
    model: _Model,
    lay: _Layout,
    b: int,
    M: int,
    schedule: str,
    ks: Sequence[int],
    est: _Estimate,
    staleness_price: float | None,
    objective: str = "time-to-loss",
) -> tuple[_Estimate, dict]:
    """``hippie.deferred_layers: "auto"`` for a simulated configuration with deferred stages:
    (the estimate, {deferred stage: LayersChoice}) by the engine's own rule
    (:func:`hippie_ds.schedules.resolve.resolve`, the engine's one pass), as ``objective`` asks
    (:mod:`.objectives`): a priced objective any depth for the least step x (1 + price x stale
    share); a free one at most the measured-free depth (one layer with parameters a stage) for the
    least step. A stage that delays nothing is no longer deferred, the step is the one simulated
    with the chosen layers (what runs) and a priced objective's ``steps_factor`` prices what stays
    stale at ``staleness_price`` (None: the measured one; a free objective's is 1: one layer was
    measured free, whatever its share of the gradient); memory holds each deferred stage's chosen
    share (:meth:`.model._Model.memory`). Analytic estimates (too large to simulate) and layouts
    with virtual stages choose nothing: the config's value applies."""
    if est.predicted_by != "simulator" or not est.deferred or lay.v > 1:
        # virtual stages: whole deferred stages (the engine's hippie.deferred_layers counts a
        # stage's leading layers as one contiguous range; a chunked stage's are not)
        return est, {}
    from ..config import AUTO_LAYERS
    from ..schedules.resolve import Shape, resolve
    from .objectives import FREE_LAYERS, priced

    choices = resolve(
        schedule,
        Shape(lay.K, M),
        {"deferred_stages": list(est.deferred)},
        AUTO_LAYERS,
        _costs(model, lay, b, ks),
        validate=False,
        staleness_price=objective_price(objective, staleness_price),
        most_with_parameters=None if priced(objective) else FREE_LAYERS,
    ).choices
    kept = [s for s in est.deferred if choices[s].layers]
    memory = model.memory(
        lay,
        b / model.b0,
        est.in_flight,
        ks,
        kept,
        schedule_traits(schedule, lay.K, M).weight_versions,
        {s: choices[s].delayed_share for s in kept},
    )
    first = next(iter(choices.values()))  # the step and the stale share are the pipeline's, on every choice
    return (
        dataclasses.replace(est, step=first.step_time, memory=memory, deferred=kept, steps_factor=first.steps_factor),
        {s: choices[s] for s in kept},
    )


def objective_price(objective: str, staleness_price: float | None) -> float:
    """The price ``objective`` charges a stale gradient: the measured one (or ``staleness_price``) for a
    priced objective, 0 for a free one."""
    from .objectives import priced

    return _price(staleness_price) if priced(objective) else 0.0


def objective_value(model: _Model, est: _Estimate, objective: str) -> float:
    """The figure ``objective`` ranks ``est`` by (:mod:`.objectives`), what the plan file records."""
    return score(objective, *model.figures(est.step, est.memory), est.steps_factor)


def sim_cost(lay: _Layout, M: int, schedule: str) -> int:
    traits = schedule_traits(schedule, lay.K, M)
    return lay.K * lay.v * M * (3 if traits.defers or traits.continuous else 1)


def prediction(
    model: _Model, est: _Estimate, objective: str | None = None, working: list[float] | None = None
) -> Prediction:
    """The plan file's figures of ``est``; ``working``: its memory's working-memory term per stage
    (:meth:`_Model.working_memory`)."""
    thr, scal, m, me = model.figures(est.step, est.memory)
    return Prediction(
        step_time=est.step,
        steps_factor=est.steps_factor,
        throughput=thr,
        scalability=scal,
        memory=m,
        memory_max=max(est.memory),
        memory_per_stage=list(est.memory),
        memory_working_per_stage=None if working is None else list(working),
        me=me,
        fits=max(est.memory) <= model.cap,
        predicted_by=est.predicted_by,
        objective_value=None if objective is None else objective_value(model, est, objective),
    )
