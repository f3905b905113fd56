"""Discrete-event simulation of a compiled schedule under a cost model. Pure Python.

Every stage runs its stream (``CompiledSchedule.ops(stage)``) in order, for ``iterations``
consecutive ``train_batch`` calls; state that crosses calls (the deferred stages' buffered
all-reduce, the p2p channels) carries over. Semantics are the validator's, with time:

* compute: FORWARD takes ``forward``, BACKWARD ``backward + recompute``, FORWARD_BACKWARD both;
  a split backward's BACKWARD_INPUT ``input_time + recompute`` and BACKWARD_WEIGHT ``weight_time``
  (the two parts of ``backward``); a micro-batch's activations are held from its forward until
  its parameter gradients are computed (BACKWARD, FORWARD_BACKWARD or BACKWARD_WEIGHT);
  LOAD and COPY_GRADS_TO_BUFFER are free.
* p2p: one FIFO channel per direction between neighbours; the k-th send matches the k-th
  receive. A transfer starts when both sides have posted and takes
  ``p2p_latency + activation_bytes / p2p_bandwidth`` (stage s's output size both ways on the
  s <-> s+1 link). A blocking send holds its sender until the transfer ends (rendezvous); a
  non-blocking send lets it go on after ``send_issue_time`` and WAIT_SENDS waits for all of them.
* all-reduce: START_ALLREDUCE starts a ring all-reduce of the stage's ``param_bytes`` over its
  data-parallel group (nothing when ``data_parallel == 1``, or for target 'buffer' while the
  gradient buffer is empty) and holds the stage for ``allreduce_issue_time`` plus its share of
  ``allreduce_cpu_time`` (the compute the all-reduce in flight takes from a core it shares; a
  blocking one's transfer covers it); WAIT_ALLREDUCE waits for it; REDUCE_GRADS is both. With
  ``shared_link`` the all-reduces in flight split the link's bandwidth equally (fluid model:
  rates are recomputed whenever one starts or ends); the latency part is not shared.
* partial deferral (``hippie.deferred_layers``): a deferred stage's 'buffer' all-reduce carries
  the delayed share of its gradient, its 'grads' all-reduce the rest. Given per-layer costs
  (``deferred_layers``), the 'grads' one starts as the engine starts it: inside the stage's last
  whole backward of the call, once the later layers' gradients are final, i.e. the delayed
  layers' backward time (``StageCost.delayed_part``) before that backward ends, as one bucket;
  the declared START_ALLREDUCE(grads) then finds it in flight. Given only shares
  (``delayed_fraction``), the delayed layers' backward time is taken as that share of the
  stage's backward (``StageCost.delayed_share``).
* updates: OPTIMIZER_STEP, STAGE_OPTIMIZER_STEP and APPLY_BUFFERED_UPDATE take
  ``optimizer_time`` (APPLY nothing while the buffer is empty). OPTIMIZER_STEP is a
  pipeline-wide collective: a stage's k-th one waits until every stage has reached its k-th one.
  REDUCE_TIED_GRADS waits, group by group (``Costs.tied_groups``), until the other stages of each
  tied group the stage is in have reached their k-th one, and is then free; a stage in no group
  passes through (no tied modules: nothing to wait for); without ``tied_groups`` every stage
  waits for all (the worst case of ir.py's note).
* end of ``train_batch``: DeepSpeed broadcasts the loss from the last stage, so a stage other
  than the last cannot end call i before the last stage has finished its stream of call i.
* continuous schedules (2bw, pipedream): call i runs the steady-state stream without the ops of
  batches before the first (the pipeline fill); batches in flight carry over between calls.
  STASH_WEIGHTS / FREE_WEIGHTS are free; per stage, ``weight_versions`` is the most weight
  versions held at once (current + stashed; 1 for schedules without versions) and
  ``extra_weight_bytes`` = (weight_versions - 1) * ``param_bytes``.

Figures (all of the last, steady-state iteration):

* ``end(i)`` = the latest time any stage returns from call i (after the loss broadcast);
  ``step_time = end(i) - end(i-1)`` with ``end(-1) = 0``: the time between consecutive
  completions of ``train_batch`` by the whole pipeline. With flush schedules (gpipe, 1f1b) all
  stages leave a call together, so this is the usual step time and the bubble identity
  (K-1)/(M+K-1) holds exactly for equal costs and free communication.
* ``busy``: the stage's compute time in the iteration; ``idle = step_time - busy``;
  ``bubble_fraction = 1 - mean(busy) / step_time``.
* time *blocked*, per stage, in ops of the iteration (a stream-level view):
  ``exposed_p2p`` in blocking sends/receives and WAIT_SENDS (this includes waiting for the
  neighbour to produce, i.e. pipeline bubbles, not only transfer time); ``exposed_allreduce``
  in WAIT_ALLREDUCE and REDUCE_GRADS; ``exposed_sync`` waiting for the other stages in
  pipeline collectives and the end-of-call loss broadcast; ``exposed_comm`` their sum.
  A stage's blocked all-reduce time is an upper bound of what it costs the step: the last
  stage of hippie waits for its all-reduce while it would otherwise wait for activations.
  The result-level ``allreduce_on_critical_path`` is the honest figure: step_time minus the
  step time of the same run with free all-reduces.
* ``allreduce_time``: summed durations (start to end, link sharing included) of the stage's
  all-reduces consumed in the iteration; an all-reduce belongs to the call whose WAIT consumes
  it (the deferred stages' buffer all-reduce started at the end of call i-1 counts for call i).
"""

