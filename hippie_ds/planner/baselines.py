"""The baselines a plan is compared with: data parallelism as DeepSpeed's engine runs it, GPipe with
data parallelism at the plan's shape, and DeepSpeed's and PipeDream's partitions under the plan's
schedule (a deferring schedule with the deferral a job without a plan runs). Pure Python."""

from __future__ import annotations

from . import partition as part
from .evaluate import choose_recompute, objective_price, prediction, sim_cost, simulate_configuration
from .job_candidates import deepspeed_partitions
from .model import _Candidate, _divisors, _Estimate, _Model
from .plan_file import Baseline
from .traits import schedule_traits


def plan_baselines(
    model: _Model,
    cand: _Candidate,
    est: _Estimate,
    objective: str,
    sim_budget: int,
    budget: float,
    dp_micro_batch: int | None = None,
    staleness_price: float | None = None,
) -> list[Baseline]:
    """The baselines beside the plan ``cand``; ``dp_micro_batch``: data parallelism's micro-batch size
    (the job's; None: the largest that fits)."""
    out = [data_parallel(model, objective, dp_micro_batch)]
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
            e = simulate_configuration(
                model,
                layout,
                b,
                M,
                schedule,
                ks,
                deferred,
                auto_limit=sim_budget,
                default_deferral=True,
                staleness_price=objective_price(objective, staleness_price),
            )
        else:
            p = model.in_flight(schedule, layout.K, M)
            e = _Estimate(
                step,
                model.memory(layout, f, p, ks, deferred, schedule_traits(schedule, layout.K, M).weight_versions),
                p,
                deferred,
            )
        checkpointed = sorted(i for s in range(layout.K) for i in layout.rec[s].layers(ks[s]))
        params = {"deferred_stages": e.deferred} if schedule_traits(schedule, layout.K, M).defers else {}
        return Baseline(
            name=name,
            description=description,
            pipeline_depth=layout.K,
            data_parallel=layout.r,
            micro_batch_size=b,
            micro_batches=M,
            schedule=schedule,
            schedule_params=params,
            boundaries=list(layout.parts),
            checkpointed_layers=checkpointed,
            prediction=prediction(model, e, objective, model.working_memory(layout, f)),
        )

    out.append(
        evaluate(
            "gpipe+dp",
            "GPipe with data parallelism: same depth, width and micro-batches as the plan, "
            "balanced stages, no re-computation, all-reduce at the end of the step",
            lay if lay.v == 1 else model.layout(lay.K),
            "gpipe",
            recompute=False,
        )
    )
    # With virtual stages the partitions cut K x v parts (DeepSpeed's method over the parts, as
    # hippie_ds.PipelineModule does without a plan), placed by the plan's layout.
    n, K, V = model.n, lay.K, lay.K * lay.v
    partitions = list(reversed(deepspeed_partitions(model, V)))
    c = model.cluster
    ar_bw = c.inter_node_bandwidth if c.nodes > 1 and lay.r > 1 else c.intra_node_bandwidth
    partitions.append(
        (
            "pipedream",
            "PipeDream's dynamic program for K stages each replicated r times "
            "(compute + 4(r-1)W/(bw r), transfers 2A/(bw r))",
            lambda: part.pipedream_uniform(
                model.work, model.params, model.cuts, V, lay.r, ar_bw, c.intra_node_bandwidth
            )[0],
            n * n * V / 2,
        )
    )
    for name, description, make, cost in partitions:
        description += (
            f"; the plan's schedule ({cand.schedule}), depth, width and micro-batches, re-computation re-chosen"
        )
        if K == 1:
            continue
        if cost > budget:
            out.append(
                Baseline(
                    name=name,
                    description=description,
                    pipeline_depth=K,
                    data_parallel=lay.r,
                    micro_batch_size=b,
                    micro_batches=M,
                    schedule=cand.schedule,
                    skipped=f"O(N^2 K) = {cost:.3g} operations exceeds the baseline budget {budget:.3g}",
                )
            )
            continue
        parts = make()
        if len(parts) != V + 1 or any(y <= x for x, y in zip(parts, parts[1:])):
            out.append(
                Baseline(
                    name=name,
                    description=description,
                    pipeline_depth=K,
                    data_parallel=lay.r,
                    micro_batch_size=b,
                    micro_batches=M,
                    schedule=cand.schedule,
                    skipped=f"partition {parts} has empty stages",
                )
            )
            continue
        out.append(evaluate(name, description, model.layout(K, parts, lay.v, lay.kind), cand.schedule))
    return out


def data_parallel(model: _Model, objective: str | None = None, micro_batch: int | None = None) -> Baseline:
    """Data parallelism as DeepSpeed's engine runs it: every device holds the model, ``micro_batch``
    samples a micro-batch (the job's; None or too large to fit: the largest divisor of G/P that
    fits) over G/(P b) accumulation steps, and the gradient all-reduced once after the last backward
    (DeepSpeed's engine reduces at the accumulation boundary, after the backward: nothing overlaps
    it), then the optimizer step."""
    P, G = model.P, model.G
    description = (
        "data parallelism as DeepSpeed's engine runs it: gradient accumulation, the all-reduce after "
        "the last backward (not overlapped), no re-computation"
    )
    if G % P:
        return Baseline(
            name="dp",
            description=description,
            pipeline_depth=1,
            data_parallel=P,
            micro_batch_size=1,
            micro_batches=1,
            schedule="1f1b",
            skipped=f"global batch {G} is not divisible by {P} devices",
        )
    lay = model.layout(1, [0, model.n])
    per = G // P
    sizes = sorted(_divisors(per), reverse=True)
    if micro_batch is not None and per % micro_batch == 0:
        sizes = [micro_batch] + [b for b in sizes if b < micro_batch]
    choice = None
    for b in sizes:
        f, M = b / model.b0, per // b
        mem = model.memory(lay, f, [1], [0], [])
        choice = (b, M, f, mem)
        if mem[0] <= model.cap:
            break
    b, M, f, mem = choice
    step = dp_step(model, lay, f, M)
    pred = prediction(model, _Estimate(step, mem, [1], []), objective, model.working_memory(lay, f))
    return Baseline(
        name="dp",
        description=description,
        pipeline_depth=1,
        data_parallel=P,
        micro_batch_size=b,
        micro_batches=M,
        schedule="1f1b",
        boundaries=[0, model.n],
        prediction=pred,
    )


def dp_step(model: _Model, lay, f: float, M: int) -> float:
    """DeepSpeed's data-parallel step: M forwards and backwards (each at least its host's time), then
    the whole gradient's all-reduce, then the optimizer step's host time."""
    compute, _, _, _ = model.compute_time(lay, "1f1b", f, M, [0])
    return compute + lay.ar_work[0] + model.host_step(lay)
