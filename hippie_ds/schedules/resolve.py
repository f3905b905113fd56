"""From a schedule's name and a job's shape to the schedule that runs, in one pass (pure Python).

Start-up (:func:`hippie_ds.adapter.startup.checks.prepare`), ``hippie-ds schedule simulate`` and the
planner's evaluation all call :func:`resolve`; nothing else compiles a schedule to run it. The
pass, in order:

1. ``'auto'`` stage lists (hippie's ``deferred_stages``) chosen from costs
   (:func:`~hippie_ds.schedules.deferral.resolve_auto_params`), or by the declaration's no-cost
   rule without costs;
2. compiled once;
3. ``hippie.deferred_layers: "auto"`` chosen from the costs' per-layer figures
   (:func:`~hippie_ds.schedules.deferral.choose_deferred_layers`), in the config's unit;
4. what every deferred stage delays decided (:func:`~hippie_ds.schedules.deferral.decide`,
   global layer indices, the tie rule);
5. compiled again only when the decision changed the deferred stages (a stage that delays
   nothing is not deferred; a holder of a delayed tied module is);
6. validated once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

from ..config import AUTO_LAYERS, DEFAULT_DEFERRED_LAYERS, WHOLE_STAGE
from .compiler import compile_schedule
from .costs import Costs, CostsError
from .deferral.auto_layers import NeedsCosts
from .deferral import (
    Deferral,
    LayersChoice,
    StageLayers,
    choose_deferred_layers,
    decide,
    resolve_auto_params,
    with_parameters,
)
from .ir import CompiledSchedule
from .spec import ScheduleSpec, load_spec

# every stage's layers, or how to get them: called with whether the layers' parameter flags are
# needed (the adapter gathers them with a collective, only then)
StageLayersSource = Union[Mapping[int, StageLayers], Callable[[bool], Mapping[int, StageLayers]]]


@dataclass(frozen=True)
class Shape:
    """The job's pipeline: stages, micro-batches per step, model chunks per stage (None: the
    schedule's own)."""

    stages: int
    micro_batches: int
    virtual_stages: int | None = None


@dataclass(frozen=True)
class Resolved:
    """The schedule that runs and what its deferred stages delay. ``choices``: ``"auto"``'s
    {deferred stage: LayersChoice} (empty when nothing was chosen from costs)."""

    compiled: CompiledSchedule
    deferral: Deferral
    stage_layers: Mapping[int, StageLayers]
    choices: Mapping[int, LayersChoice] = field(default_factory=dict)

    def simulator_layers(self) -> dict[int, int]:
        """{stage: leading layers delayed} of the deferred stages not delayed whole: the unit of a
        cost file's per-layer list, which the simulator takes as ``deferred_layers``."""
        return self.deferral.leading(self.stage_layers)


def cost_layers(costs: Costs) -> dict[int, StageLayers]:
    """Every stage's layers as a cost file lists them (a layer holds parameters when its
    param_bytes > 0; a cost file names no tied modules); a stage without per-layer costs is one
    layer."""
    out, first = {}, 0
    for s, st in enumerate(costs.stages):
        params = tuple(layer.param_bytes > 0 for layer in st.layers) if st.layers else (True,)
        out[s], first = StageLayers(first, params), first + len(params)
    return out


