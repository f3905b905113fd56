"""``hippie.deferred_layers: "auto"``: how many leading layers each deferred stage delays, chosen
by simulating the schedule under measured costs and pricing staleness. Pure Python.

Partial deferral trades convergence for hidden communication: every delayed layer follows the
one-step-stale rule W(t+1) = W(t) - lr * g(W(t-1)), which costs steps to reach a given loss;
what is not delayed must be all-reduced within the step, which costs time per step. What a user
waits for is their product, the time to a target loss, so the rule minimises

    predicted step time x (1 + staleness_price x stale share)

where the stale share is the fraction of the whole model's gradient bytes that is delayed (every
deferred stage's choice together) and ``staleness_price`` the extra steps, as a share, that a
fully stale gradient costs. Measured on the GPT example (docs/results.md, "priced staleness"):
27% of the model's gradient delayed ends 800 steps at the loss data parallelism reached after 673
(1.19x the steps), half of it (all of stage 0, or 2/3 of stage 0 and 1/3 of stage 1) after
631-640 (1.25-1.27x): a slope of about 0.5 (:data:`STALENESS_PRICE`). Price 0 minimises the
step time alone (hide every all-reduce the layers can hide, whatever the staleness). The engine,
the planner and ``hippie-ds schedule simulate --deferred-layers auto`` all call
:func:`choose_deferred_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import Costs, CostsError
from ..ir import CompiledSchedule
from ..simulator import simulate

# Extra steps to reach a loss, as a share, when the whole model's gradient is one step stale
# (the GPT example's least-squares slope through the origin: 0.54).
STALENESS_PRICE = 0.5
# Objectives this close (a share) count as equal, and the fewer delayed layers win: a gain in
# the simulator's noise is not worth a stale layer.
TOLERANCE = 1e-3
# Passes over the deferred stages (each stage's count re-chosen with the others fixed) at most.
PASSES = 4


class NeedsCosts(CostsError):
    """``"auto"`` asked for without costs to choose from."""


@dataclass(frozen=True)
class LayersChoice:
    """One deferred stage's choice and what the simulator predicts for it (with every deferred
    stage's choice)."""

    stage: int
    layers: int  # leading layers (the cost file's) applied one step late; deferral.with_parameters
    #   counts them as hippie.deferred_layers does (layers with parameters)
    total_layers: int  # the stage's layers (layers == total_layers: the whole stage)
    delayed_share: float  # fraction of the stage's gradient bytes that is delayed
    exposed_allreduce: float  # s the stage waits for its all-reduces after its last backward
    step_time: float  # s, the pipeline's step
    stale_share: float  # fraction of the whole model's gradient bytes delayed (all stages)
    staleness_price: float  # the price the choice was made with
    nothing_delayed_step_time: float  # s, the step with no layer delayed, for comparison

    @property
    def whole(self) -> bool:
        return self.layers == self.total_layers

    @property
    def steps_factor(self) -> float:
        """The steps to a loss, relative to no staleness, as the price models them."""
        return 1.0 + self.staleness_price * self.stale_share

    def describe(self) -> str:
        what = "every layer (the whole stage)" if self.whole else f"{self.layers} of {self.total_layers} layers"
        return (
            f"stage {self.stage}: delays {what}, {self.delayed_share:.1%} of its gradient; predicted exposed "
            f"all-reduce {self.exposed_allreduce:.4g} s, step {self.step_time:.4g} s (nothing delayed: "
            f"{self.nothing_delayed_step_time:.4g} s); {self.stale_share:.1%} of the model's gradient stale, "
            f"priced at {self.steps_factor:.3f}x the steps (staleness_price {self.staleness_price:g})"
        )


def stale_share(costs: Costs, layers: dict[int, int], model_bytes: float | None = None) -> float:
    """The share of the model's gradient bytes applied one step late when each stage ``s`` of
    ``layers`` delays its first ``layers[s]`` layers (``model_bytes``: the model's, when known)."""
    model_bytes = model_bytes if model_bytes is not None else sum(st.param_bytes for st in costs.stages) or 1.0
    return (
        sum(costs.stages[s].delayed_part(n).fraction * costs.stages[s].param_bytes for s, n in layers.items())
        / model_bytes
    )


