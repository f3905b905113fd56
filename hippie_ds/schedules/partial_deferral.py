"""``hippie.deferred_layers: "auto"``: how many leading layers each deferred stage delays, chosen
by simulating the schedule under measured costs. Pure Python.

Partial deferral trades convergence for hidden communication: every delayed layer follows the
one-step-stale rule W(t+1) = W(t) - lr * g(W(t-1)), so the fewer the better, but what is not
delayed must be all-reduced within the step. Which is why the rule takes the fewest layers that
hide the stage's all-reduce, and every layer (the paper's whole-stage rule) only when no count
hides it. The engine, the planner and ``hippie-ds schedule simulate --deferred-layers auto`` all
call :func:`choose_deferred_layers`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .auto_params import stage_slack
from .costs import Costs, CostsError
from .ir import CompiledSchedule
from .simulator import SimResult, simulate

# An overrun of the slack this small (a share of the step time) is not worth a stale layer: a
# first stage has no slack at all, so without it any link would delay one of its layers.
TOLERANCE = 1e-3


@dataclass(frozen=True)
class LayersChoice:
    """One deferred stage's choice and what the simulator predicts for it."""

    stage: int
    layers: int                 # leading layers whose gradient is applied one step late
    total_layers: int           # the stage's layers (layers == total_layers: the whole stage)
    delayed_share: float        # fraction of the stage's gradient bytes that is delayed
    exposed_allreduce: float    # s the stage waits for its all-reduces after its last backward
    slack: float                # s it may wait for them without holding anyone up (its update's time taken off)
    step_time: float            # s, the pipeline's step with every stage's choice
    fits: bool                  # its all-reduces end within the slack (hidden from the step)

    @property
    def whole(self) -> bool:
        return self.layers == self.total_layers

    def describe(self) -> str:
        what = "every layer (the whole stage)" if self.whole else f"{self.layers} of {self.total_layers} layers"
        return (f"stage {self.stage}: delays {what}, {self.delayed_share:.1%} of its gradient; predicted exposed "
                f"all-reduce {self.exposed_allreduce:.4g} s (slack {self.slack:.4g} s), step {self.step_time:.4g} s")


def _allowed(slack: float, optimizer_time: float) -> float:
    """What a stage may spend after its last backward: its slack, and at least its own update,
    which runs there whatever it delays (a first stage has no slack, yet its update is no
    all-reduce to hide: counting it against the slack would delay every layer of it)."""
    return max(slack, optimizer_time)


def _fits(need: float, allowed: float, step_time: float) -> bool:
    return need <= allowed + TOLERANCE * step_time


def choose_deferred_layers(compiled: CompiledSchedule, costs: Costs, iterations: int = 3) -> dict[int, LayersChoice]:
    """Per deferred stage of ``compiled``, the fewest leading layers to delay (needs the stage's
    per-layer costs, ``StageCost.layers``; :class:`CostsError` names the stages without them).

    Rule, with the slack of :func:`~hippie_ds.schedules.auto_params.stage_slack` (the rule that
    picks the deferred stages):

    * a stage's choice fits when, simulated as the engine runs it, the time it waits for its
      all-reduces after its last backward plus its ``optimizer_time`` is within its slack
      (:data:`TOLERANCE` of the step time over it still fits), or within its update's time when
      that exceeds the slack (stage 0: the update follows the last backward in any schedule). That
      covers both parts: (a) the in-step part, started inside the last backward once its
      gradients are final (the delayed layers' backward earlier than the backward's end), must
      end within the slack; (b) the delayed part, all-reduced from the next step's start, must
      end by then too (it hides behind the next step's compute);
    * every deferred stage starts at 0 layers; while some stage does not fit, the one that
      overruns its slack most delays one more layer, and all are simulated again (the stages'
      all-reduces share the link, so one stage's choice moves the others'). A stage that fits at
      no count ends at every layer, where its whole gradient has the next step to all-reduce.
      A stage without an all-reduce to hide (one replica, no parameters) delays nothing.
    """
    deferred = [] if compiled.continuous else compiled.deferred_stages()
    missing = [s for s in deferred if not costs.stages[s].layers]
    if missing:
        raise CostsError(f"stage(s) {missing}: no per-layer costs (field layers: each layer's param_bytes, "
                         "optionally backward); the delayed layers cannot be chosen without them")
    if not deferred:
        return {}
    slack = stage_slack(compiled, costs, iterations)
    allowed = {s: _allowed(slack[s], costs.stages[s].optimizer_time) for s in deferred}
    total = {s: len(costs.stages[s].layers) for s in deferred}
    layers = {s: 0 for s in deferred}
    while True:
        res = simulate(compiled, costs, iterations, critical_path=False, deferred_layers=layers)
        over = [(_need(res, costs, s) - allowed[s], -s) for s in deferred
                if layers[s] < total[s] and not _fits(_need(res, costs, s), allowed[s], res.step_time)]
        if not over:
            break
        layers[-max(over)[1]] += 1
    return {s: LayersChoice(stage=s, layers=layers[s], total_layers=total[s],
                            delayed_share=costs.stages[s].delayed_part(layers[s]).fraction,
                            exposed_allreduce=res.per_stage[s]["exposed_allreduce"],
                            slack=allowed[s] - costs.stages[s].optimizer_time, step_time=res.step_time,
                            fits=_fits(_need(res, costs, s), allowed[s], res.step_time))
            for s in deferred}


def _need(res: SimResult, costs: Costs, stage: int) -> float:
    """What a stage spends after its last backward on gradients: waiting for its all-reduces,
    then its update."""
    return res.per_stage[stage]["exposed_allreduce"] + costs.stages[stage].optimizer_time