def resolve(
    name: str | ScheduleSpec,
    shape: Shape,
    params: Mapping[str, Any] | None = None,
    layers: Any = DEFAULT_DEFERRED_LAYERS,
    costs: Costs | None = None,
    stage_layers: StageLayersSource | None = None,
    ties: bool = False,
    *,
    staleness_price: float | None = None,
    most_with_parameters: int | None = None,
    layer_bytes: Callable[[int], Sequence[float]] | None = None,
    iterations: int = 3,
    validate: bool = True,
    source: str | None = None,
) -> Resolved:
    """The schedule ``name`` resolved for ``shape`` (module docstring).

    ``params``: the schedule's parameters as given ('auto' stage lists chosen from ``costs`` when
    given); ``layers``: ``hippie.deferred_layers`` (read by the config: "untied", "all", "none",
    "auto", a count >= 1 or {stage: count}); ``stage_layers``: every stage's layers (default: the
    cost file's, or one layer per stage); ``ties``: the model holds modules tied across stages
    (the tie rule applies where the schedule's stages update apart); ``layer_bytes(stage)``: the
    parameter bytes of a stage's layers, for "auto" on a stage whose costs have no per-layer
    breakdown; ``most_with_parameters``: "auto" delays at most this many layers with parameters a
    stage (None: any). Raises ScheduleError, CostsError, ConfigError, SimulationError (the callers name
    their keys or options)."""
    spec = name if isinstance(name, ScheduleSpec) else load_spec(name)
    source = source if source is not None else (str(name) if not isinstance(name, ScheduleSpec) else None)
    given = dict(params or {})
    auto_stage_lists = any(
        (given.get(n) if given.get(n) is not None else p.default) == "auto"
        for n, p in spec.params.items()
        if p.kind == "stage_list"
    )
    if costs is not None and auto_stage_lists:
        given = resolve_auto_params(spec, shape.stages, shape.micro_batches, costs, given, iterations)

    def compiled_with(p):
        return compile_schedule(
            spec, shape.stages, shape.micro_batches, p, source=source, virtual_stages=shape.virtual_stages
        )

    compiled = compiled_with(given)
    deferred = [] if compiled.continuous else compiled.deferred_stages()
    value = layers if "deferred_stages" in compiled.params and deferred else WHOLE_STAGE
    every = _stage_layers(stage_layers, costs, shape.stages, need_params=value != WHOLE_STAGE)
    choices: dict[int, LayersChoice] = {}
    if value == AUTO_LAYERS:
        if costs is None:
            raise NeedsCosts(f'deferred_layers {AUTO_LAYERS!r} needs costs to choose from')
        choices = choose_deferred_layers(
            compiled, _per_layer(costs, deferred, every, layer_bytes), iterations, staleness_price, most_with_parameters
        )
        value = {s: with_parameters(every[s].params, c.layers) for s, c in choices.items()}
    tie_rule = ties and not compiled.uses_tied_reduction and not compiled.continuous
    deferral = decide(deferred, value, every, tie_rule)
    if not compiled.continuous and deferral.deferred_stages() != deferred:
        compiled = compiled_with({**compiled.params, "deferred_stages": deferral.deferred_stages()})
    if validate:
        from .validator import validate as validated

        compiled = validated(compiled)
    return Resolved(compiled, deferral, every, choices)


def _stage_layers(
    source: StageLayersSource | None, costs: Costs | None, stages: int, need_params: bool
) -> Mapping[int, StageLayers]:
    if callable(source):
        return source(need_params)
    if source is not None:
        return source
    if costs is not None:
        return cost_layers(costs)
    return {s: StageLayers(s, (True,)) for s in range(stages)}


def _per_layer(
    costs: Costs,
    deferred: Sequence[int],
    every: Mapping[int, StageLayers],
    layer_bytes: Callable[[int], Sequence[float]] | None,
) -> Costs:
    """``costs`` with per-layer figures on every deferred stage: a stage without them takes
    ``layer_bytes(stage)``; a stage listing another count of layers than the model's is refused."""
    from .costs import LayerShare

    stages = list(costs.stages)
    for s in deferred:
        count = len(every[s].params)
        if stages[s].layers is None and layer_bytes is not None:
            stages[s] = stages[s].model_copy(update={"layers": [LayerShare(param_bytes=x) for x in layer_bytes(s)]})
        elif stages[s].layers is not None and len(stages[s].layers) != count:
            raise CostsError(f"stage {s} lists {len(stages[s].layers)} layers, the model's stage {s} has {count}")
    return costs.model_copy(update={"stages": stages})