def choose_deferred_layers(
    compiled: CompiledSchedule,
    costs: Costs,
    iterations: int = 3,
    staleness_price: float | None = None,
    most_with_parameters: int | None = None,
) -> dict[int, LayersChoice]:
    """Per deferred stage of ``compiled``, the leading layers to delay (needs the stage's
    per-layer costs, ``StageCost.layers``; :class:`CostsError` names the stages without them).

    The choice minimises ``step_time x (1 + staleness_price x stale_share)`` (module docstring),
    with the step simulated as the engine runs it: the in-step part all-reduced from inside the
    last backward once its gradients are final, the delayed part across the next step, both on
    the link the stages share. Search: in turn, each deferred stage takes its best count with
    the others fixed, until a pass changes nothing (the stages' all-reduces share the link, so
    one stage's choice moves the others'), once from no layer delayed and once from every layer;
    the better end wins. Objectives within :data:`TOLERANCE` are equal and the fewer layers win.
    A stage without an all-reduce to hide (one replica, no parameters) delays nothing.
    ``staleness_price`` None: :data:`STALENESS_PRICE` (``hippie.staleness_price`` unset).
    ``most_with_parameters``: a stage delays at most its first this many layers with parameters
    (None: any; the planner's free objectives take the measured-free depth, one)."""
    staleness_price = STALENESS_PRICE if staleness_price is None else staleness_price
    if staleness_price < 0:
        raise CostsError(f"staleness_price = {staleness_price!r}: allowed a number >= 0")
    deferred = [] if compiled.continuous else compiled.deferred_stages()
    missing = [s for s in deferred if not costs.stages[s].layers]
    if missing:
        raise CostsError(
            f"stage(s) {missing}: no per-layer costs (field layers: each layer's param_bytes, "
            "optionally backward); the delayed layers cannot be chosen without them"
        )
    if not deferred:
        return {}
    model_bytes = sum(st.param_bytes for st in costs.stages) or 1.0
    most = {s: _most_layers(costs.stages[s].layers, most_with_parameters) for s in deferred}
    runs: dict[tuple, tuple] = {}

    def evaluate(layers: dict[int, int]) -> tuple[float, float, object]:
        key = tuple(layers[s] for s in deferred)
        if key not in runs:
            res = simulate(compiled, costs, iterations, critical_path=False, deferred_layers=dict(layers))
            stale = stale_share(costs, layers, model_bytes)
            runs[key] = (res.step_time * (1.0 + staleness_price * stale), stale, res)
        return runs[key]

    def descend(layers: dict[int, int]) -> dict[int, int]:
        for _ in range(PASSES):
            changed = False
            for s in deferred:
                best, best_obj = layers[s], evaluate(layers)[0]
                for n in range(most[s] + 1):
                    obj = evaluate({**layers, s: n})[0]
                    if obj < best_obj * (1 - TOLERANCE) or (n < best and obj <= best_obj * (1 + TOLERANCE)):
                        best, best_obj = n, obj
                changed |= best != layers[s]
                layers = {**layers, s: best}
            if not changed:
                break
        return layers

    # From nothing delayed and from everything delayed: on a shared link one stage alone delaying
    # more may not pay where all of them together do.
    ends = [descend({s: 0 for s in deferred}), descend({s: most[s] for s in deferred})]
    (obj_a, stale_a, _), (obj_b, stale_b, _) = evaluate(ends[0]), evaluate(ends[1])
    if abs(obj_a - obj_b) <= TOLERANCE * min(obj_a, obj_b):
        layers = ends[0] if stale_a <= stale_b else ends[1]
    else:
        layers = ends[0] if obj_a < obj_b else ends[1]
    _, stale, res = evaluate(layers)
    base = evaluate({s: 0 for s in deferred})[2].step_time
    return {
        s: LayersChoice(
            stage=s,
            layers=layers[s],
            total_layers=len(costs.stages[s].layers),
            delayed_share=costs.stages[s].delayed_part(layers[s]).fraction,
            exposed_allreduce=res.per_stage[s]["exposed_allreduce"],
            step_time=res.step_time,
            stale_share=stale,
            staleness_price=staleness_price,
            nothing_delayed_step_time=base,
        )
        for s in deferred
    }


def _most_layers(layers, most_with_parameters: int | None) -> int:
    """The most leading layers of a stage's per-layer costs that hold at most ``most_with_parameters``
    layers with parameters (None: all of them)."""
    if most_with_parameters is None:
        return len(layers)
    seen = 0
    for i, layer in enumerate(layers):
        seen += layer.param_bytes > 0
        if seen > most_with_parameters:
            return i
    return len(layers)