from __future__ import annotations

from typing import Mapping

from .costs import Costs, CostsError
from .op_rules import RULES
from .sim_results import SimResult, call_timeline, per_stage_figures
from .sim_resources import SimulationError
from .sim_stages import _Sim
from .ir import CompiledSchedule


def simulate(
    compiled: CompiledSchedule,
    costs: Costs,
    iterations: int = 3,
    *,
    critical_path: bool = True,
    delayed_fraction: Mapping[int, float] | None = None,
    deferred_layers: Mapping[int, int] | None = None,
) -> SimResult:
    """Simulate ``iterations`` consecutive train_batch calls of ``compiled`` under ``costs``;
    figures are of the last call (see the module docstring for the definitions).
    ``critical_path=False`` skips the second, all-reduce-free run behind
    ``allreduce_on_critical_path``. Partial deferral (``hippie.deferred_layers``; default: a
    deferred stage delays all of its gradient), per deferred stage, one of:
    ``deferred_layers``: {stage: leading layers delayed}, from the stage's per-layer costs
    (``StageCost.layers``): the delayed share and the in-step part's early start, as the engine
    runs it; ``delayed_fraction``: {stage: share of its gradient delayed}, when only that is
    known (the delayed layers' backward time is then taken as that share of the stage's
    backward). The rest is all-reduced by the in-step ``grads`` all-reduce, the buffer holds the
    delayed share."""
    if costs.num_stages != compiled.stages:
        raise SimulationError(
            f"costs describe {costs.num_stages} stages, schedule {compiled.name!r} was compiled for {compiled.stages}"
        )
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise SimulationError(f"iterations = {iterations!r}: must be an integer >= 1")
    both = sorted(set(delayed_fraction or {}) & set(deferred_layers or {}))
    if both:
        raise SimulationError(f"stage(s) {both}: given both delayed_fraction and deferred_layers; give one")
    delayed = {s: costs.stages[s].delayed_share(f) for s, f in (delayed_fraction or {}).items()}
    for s, layers in (deferred_layers or {}).items():
        try:
            delayed[s] = costs.stages[s].delayed_part(layers)
        except CostsError as exc:
            raise SimulationError(f"deferred_layers of stage {s}: {exc}") from None
    sim = _Sim(compiled, costs, iterations, delayed, RULES)
    sim.run()

    K, last = compiled.stages, iterations - 1
    ends = [max(sim.ends[s][i] for s in range(K)) for i in range(iterations)]
    step_times = [ends[0]] + [ends[i] - ends[i - 1] for i in range(1, iterations)]
    step_time = step_times[last]
    per_stage = per_stage_figures(sim, costs, step_time, last)
    timeline = call_timeline(sim, ends, step_times)
    mean_busy = sum(p["busy"] for p in per_stage) / K
    bubble = 1.0 - mean_busy / step_time if step_time > 0 else 0.0
    r = costs.comm.data_parallel
    throughput = compiled.micro_batches * r / step_time if step_time > 0 else float("inf")

    critical = 0.0
    if critical_path and any(costs.allreduce_time(s) > 0 for s in range(K)):
        critical = (
            step_time
            - simulate(
                compiled,
                costs.without_allreduce(),
                iterations,
                critical_path=False,
                delayed_fraction=delayed_fraction,
                deferred_layers=deferred_layers,
            ).step_time
        )

    return SimResult(
        schedule=compiled.name,
        stages=K,
        micro_batches=compiled.micro_batches,
        params=dict(compiled.params),
        step_time=step_time,
        bubble_fraction=bubble,
        per_stage=per_stage,
        throughput=throughput,
        events=sim.events,
        data_parallel=r,
        iterations=iterations,
        allreduce_on_critical_path=critical,
        timeline=timeline,
    )
