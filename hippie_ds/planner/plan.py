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
  backward, from its compiled streams); it knows no schedule by name. A schedule with virtual
  stages (v model chunks per stage: interleaved-1f1b, zb-v, hippie-interleaved) cuts K v parts
  (:func:`partition.chunked_partition`, balancing the stages' sums; needs K v <= layers), counts
  each chunk's in-flight micro-batches and runs the step formulas below on v M chunk micro-batches.

Cost model (all of it in :class:`_Config.estimate`; the simulator refines the best few):

* times and activations scale linearly with b (``profile.py``); stage s costs F_s, B_s (+ its
  re-computation), p2p c_s = latency + cut bytes / link bandwidth (intra-node when both
  stages share a node: the pipeline is placed inside nodes, data parallelism across them, as
  Hippie does); ring all-reduce of stage s: a_s = 2 (r-1)/r W_s / bw + 2 (r-1) latency over
  the inter-node link when the group spans nodes, all stages sharing it;
* compute of a flush pipeline: T_c = (M-1) max_s(F_s+B_s+2c_{s-1}+2c_s) + sum_s(F_s+B_s) +
  2 sum_s c_s (GPipe order: the forward and backward maxima separately); a split backward
  (zero-bubble: I_s = B_s - w_s + x_s, the input gradient with the split's extra cost x_s (the
  profile's ``split_extra``: the engine's two autograd passes beyond the whole backward), and w_s,
  the parameter gradients, from the profile's ``backward_weight``) takes the largest of five lower
  bounds of the step
  (:func:`.split_bounds.split_backward_time`; ZB-H1 with equal stages: M (F+I+w) + (K-1)
  max(F, I, F+I-w)), so its bound never prunes wrongly; flush schedules
  all-reduce at the end (the link drains the work as stages finish, last stage first);
  Hippie's stage s all-reduces right after its last backward and must finish before the next
  step's first forward reaches it; a stage that cannot defers (the simulator's rule, see
  ``resolve_auto_params``), and the link must carry all stages' work once per step;
* memory per device of stage s (:meth:`.model._Model.memory`) = W_s * state_factor (default
  from the profile's precision, :meth:`.profile.Profile.state_factor`: an fp32 profile with
  fp32 Adam: weights, gradients, two moments = 16 bytes a parameter = 4 x the profiled
  parameter bytes; bf16 with DeepSpeed's BF16_Optimizer 18 bytes a parameter = 4.5 x fp32-sized
  parameter bytes) + 2 x D_s for a deferred stage delaying D_s of its parameter bytes (the
  delayed gradient's buffer and the default staleness correction's delta of those weights;
  D_s = W_s until the layers are chosen) + activations: the peak
  number of micro-batches in flight (1f1b: min(K-s, M); gpipe: M; hippie: M, the fused last
  stage 1; zb-h1: K on every stage, activations are held until W; from the simulator when it
  runs) times the bytes kept per micro-batch (the last part's include what the loss saves),
  plus the largest re-computed run (``recompute.py``) + the largest working memory of one of
  the stage's layers (the loss's on the last part): what a forward+backward needs beyond what
  it keeps (the gradients in flight, temporaries; measured on CUDA, else estimated,
  :mod:`.profile`). The loss's time joins the last part's. Optimizer step time is not modelled (0);
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
from typing import Sequence

from .assemble import _with_parameters, to_plan
from .cluster import Cluster
from .objectives import check_objective, score
from .baselines import plan_baselines
from .evaluate import choose_recompute, deferred_layers, objective_value, prediction, sim_cost, simulate_configuration
from .job_candidates import JobCandidate, job_candidates
from .job_shape import Job
from .model import _Candidate, _divisors, _Estimate, _Layout, _Model
from .candidates import climb_cuts, runner_ups
from .plan_file import GB, Baseline, Plan
from .plan_file import SCHEDULES
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


def _check_boundaries(boundaries: Sequence[int], depths: Sequence[int] | None, n: int) -> None:
    b = list(boundaries)
    if not depths or len(depths) != 1:
        raise PlannerError(f"boundaries {b}: give one pipeline depth with them (depths {depths})")
    if len(b) < 2 or b[0] != 0 or b[-1] != n or any(y <= x for x, y in zip(b, b[1:])):
        raise PlannerError(f"boundaries {b}: need strictly increasing entries from 0 to {n} (the layer count)")


