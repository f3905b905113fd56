"""Cost-based ``'auto'`` schedule parameters: hippie's deferred stages chosen by simulating the
schedule under measured costs. Pure Python."""

from __future__ import annotations

from typing import Any, Mapping

from ..costs import Costs
from ..simulator import SimResult, SimulationError, simulate


def resolve_auto_params(
    spec_or_name,
    stages: int,
    micro_batches: int,
    costs: Costs,
    params: Mapping[str, Any] | None = None,
    iterations: int = 3,
) -> dict:
    """Resolve a schedule's ``'auto'`` stage-list parameters (hippie's ``deferred_stages``)
    from costs; other parameters as given or declared. Returns the full params dict.

    Rule (the brief's "a stage defers when its all-reduce time exceeds its slack"):

    * slack of stage s (:func:`stage_slack`), from a simulation with nothing deferred;
    * need of stage s = its simulated all-reduce duration (link sharing with the all-reduces
      running beside it included) + its optimizer_time;
    * greedily: simulate with the current deferred set, defer the non-deferred stage whose need
      exceeds its slack by the most (ties: the earlier stage), repeat until every non-deferred
      stage fits. One at a time because the durations depend on which all-reduces overlap;
      only where needed because deferral changes the update rule (one-step-stale gradients).
      A stage without an all-reduce (data_parallel 1, no parameters) never defers.

    Every 'auto' stage-list parameter is resolved with this rule (a parameter listing the
    stages that take the buffered path)."""
    from ..compiler import compile_schedule, resolve_params
    from ..spec import ScheduleSpec, load_spec

    spec = spec_or_name if isinstance(spec_or_name, ScheduleSpec) else load_spec(spec_or_name)
    given = dict(params or {})
    auto = [
        n
        for n, p in spec.params.items()
        if p.kind == "stage_list" and (given.get(n) if given.get(n) is not None else p.default) == "auto"
    ]
    if not auto:
        return resolve_params(spec, stages, micro_batches, given)
    if costs.num_stages != stages:
        raise SimulationError(f"costs describe {costs.num_stages} stages, asked to plan {stages}")

    def run(deferred: list[int], c: Costs) -> SimResult:
        compiled = compile_schedule(spec, stages, micro_batches, {**given, **{n: deferred for n in auto}})
        return simulate(compiled, c, iterations, critical_path=False)

    slack = stage_slack(
        compile_schedule(spec, stages, micro_batches, {**given, **{n: [] for n in auto}}), costs, iterations
    )

    deferred: list[int] = []
    while True:
        res = run(deferred, costs)
        over = []
        for s in range(stages):
            if s in deferred or costs.allreduce_time(s) <= 0:
                continue  # no all-reduce to hide: deferring would only make the update stale
            need = res.per_stage[s]["allreduce_time"] + costs.stages[s].optimizer_time
            if need > slack[s] * (1 + 1e-9):
                over.append((need - slack[s], -s))
        if not over:
            break
        deferred = sorted(deferred + [-max(over)[1]])
    return resolve_params(spec, stages, micro_batches, {**given, **{n: deferred for n in auto}})


def stage_slack(compiled, costs: Costs, iterations: int = 3) -> list[float]:
    """Per stage, how long its all-reduce and update may take after its last backward without
    holding anyone up: T + o_s - b_s, from a simulation of ``compiled`` with free all-reduces (the
    pipeline's compute shape, last call): T = the latest end of any stage's compute, b_s = the end
    of stage s's last backward, o_s = the start of stage s's first forward minus stage 0's, i.e.
    how long after the next call starts stage s computes again. Deferring stages does not change
    the compute shape, so any deferred set gives the same slack."""
    shape = simulate(compiled, costs.without_allreduce(), iterations, critical_path=False).timeline[-1]
    t_end = max(shape["compute_end"])
    first = shape["first_forward"]
    return [t_end + (first[s] - first[0]) - shape["last_backward"][s] for s in range(compiled.stages)]
