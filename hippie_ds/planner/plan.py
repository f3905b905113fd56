"""The planner: searches pipeline configurations and writes a plan file. Pure Python.

What is searched, for P devices and a global batch G:

* pipeline depth K (a divisor of P, at most the number of layers), data-parallel width r = P/K;
* micro-batch size b (a divisor of G/r, at least ``min_micro_batch``: by default the profile's
  batch / 16, since the linear scaling of times is not trusted far below the measured batch:
  kernels lose efficiency at tiny batches, which the profile cannot show) and M = G / (r b);
* stage boundaries: the partition minimizing the slowest stage's forward+backward time
  (:func:`partition.min_bottleneck`, optimal);
* which layers every stage re-computes (:mod:`recompute`), chosen for a bottleneck target:
  a stage may spend on re-computation what keeps it under the target, so stages that are not
  the bottleneck re-compute nearly for free; targets from the unchanged bottleneck up to
  "as much as saves memory";
* the schedule (by default 1f1b, gpipe, hippie, hippie-1f1b, zb-h1; any built-in or schedule
  file given) and the deferred stages of a schedule that declares them. The planner asks the
  schedule (:mod:`.traits`: in-flight micro-batches, order, deferral, weight versions, a split
  backward, from its compiled streams); it knows no schedule by name.

Cost model (all of it in :class:`_Config.estimate`; the simulator refines the best few):

* times and activations scale linearly with b (``profile.py``); stage s costs F_s, B_s (+ its
  re-computation), p2p c_s = latency + cut bytes / link bandwidth (intra-node when both
  stages share a node: the pipeline is placed inside nodes, data parallelism across them, as
  Hippie does); ring all-reduce of stage s: a_s = 2 (r-1)/r W_s / bw + 2 (r-1) latency over
  the inter-node link when the group spans nodes, all stages sharing it;
* compute of a flush pipeline: T_c = (M-1) max_s(F_s+B_s+2c_{s-1}+2c_s) + sum_s(F_s+B_s) +
  2 sum_s c_s (GPipe order: the forward and backward maxima separately); a split backward
  (zero-bubble: B_s = I_s + w_s, the input gradient and the parameter gradients, w_s from the
  profile's ``backward_weight``) takes the largest of five lower bounds of the step
  (:func:`.model.split_backward_time`; ZB-H1 with equal stages: M (F+I+w) + (K-1)
  max(F, I, F+I-w)), so its bound never prunes wrongly; flush schedules
  all-reduce at the end (the link drains the work as stages finish, last stage first);
  Hippie's stage s all-reduces right after its last backward and must finish before the next
  step's first forward reaches it; a stage that cannot defers (the simulator's rule, see
  ``resolve_auto_params``), and the link must carry all stages' work once per step;
* memory per device of stage s = W_s * state_factor (fp32 profile and fp32 Adam: weights,
  gradients, two moments = 16 bytes a parameter = 4 x the profiled parameter bytes)
  + W_s for the gradient buffer of a deferred stage + activations: the peak number of
  micro-batches in flight (1f1b: min(K-s, M); gpipe: M; hippie: M, the fused last stage 1;
  zb-h1: K on every stage, activations are held until W;
  from the simulator when it runs) times the bytes kept per micro-batch, plus the largest
  re-computed run (``recompute.py``). Optimizer step time is not modelled (0);
* throughput = G / step time (samples/s); single-device throughput = profile batch / the
  whole model's forward+backward; scalability = throughput / (P x single-device throughput)
  (scaling efficiency; 1 for free communication and no bubble); memory = the mean over
  devices of their peak memory (total memory / P; ``memory_metric='max'``: the largest);
  ME = scalability x throughput / memory, reported in samples/s per GB. Every configuration
  must fit the device memory (and ``memory_cap``) on every device.

Layout: :mod:`.plan_file` (the plan file and its summary), :mod:`.model` (this cost model),
this module (the search and :func:`make_plan`).

Search: every (K, b, schedule) gets an upper bound of its objective (no re-computation cost,
least activation memory, no all-reduce exposure); they are visited best bound first and
skipped once the bound cannot beat the best few found. The best few are simulated
(``simulate_budget`` limits the simulated micro-batch-stages) and ranked by simulated figures.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from . import partition as part
from .cluster import Cluster
from .objectives import check_objective, score
from .model import _Candidate, _costs, _divisors, _Estimate, _Layout, _Model
from .plan_file import DEFAULT_STATE_FACTOR, GB, TARGETS, Baseline, Plan, Prediction, StagePlan
from .plan_file import (SCHEDULES, PlanMismatchError, format_summary, load_plan,  # noqa: F401 (this module's API)
                        save_plan)
from .profile import PlannerError, Profile
from .traits import schedule_traits

# ---------------------------------------------------------------------------------------------
# Search

def _check_schedules(schedules: Sequence[str]) -> None:
    """Every schedule a built-in name or a file the compiler loads (any is plannable: the planner
    asks the schedule, :mod:`.traits`)."""
    from ..schedules import available
    from ..schedules.spec import ScheduleError, load_spec
    if not schedules:
        raise PlannerError(f"no schedules to plan; built-in: {', '.join(available())}")
    for name in schedules:
        try:
            load_spec(name)
        except ScheduleError as exc:
            raise PlannerError(f"schedule {name!r}: {exc}; built-in: {', '.join(available())}") from None


def _choose_recompute(model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str,
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
            ks = [lay.rec[s].choose(p[s], (bottleneck * t - base[s]) / f) for s in range(K)]
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


def _bound(model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str) -> float | None:
    """An upper bound of the objective of (layout, b, schedule) over re-computation and
    deferral choices; None when even the least memory does not fit."""
    K, f = lay.K, b / model.b0
    p = model.in_flight(schedule, K, M)
    step, _ = model.step_time(lay, schedule, f, M, [0] * K, deferred=range(K))  # all hidden
    if not schedule_traits(schedule, K, M).defers:
        step, _ = model.step_time(lay, schedule, f, M, [0] * K)
    least = [lay.params[s] * model.state_factor + f * lay.rec[s].least(p[s]) for s in range(K)]
    if max(least) > model.cap:
        return None
    return score(objective, *model.figures(step, least))


@dataclass
class _SearchResult:
    best: list[_Candidate]
    evaluated: int
    bounded: int
    least_memory: float


def _search(model: _Model, schedules: Sequence[str], objective: str, depths: Sequence[int] | None,
            micro_batch_sizes: Sequence[int] | None, min_micro_batch: int, keep: int) -> _SearchResult:
    n, P, G = model.n, model.P, model.G
    combos = []
    least_memory = math.inf
    for K in (depths or _divisors(P)):
        if K > n or P % K:
            continue
        r = P // K
        if G % r:
            continue
        lay = model.layout(K)
        for b in _divisors(G // r):
            if (micro_batch_sizes and b not in micro_batch_sizes) or (not micro_batch_sizes and b < min_micro_batch):
                continue
            M = G // (r * b)
            for sched in schedules:
                try:
                    schedule_traits(sched, K, M)
                except PlannerError:
                    continue  # a shape the schedule cannot run (its `requires`)
                bound = _bound(model, lay, sched, b, M, objective)
                if bound is None:
                    f = b / model.b0
                    p = model.in_flight(sched, K, M)
                    least_memory = min(least_memory, max(lay.params[s] * model.state_factor
                                                         + f * lay.rec[s].least(p[s]) for s in range(K)))
                    continue
                combos.append((bound, K, b, M, sched, lay))
    combos.sort(key=lambda x: (-x[0], x[1], x[2], SCHEDULES.index(x[4]) if x[4] in SCHEDULES else 9))
    best: list[_Candidate] = []
    evaluated = 0
    for bound, K, b, M, sched, lay in combos:
        if len(best) >= keep and bound <= best[-1].score:
            break
        evaluated += 1
        got = _choose_recompute(model, lay, sched, b, M, objective)
        if got is None:
            continue
        score, ks, est = got
        best.append(_Candidate(score, (K, b, sched), lay, b, M, sched, ks, est))
        best.sort(key=lambda c: (-c.score, model.summarize_memory(c.est.memory), c.lay.K, c.b))
        del best[keep:]
    return _SearchResult(best, evaluated, len(combos), least_memory)


# ---------------------------------------------------------------------------------------------
# Simulation of a candidate

def _simulate(model: _Model, lay: _Layout, b: int, M: int, schedule: str, ks: Sequence[int],
              deferred: Sequence[int], auto_limit: int) -> _Estimate:
    """Simulate a configuration: deferred stages by the simulator's rule when affordable
    (``auto_limit`` micro-batch-stages of repeated simulation), else ``deferred`` (the
    analytic rule's choice)."""
    from ..schedules import compile as compile_schedule
    from ..schedules.simulator import resolve_auto_params, simulate

    costs = _costs(model, lay, b, ks)
    traits = schedule_traits(schedule, lay.K, M)
    params: dict[str, Any] = {}
    if traits.defers:
        if lay.K * M * (lay.K + 1) * 3 <= auto_limit:
            params = resolve_auto_params(schedule, lay.K, M, costs, {"deferred_stages": "auto"})
        else:
            params = {"deferred_stages": list(deferred)}
    compiled = compile_schedule(schedule, lay.K, M, validate=False, **params)
    # flush schedules repeat identically; deferred and continuous ones reach their steady state
    iterations = 3 if traits.defers or traits.continuous else 1
    res = simulate(compiled, costs, iterations=iterations, critical_path=False)
    p = [max(1, x["peak_activation_microbatches"]) for x in res.per_stage]
    d = list(compiled.params.get("deferred_stages", []))
    mem = model.memory(lay, b / model.b0, p, ks, d, traits.weight_versions)
    return _Estimate(res.step_time, mem, p, d, "simulator")


def _sim_cost(lay: _Layout, M: int, schedule: str) -> int:
    traits = schedule_traits(schedule, lay.K, M)
    return lay.K * M * (3 if traits.defers or traits.continuous else 1)


# ---------------------------------------------------------------------------------------------
# Public entry point

def make_plan(profile: Profile, cluster: Cluster, global_batch: int, *, objective: str = "me",
              memory_cap: float | None = None, schedules: Sequence[str] = SCHEDULES,
              depths: Sequence[int] | None = None, micro_batch_sizes: Sequence[int] | None = None,
              min_micro_batch: int | None = None, state_factor: float = DEFAULT_STATE_FACTOR, memory_metric: str = "mean",
              simulate_top: int = 4, simulate_budget: int = 4096, baselines: bool = True,
              baseline_budget: float = 2e6) -> Plan:
    """Plan ``profile`` on ``cluster`` for ``global_batch`` samples a step.

    ``objective`` names what is maximized (:mod:`.objectives`: 'me' memory efficiency,
    'throughput', or a registered one), always under the device memory and ``memory_cap``. ``depths`` / ``micro_batch_sizes`` restrict the search;
    ``min_micro_batch`` (default profile batch // 16, at least 1) bounds the micro-batch size
    from below unless ``micro_batch_sizes`` lists sizes.
    ``simulate_top`` best analytic candidates are simulated, within ``simulate_budget``
    micro-batch-stages each (larger ones keep their analytic figures). ``baseline_budget``
    caps the O(N^2 K) partition baselines (N^2 K operations); larger ones are skipped."""
    t0 = time.perf_counter()
    check_objective(objective)
    if memory_metric not in ("mean", "max"):
        raise PlannerError(f"memory metric {memory_metric!r}: expected 'mean' or 'max'")
    _check_schedules(schedules)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"global batch {global_batch!r}: must be an integer >= 1")
    cap = cluster.device_memory if memory_cap is None else min(memory_cap, cluster.device_memory)
    model = _Model(profile, cluster, global_batch, state_factor, memory_metric, cap)
    P = cluster.devices
    if not any(P % K == 0 and K <= model.n and global_batch % (P // K) == 0 for K in (depths or _divisors(P))):
        raise PlannerError(f"global batch {global_batch} cannot be split over {P} devices: no pipeline depth K "
                           f"(dividing {P}, at most {model.n} layers{', among ' + str(list(depths)) if depths else ''}) "
                           f"leaves a data-parallel width P/K that divides it")

    if min_micro_batch is None:
        min_micro_batch = max(1, profile.batch_size // 16)
    found = _search(model, list(schedules), objective, depths, micro_batch_sizes, min_micro_batch,
                    keep=max(simulate_top, 1))
    if not found.best:
        least = found.least_memory
        detail = f" the least any configuration needs is {least / GB:.3g} GB per device" if math.isfinite(least) else ""
        if not found.bounded and not math.isfinite(found.least_memory):
            raise PlannerError(f"no micro-batch size to search: the global batch {global_batch} per data-parallel "
                               f"replica has no divisor >= {min_micro_batch} (--min-micro-batch) among the "
                               "allowed sizes")
        raise PlannerError(f"{profile.model!r} does not fit: no configuration of {P} devices with "
                           f"{cap / GB:.3g} GB each (re-computing everything that helps) holds it;{detail}. "
                           "Use more devices, more memory, or a smaller global batch")

    # Refine the best few with the simulator.
    simulated = 0
    ranked = []
    for cand in found.best[:max(simulate_top, 0)]:
        if _sim_cost(cand.lay, cand.M, cand.schedule) > simulate_budget:
            continue
        est = _simulate(model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, cand.est.deferred,
                        auto_limit=simulate_budget)
        simulated += 1
        if max(est.memory) > cap:
            continue
        ranked.append((score(objective, *model.figures(est.step, est.memory)), cand, est))
    if ranked:
        # Equal objective values (within rounding): prefer less memory, then a shallower pipeline.
        ranked.sort(key=lambda x: (-round(x[0], 9), model.summarize_memory(x[2].memory), x[1].lay.K, x[1].b))
        _, chosen, est = ranked[0]
    else:
        chosen, est = found.best[0], found.best[0].est

    plan_baselines = _baselines(model, chosen, est, objective, simulate_budget, baseline_budget) if baselines else []
    return _to_plan(model, chosen, est, objective, memory_cap, plan_baselines, {
        "seconds": round(time.perf_counter() - t0, 4), "configurations_bounded": found.bounded,
        "configurations_evaluated": found.evaluated, "simulated": simulated,
        "schedules": list(schedules), "depths": list(depths) if depths else "divisors of the device count",
        "micro_batch_sizes": list(micro_batch_sizes) if micro_batch_sizes else f">= {min_micro_batch}",
    })


def _prediction(model: _Model, est: _Estimate) -> Prediction:
    thr, scal, m, me = model.figures(est.step, est.memory)
    return Prediction(step_time=est.step, throughput=thr, scalability=scal, memory=m, memory_max=max(est.memory),
                      memory_per_stage=list(est.memory), me=me, fits=max(est.memory) <= model.cap,
                      predicted_by=est.predicted_by)


def _to_plan(model: _Model, cand: _Candidate, est: _Estimate, objective: str, memory_cap: float | None,
             baselines: list[Baseline], search: dict) -> Plan:
    lay, f = cand.lay, cand.b / model.b0
    stages, checkpointed = [], []
    deferred = set(est.deferred)
    for s, (a, e) in enumerate(zip(lay.parts, lay.parts[1:])):
        rec = lay.rec[s]
        layers = rec.layers(cand.ks[s])
        checkpointed += layers
        kept = rec.kept(cand.ks[s])
        stages.append(StagePlan(stage=s, first_layer=a, end_layer=e, checkpointed=layers, forward=f * lay.fwd[s],
                                backward=f * lay.bwd[s], recompute=f * rec.time(cand.ks[s]),
                                param_bytes=lay.params[s], activation_bytes=f * lay.cut_out[s], kept_bytes=f * kept,
                                in_flight=est.in_flight[s], deferred=s in deferred, memory=est.memory[s],
                                activation_memory=f * rec.activations(cand.ks[s], est.in_flight[s])))
    params = {"deferred_stages": sorted(deferred)} if schedule_traits(cand.schedule, lay.K, cand.M).defers else {}
    return Plan(model=model.profile.model, num_layers=model.n, fingerprint=model.profile.fingerprint(),
                profile_batch_size=model.b0, cluster=model.cluster, world_size=model.P, global_batch=model.G,
                objective=objective, memory_metric=model.metric, memory_cap=memory_cap, pipeline_depth=lay.K,
                data_parallel=lay.r, micro_batch_size=cand.b, micro_batches=cand.M, schedule=cand.schedule,
                schedule_params=params, boundaries=list(lay.parts), checkpointed_layers=sorted(checkpointed),
                stages=stages, prediction=_prediction(model, est), single_device_throughput=model.single_throughput,
                baselines=baselines, search=search,
                assumptions={
                    "state_factor": model.state_factor,
                    "state_factor_meaning": "training-state bytes per profiled parameter byte (4: fp32 weights, "
                                            "gradients and two Adam moments)",
                    "time_scaling": "times and activations linear in the micro-batch size",
                    "saved_bytes": "per layer as in the profile (PipeDream profiles: the output activation)",
                    "placement": "pipeline inside nodes, data parallelism across nodes",
                    "memory_metric": f"{model.metric} per-device peak memory",
                    "me_unit": "samples/s per GB",
                })


# ---------------------------------------------------------------------------------------------
# Baselines

def _baselines(model: _Model, cand: _Candidate, est: _Estimate, objective: str, sim_budget: int,
               budget: float) -> list[Baseline]:
    out = [_data_parallel(model)]
    lay, b, M = cand.lay, cand.b, cand.M
    simulate = est.predicted_by == "simulator"

    def evaluate(name, description, layout, schedule, ks=None, recompute=True):
        if ks is None and recompute:
            got = _choose_recompute(model, layout, schedule, b, M, objective)
            ks = got[1] if got else [0] * layout.K
        ks = ks if ks is not None else [0] * layout.K
        f = b / model.b0
        step, deferred = model.step_time(layout, schedule, f, M, ks)
        if simulate and _sim_cost(layout, M, schedule) <= sim_budget:
            e = _simulate(model, layout, b, M, schedule, ks, deferred, auto_limit=sim_budget)
        else:
            p = model.in_flight(schedule, layout.K, M)
            e = _Estimate(step, model.memory(layout, f, p, ks, deferred,
                                             schedule_traits(schedule, layout.K, M).weight_versions), p, deferred)
        checkpointed = sorted(i for s in range(layout.K) for i in layout.rec[s].layers(ks[s]))
        params = {"deferred_stages": e.deferred} if schedule_traits(schedule, layout.K, M).defers else {}
        return Baseline(name=name, description=description, pipeline_depth=layout.K, data_parallel=layout.r,
                        micro_batch_size=b, micro_batches=M, schedule=schedule, schedule_params=params,
                        boundaries=list(layout.parts), checkpointed_layers=checkpointed,
                        prediction=_prediction(model, e))

    out.append(evaluate("gpipe+dp", "GPipe with data parallelism: same depth, width and micro-batches as the plan, "
                                    "balanced stages, no re-computation, all-reduce at the end of the step",
                        lay, "gpipe", recompute=False))
    n, K = model.n, lay.K
    partitions = [("uniform", "DeepSpeed 'uniform' partition (equal layer counts)",
                   lambda: part.uniform(n, K), 0)]
    partitions.append(("parameters", "DeepSpeed 'parameters' partition (partition_balanced over parameter counts)",
                       lambda: part.deepspeed_parameters([round(w / 4) for w in model.params], K), n * n * K))
    c = model.cluster
    ar_bw = c.inter_node_bandwidth if c.nodes > 1 and lay.r > 1 else c.intra_node_bandwidth
    partitions.append(("pipedream", "PipeDream's dynamic program for K stages each replicated r times "
                                    "(compute + 4(r-1)W/(bw r), transfers 2A/(bw r))",
                       lambda: part.pipedream_uniform(model.work, model.params, model.cuts, K, lay.r, ar_bw,
                                                      c.intra_node_bandwidth)[0], n * n * K / 2))
    for name, description, make, cost in partitions:
        description += f"; the plan's schedule ({cand.schedule}), depth, width and micro-batches, re-computation " \
                       "re-chosen"
        if K == 1:
            continue
        if cost > budget:
            out.append(Baseline(name=name, description=description, pipeline_depth=K, data_parallel=lay.r,
                                micro_batch_size=b, micro_batches=M, schedule=cand.schedule,
                                skipped=f"O(N^2 K) = {cost:.3g} operations exceeds the baseline budget {budget:.3g}"))
            continue
        parts = make()
        if len(parts) != K + 1 or any(y <= x for x, y in zip(parts, parts[1:])):
            out.append(Baseline(name=name, description=description, pipeline_depth=K, data_parallel=lay.r,
                                micro_batch_size=b, micro_batches=M, schedule=cand.schedule,
                                skipped=f"partition {parts} has empty stages"))
            continue
        out.append(evaluate(name, description, model.layout(K, parts), cand.schedule))
    return out


def _data_parallel(model: _Model) -> Baseline:
    """Plain data parallelism on every device, all-reduce overlapped with the last micro-batch's
    backward (bucketed, as PyTorch DDP). Micro-batch = G/P if it fits, else the fewest
    accumulation steps that fit."""
    P, G = model.P, model.G
    description = ("data parallelism on all devices, gradient all-reduce overlapped with the backward of the last "
                   "micro-batch, no re-computation")
    if G % P:
        return Baseline(name="dp", description=description, pipeline_depth=1, data_parallel=P, micro_batch_size=1,
                        micro_batches=1, schedule="1f1b", skipped=f"global batch {G} is not divisible by {P} devices")
    lay = model.layout(1, [0, model.n])
    per = G // P
    choice = None
    for b in sorted(_divisors(per), reverse=True):
        f, M = b / model.b0, per // b
        mem = model.memory(lay, f, [1], [0], [])
        choice = (b, M, f, mem)
        if mem[0] <= model.cap:
            break
    b, M, f, mem = choice
    compute_b = f * lay.bwd[0]
    step = M * f * (lay.fwd[0] + lay.bwd[0]) + max(0.0, lay.ar_work[0] - compute_b)
    pred = _prediction(model, _Estimate(step, mem, [1], []))
    return Baseline(name="dp", description=description, pipeline_depth=1, data_parallel=P, micro_batch_size=b,
                    micro_batches=M, schedule="1f1b", boundaries=[0, model.n], prediction=pred)