def _bound(model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str) -> float | None:
    """An upper bound of the objective of (layout, b, schedule) over re-computation and
    deferral choices; None when even the least memory does not fit."""
    K, f = lay.K, b / model.b0
    p = model.in_flight(schedule, K, M)
    step, _ = model.step_time(lay, schedule, f, M, [0] * K, deferred=range(K))  # all hidden
    if not schedule_traits(schedule, K, M).defers:
        step, _ = model.step_time(lay, schedule, f, M, [0] * K)
    least = model.least_memory(lay, f, p)
    if max(least) > model.cap:
        return None
    return score(objective, *model.figures(step, least))


@dataclass
class _SearchResult:
    best: list[_Candidate]
    evaluated: int
    bounded: int
    least_memory: float
    too_few_layers: dict[str, tuple[int, int]]


def _search(
    model: _Model,
    schedules: Sequence[str],
    objective: str,
    depths: Sequence[int] | None,
    micro_batch_sizes: Sequence[int] | None,
    min_micro_batch: int,
    keep: int,
    boundaries: Sequence[int] | None = None,
) -> _SearchResult:
    n, P, G = model.n, model.P, model.G
    combos = []
    least_memory = math.inf
    too_few_layers: dict[str, tuple[int, int]] = {}  # schedule -> (the least depth K, v) with K v parts > layers
    for K in depths or _divisors(P):
        if K > n or P % K:
            continue
        r = P // K
        if G % r:
            continue
        layouts: dict[tuple[int, str], _Layout] = {}
        for b in _divisors(G // r):
            if (micro_batch_sizes and b not in micro_batch_sizes) or (not micro_batch_sizes and b < min_micro_batch):
                continue
            M = G // (r * b)
            for sched in schedules:
                try:
                    traits = schedule_traits(sched, K, M)
                except PlannerError:
                    continue  # a shape the schedule cannot run (its `requires`)
                if traits.parts > n:  # virtual stages: every chunk needs a layer
                    if K < too_few_layers.get(sched, (K + 1,))[0]:
                        too_few_layers[sched] = (K, traits.virtual_stages)
                    continue
                shape = (traits.virtual_stages, traits.layout if traits.virtual_stages > 1 else "interleaved")
                if boundaries is not None and len(boundaries) != traits.parts + 1:
                    continue  # given boundaries cut another number of parts
                if shape not in layouts:
                    layouts[shape] = model.layout(K, parts=boundaries, v=shape[0], kind=shape[1])
                lay = layouts[shape]
                bound = _bound(model, lay, sched, b, M, objective)
                if bound is None:
                    f = b / model.b0
                    p = model.in_flight(sched, K, M)
                    least_memory = min(least_memory, max(model.least_memory(lay, f, p)))
                    continue
                combos.append((bound, K, b, M, sched, lay))
    combos.sort(key=lambda x: (-x[0], x[1], x[2], SCHEDULES.index(x[4]) if x[4] in SCHEDULES else 9))
    best: list[_Candidate] = []
    evaluated = 0
    for bound, K, b, M, sched, lay in combos:
        if len(best) >= keep and bound <= best[-1].score:
            break
        evaluated += 1
        got = choose_recompute(model, lay, sched, b, M, objective)
        if got is None:
            continue
        score, ks, est = got
        best.append(_Candidate(score, (K, b, sched), lay, b, M, sched, ks, est))
        best.sort(key=lambda c: (-c.score, model.summarize_memory(c.est.memory), c.lay.K, c.b))
        del best[keep:]
    return _SearchResult(best, evaluated, len(combos), least_memory, too_few_layers)


# ---------------------------------------------------------------------------------------------
# Simulation of a candidate

# ---------------------------------------------------------------------------------------------
# Public entry point


def make_plan(
    profile: Profile,
    cluster: Cluster,
    global_batch: int,
    *,
    objective: str = "me",
    memory_cap: float | None = None,
    schedules: Sequence[str] = SCHEDULES,
    depths: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    min_micro_batch: int | None = None,
    state_factor: float | None = None,
    memory_metric: str = "mean",
    simulate_top: int = 4,
    simulate_budget: int = 4096,
    baselines: bool = True,
    baseline_budget: float = 2e6,
    staleness_price: float | None = None,
    candidates: int = 5,
    boundaries: Sequence[int] | None = None,
    job: Job | None = None,
    job_note: str | None = None,
) -> Plan:
    """Plan ``profile`` on ``cluster`` for ``global_batch`` samples a step.

    ``objective`` names what is maximized (:mod:`.objectives`: 'me' memory efficiency,
    'throughput', or a registered one), always under the device memory and ``memory_cap``. ``depths`` /
    ``micro_batch_sizes`` restrict the search; ``min_micro_batch`` (default profile batch // 16, at least 1) bounds the
    micro-batch size from below unless ``micro_batch_sizes`` lists sizes.
    ``simulate_top`` best analytic candidates are simulated, within ``simulate_budget``
    micro-batch-stages each (larger ones keep their analytic figures). ``baseline_budget``
    caps the O(N^2 K) partition baselines (N^2 K operations); larger ones are skipped.
    ``staleness_price``: the price of a stale gradient (None: the measured one,
    :data:`.objectives.PRICE_SOURCE`): a priced objective chooses deferred layers and ranks by it,
    every plan records the steps factor it gives. ``job``: the job as it is (:mod:`.job_candidates`),
    a candidate beside the search's, so the plan is never predicted worse than it; ``job_note``: why
    there is none.
    ``state_factor``: training-state bytes per profiled parameter byte (None: the profile's
    precision decides, :meth:`.profile.Profile.state_factor`). ``candidates``: how many runner-ups
    the plan lists by predicted step (:mod:`.candidates`; 0: none). ``boundaries``: plan this
    partition (K·v+1 entries, for the one depth in ``depths``) instead of searching one."""
    t0 = time.perf_counter()
    check_objective(objective)
    if memory_metric not in ("mean", "max"):
        raise PlannerError(f"memory metric {memory_metric!r}: expected 'mean' or 'max'")
    _check_schedules(schedules)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"global batch {global_batch!r}: must be an integer >= 1")
    cap = cluster.device_memory if memory_cap is None else min(memory_cap, cluster.device_memory)
    if state_factor is None:
        state_factor = profile.state_factor()
    model = _Model(profile, cluster, global_batch, state_factor, memory_metric, cap)
    P = cluster.devices
    if not any(P % K == 0 and K <= model.n and global_batch % (P // K) == 0 for K in (depths or _divisors(P))):
        raise PlannerError(
            f"global batch {global_batch} cannot be split over {P} devices: no pipeline depth K "
            f"(dividing {P}, at most {model.n} "
            f"layers{', among ' + str(list(depths)) if depths else ''}) leaves a data-parallel width "
            f"P/K that divides it"
        )

    if min_micro_batch is None:
        min_micro_batch = max(1, profile.batch_size // 16)
    if boundaries is not None:
        _check_boundaries(boundaries, depths, model.n)
    found = _search(
        model,
        list(schedules),
        objective,
        depths,
        micro_batch_sizes,
        min_micro_batch,
        keep=max(simulate_top, 1),
        boundaries=boundaries,
    )
    if not found.best:
        if not found.bounded and found.too_few_layers:
            raise PlannerError(
                "too few layers for the schedules' model chunks: "
                + "; ".join(
                    f"schedule {name!r} runs {v} model chunks per stage, so {K} stages need {K * v} parts of at least "
                    f"one layer; the profile has {model.n} layers"
                    for name, (K, v) in found.too_few_layers.items()
                )
                + ". Use fewer stages (--stages) or a schedule without virtual stages"
            )
        least = found.least_memory
        detail = f" the least any configuration needs is {least / GB:.3g} GB per device" if math.isfinite(least) else ""
        if not found.bounded and not math.isfinite(found.least_memory):
            raise PlannerError(
                f"no micro-batch size to search: the global batch {global_batch} per data-parallel "
                f"replica has no divisor >= {min_micro_batch} (--min-micro-batch) among the "
                "allowed sizes"
            )
        raise PlannerError(
            f"{profile.model!r} does not fit: no configuration of {P} devices with "
            f"{cap / GB:.3g} GB each (re-computing everything that helps) holds it;{detail}. "
            "Use more devices, more memory, or a smaller global batch"
        )

    from ..schedules.deferral import STALENESS_PRICE

    price = STALENESS_PRICE if staleness_price is None else staleness_price  # what the plan records
    chosen, est, delayed, simulated, ranked = _refine(
        model, found, objective, simulate_top, simulate_budget, cap, price
    )
    cut_moves, evaluated_cuts = 0, {}  # the cuts the climb simulated, which the runner-ups reuse
    if ranked and boundaries is None:  # the simulated best's cut, moved while the simulator says it gains
        chosen, est, delayed, cut_moves = climb_cuts(
            model, chosen, est, delayed, objective, simulate_budget, cap, price, evaluated=evaluated_cuts
        )
    jobs = (
        job_candidates(model, job, list(schedules), objective, simulate_budget, price, baseline_budget) if job else []
    )
    chosen_from, best_job = "search", _best_job(jobs)
    if best_job is not None and (not ranked or best_job.value >= objective_value(model, est, objective) * (1 - 1e-9)):
        chosen, est, delayed, chosen_from = best_job.cand, best_job.est, best_job.delayed, "job"
    compared = [_job_row(model, j, objective) for j in jobs]
    if baselines:
        compared += plan_baselines(
            model,
            chosen,
            est,
            objective,
            simulate_budget,
            baseline_budget,
            dp_micro_batch=job.micro_batch_size if job else None,
            staleness_price=price,
        )
    others = (
        runner_ups(model, chosen, est, ranked, objective, simulate_budget, cap, price, candidates, evaluated_cuts)
        if candidates
        else []
    )
    note = (job.describe() if best_job else f"{job.describe()}; none of its configurations fits") if job else job_note
    return to_plan(
        model,
        chosen,
        est,
        delayed,
        objective,
        memory_cap,
        compared,
        price,
        others,
        {
            "seconds": round(time.perf_counter() - t0, 4),
            "configurations_bounded": found.bounded,
            "configurations_evaluated": found.evaluated,
            "simulated": simulated,
            "cut_moves": cut_moves,
            "schedules": list(schedules),
            "depths": list(depths) if depths else "divisors of the device count",
            "micro_batch_sizes": list(micro_batch_sizes) if micro_batch_sizes else f">= {min_micro_batch}",
        },
        job=note,
        chosen_from=chosen_from,
    )


def _best_job(jobs: Sequence[JobCandidate]) -> JobCandidate | None:
    """The job as it is at its best by the objective (the first of equals: the job's own schedule
    and DeepSpeed's default partition first), among the configurations that fit."""
    best = None
    for j in jobs:
        if j.fits and (best is None or j.value > best.value * (1 + 1e-9)):
            best = j
    return best


def _job_row(model: _Model, j: JobCandidate, objective: str) -> Baseline:
    """A configuration of the job as it is, as a row beside the plan."""
    from .candidates import checkpointed

    lay = j.cand.lay
    params = (
        {"deferred_stages": list(j.est.deferred)} if schedule_traits(j.cand.schedule, lay.K, j.cand.M).defers else {}
    )
    return Baseline(
        name=j.name,
        description=j.description,
        pipeline_depth=lay.K,
        data_parallel=lay.r,
        micro_batch_size=j.cand.b,
        micro_batches=j.cand.M,
        schedule=j.cand.schedule,
        schedule_params=params,
        boundaries=list(lay.parts),
        checkpointed_layers=checkpointed(lay, j.cand.ks),
        deferred_layers={
            str(s): _with_parameters(model, range(lay.parts[s], lay.parts[s + 1]), c.layers)
            for s, c in j.delayed.items()
        },
        prediction=prediction(model, j.est, objective, model.working_memory(lay, j.cand.b / model.b0)),
    )


def _refine(
    model: _Model,
    found: _SearchResult,
    objective: str,
    simulate_top: int,
    simulate_budget: int,
    cap: float,
    staleness_price: float,
) -> tuple[_Candidate, _Estimate, dict, int, list]:
    """Simulate the best few analytic candidates, choose each one's deferred layers as the objective
    asks (:func:`.evaluate.deferred_layers`), and rank them by the objective's figure at the chosen
    layers (a layout that is fast only while whole stages are stale does not win): (the chosen
    candidate, its estimate, its {deferred stage: LayersChoice}, how many were simulated, every
    ranked (figure, candidate, estimate, choice))."""
    simulated = 0
    ranked = []
    for cand in found.best[: max(simulate_top, 0)]:
        if sim_cost(cand.lay, cand.M, cand.schedule) > simulate_budget:
            continue
        est = simulate_configuration(
            model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, cand.est.deferred, auto_limit=simulate_budget
        )
        simulated += 1
        est, delayed = deferred_layers(
            model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, est, staleness_price, objective
        )
        if max(est.memory) > cap:
            continue
        ranked.append((objective_value(model, est, objective), cand, est, delayed))
    if ranked:
        # Equal objective values (within rounding): prefer less memory, then a shallower pipeline.
        ranked.sort(key=lambda x: (-round(x[0], 9), model.summarize_memory(x[2].memory), x[1].lay.K, x[1].b))
        _, chosen, est, delayed = ranked[0]
        return chosen, est, delayed, simulated, ranked
    return found.best[0], found.best[0].est, {}, simulated, ranked


# ---------------------------------------------------------------------------------------------
# Baselines
