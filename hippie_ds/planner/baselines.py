"""The baselines a plan is compared with: plain data parallelism, GPipe with data parallelism
at the plan's shape, and DeepSpeed's and PipeDream's partitions under the plan's schedule.
Pure Python."""
from __future__ import annotations

from . import partition as part
from .evaluate import choose_recompute, prediction, sim_cost, simulate_configuration
from .model import _Candidate, _divisors, _Estimate, _Model
from .plan_file import Baseline
from .traits import schedule_traits


def plan_baselines(model: _Model, cand: _Candidate, est: _Estimate, objective: str, sim_budget: int,
                   budget: float) -> list[Baseline]:
    out = [_data_parallel(model)]
    lay, b, M = cand.lay, cand.b, cand.M
    simulate = est.predicted_by == "simulator"

    def evaluate(name, description, layout, schedule, ks=None, recompute=True):
        if ks is None and recompute:
            got = choose_recompute(model, layout, schedule, b, M, objective)
            ks = got[1] if got else [0] * layout.K
        ks = ks if ks is not None else [0] * layout.K
        f = b / model.b0
        step, deferred = model.step_time(layout, schedule, f, M, ks)
        if simulate and sim_cost(layout, M, schedule) <= sim_budget:
            e = simulate_configuration(model, layout, b, M, schedule, ks, deferred, auto_limit=sim_budget)
        else:
            p = model.in_flight(schedule, layout.K, M)
            e = _Estimate(step, model.memory(layout, f, p, ks, deferred,
                                             schedule_traits(schedule, layout.K, M).weight_versions), p, deferred)
        checkpointed = sorted(i for s in range(layout.K) for i in layout.rec[s].layers(ks[s]))
        params = {"deferred_stages": e.deferred} if schedule_traits(schedule, layout.K, M).defers else {}
        return Baseline(name=name, description=description, pipeline_depth=layout.K, data_parallel=layout.r,
                        micro_batch_size=b, micro_batches=M, schedule=schedule, schedule_params=params,
                        boundaries=list(layout.parts), checkpointed_layers=checkpointed,
                        prediction=prediction(model, e))

    out.append(evaluate("gpipe+dp", "GPipe with data parallelism: same depth, width and micro-batches as the plan, "
                                    "balanced stages, no re-computation, all-reduce at the end of the step",
                        lay if lay.v == 1 else model.layout(lay.K), "gpipe", recompute=False))
    # With virtual stages the partitions cut K x v parts (DeepSpeed's method over the parts, as
    # hippie_ds.PipelineModule does without a plan), placed by the plan's layout.
    n, K, V = model.n, lay.K, lay.K * lay.v
    partitions = [("uniform", "DeepSpeed 'uniform' partition (equal layer counts)",
                   lambda: part.uniform(n, V), 0)]
    partitions.append(("parameters", "DeepSpeed 'parameters' partition (partition_balanced over parameter counts)",
                       lambda: part.deepspeed_parameters([round(w / 4) for w in model.params], V), n * n * V))
    c = model.cluster
    ar_bw = c.inter_node_bandwidth if c.nodes > 1 and lay.r > 1 else c.intra_node_bandwidth
    partitions.append(("pipedream", "PipeDream's dynamic program for K stages each replicated r times "
                                    "(compute + 4(r-1)W/(bw r), transfers 2A/(bw r))",
                       lambda: part.pipedream_uniform(model.work, model.params, model.cuts, V, lay.r, ar_bw,
                                                      c.intra_node_bandwidth)[0], n * n * V / 2))
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
        if len(parts) != V + 1 or any(y <= x for x, y in zip(parts, parts[1:])):
            out.append(Baseline(name=name, description=description, pipeline_depth=K, data_parallel=lay.r,
                                micro_batch_size=b, micro_batches=M, schedule=cand.schedule,
                                skipped=f"partition {parts} has empty stages"))
            continue
        out.append(evaluate(name, description, model.layout(K, parts, lay.v, lay.kind), cand.schedule))
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
    pred = prediction(model, _Estimate(step, mem, [1], []))
    return Baseline(name="dp", description=description, pipeline_depth=1, data_parallel=P, micro_batch_size=b,
                    micro_batches=M, schedule="1f1b", boundaries=[0, model.n], prediction=pred)
