"""The job as it is, a candidate of every plan: the job's stages and micro-batch size
(:class:`.job_shape.Job`) with DeepSpeed's default partition ('parameters') and its 'uniform' one,
no re-computation, under the job's schedule and every schedule considered, each deferring schedule
with the deferral a job without a plan runs (``hippie.deferred_layers``' default) and with the one
the plan's objective searches. The planner ranks them with its own candidates by the same figure,
so a plan is never predicted worse than the job it would replace. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .evaluate import deferred_layers, objective_price, objective_value, sim_cost, simulate_configuration
from .job_shape import Job
from .model import _Candidate, _Estimate, _Model
from .traits import schedule_traits
from .profile import PlannerError


@dataclass
class JobCandidate:
    name: str  # job:PARTITION[:searched]
    description: str
    cand: _Candidate
    est: _Estimate
    delayed: dict  # {deferred stage: LayersChoice} of a searched deferral; {}: the config's default
    value: float  # the objective's figure
    fits: bool


def deepspeed_partitions(model: _Model, parts: int) -> list[tuple[str, str, Callable[[], list[int]], float]]:
    """DeepSpeed's partitions of the model into ``parts`` parts: (name, description, what computes
    its boundaries, the operations that takes): 'parameters' (PipelineModule's default
    partition_method, hippie-ds's without a plan) and 'uniform'."""
    from . import partition as part

    n = model.n
    return [
        (
            "parameters",
            "DeepSpeed 'parameters' partition (partition_balanced over parameter counts; PipelineModule's default)",
            lambda: part.deepspeed_parameters([round(w / 4) for w in model.params], parts),
            n * n * parts,
        ),
        ("uniform", "DeepSpeed 'uniform' partition (equal layer counts)", lambda: part.uniform(n, parts), 0),
    ]


def job_candidates(
    model: _Model,
    job: Job,
    schedules: Sequence[str],
    objective: str,
    simulate_budget: int,
    staleness_price: float | None,
    budget: float,
) -> list[JobCandidate]:
    """Every configuration of the job as it is (module docstring), evaluated as the plan's are:
    simulated within ``simulate_budget`` micro-batch-stages, else analytic; a partition that costs
    more than ``budget`` operations to compute is left out."""
    K, b = job.stages, job.micro_batch_size
    r = model.P // K
    M = model.G // (r * b)
    order = ([job.schedule] if job.schedule else []) + [s for s in schedules if s != job.schedule]
    out: list[JobCandidate] = []
    for schedule in order:
        try:
            traits = schedule_traits(schedule, K, M)
        except PlannerError:
            continue  # a shape the schedule cannot run
        if traits.parts > model.n:
            continue
        kind = traits.layout if traits.virtual_stages > 1 else "interleaved"
        for name, description, make, cost in deepspeed_partitions(model, traits.parts):
            if cost > budget:
                continue
            parts = make()
            if len(parts) != traits.parts + 1 or any(y <= x for x, y in zip(parts, parts[1:])):
                continue  # an empty stage
            lay = model.layout(K, parts, traits.virtual_stages, kind)
            ks = [0] * K
            f = b / model.b0
            step, deferred = model.step_time(lay, schedule, f, M, ks)
            p = model.in_flight(schedule, K, M)
            analytic = _Estimate(step, model.memory(lay, f, p, ks, deferred, traits.weight_versions), p, deferred)
            cand = _Candidate(0.0, (K, b, schedule), lay, b, M, schedule, ks, analytic)
            simulate = sim_cost(lay, M, schedule) <= simulate_budget
            what = f"the job as it is: {job.describe()}; {description}, no re-computation, schedule {schedule}"
            rows = []
            if simulate:
                rows.append(
                    (
                        "",
                        simulate_configuration(
                            model,
                            lay,
                            b,
                            M,
                            schedule,
                            ks,
                            deferred,
                            simulate_budget,
                            default_deferral=True,
                            staleness_price=objective_price(objective, staleness_price),
                        ),
                        {},
                        "the default deferral (hippie.deferred_layers 'untied')" if traits.defers else "",
                    )
                )
                if traits.defers and lay.v == 1:
                    whole = simulate_configuration(model, lay, b, M, schedule, ks, deferred, simulate_budget)
                    est, delayed = deferred_layers(model, lay, b, M, schedule, ks, whole, staleness_price, objective)
                    rows.append((":searched", est, delayed, f"the deferral the {objective} objective searches"))
            else:
                rows.append(("", analytic, {}, "analytic"))
            for suffix, est, delayed, how in rows:
                out.append(
                    JobCandidate(
                        f"job:{name}{suffix}",
                        what + (f"; {how}" if how else ""),
                        cand,
                        est,
                        delayed,
                        objective_value(model, est, objective),
                        max(est.memory) <= model.cap,
                    )
                )
    return out
