"""``hippie.deferred_layers``: which leading layers of a deferred stage are delayed.

A count means layers that hold trainable parameters: a stage's first ``k`` such layers, with the
parameterless ones (functions, activations) in front of and between them. Megatron-DeepSpeed's
``GPTModelPipe`` starts with a function, so the first raw layer of its stage 0 would delay nothing.
Inside hippie-ds (``split_deferred``, ``delay_ties``, the "auto" chooser over a cost file's layers,
plans) a choice is a number of raw leading layers; :func:`deferred_layers` turns the config's count
into one, from every stage's built layers (:func:`layers_with_parameters`).

The default, ``"untied"``, is one layer too, but not a module tied to another stage: a stage
delays its first layer with parameters that is not such a module, and the tied modules in front of
it stay in-step (:func:`untied_layers`; ``delay_ties(untied=True)`` names them, the engine leaves
their parameters out of the delayed part). Megatron's stage 0 starts with the word embedding tied
to the output head on the last stage: delaying it (``1``) delays the head's weights as well (one
rule per tied module, adapter/tied.py), which cost 0.3-1.2% of loss against stock on the two GPT
codebases tried; "untied" delays the first transformer layer instead (docs/results.md).
"""
from __future__ import annotations

from deepspeed.runtime.pipe.module import PipelineModule

from ..config import AUTO_LAYERS, UNTIED_LAYERS, WHOLE_STAGE, ConfigError
from ..schedules import load_spec, recompile


def layers_with_parameters(model: PipelineModule) -> list[bool] | None:
    """For each layer of ``model``: whether it is a module holding trainable parameters as its
    stage built it (a function, or a tied module reached through its ``forward_fn``, is not).
    Every stage's layers, gathered with one all-reduce over the world (every rank runs
    ``initialize``); None for a stand-in model with no built layers."""
    funcs = getattr(model, "forward_funcs", None)
    if funcs is None:
        return None
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    flags = torch.zeros(len(model._layer_specs), dtype=torch.int32, device=get_accelerator().current_device_name())
    for i, f in enumerate(funcs):
        if isinstance(f, torch.nn.Module) and any(p.requires_grad for p in f.parameters()):
            flags[model._local_start + i] = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(x) for x in flags.tolist()]


def leading_layers(flags: list[bool], count: int) -> int | None:
    """Raw leading layers of a stage (``flags``: which of its layers hold parameters) that hold
    its first ``count`` layers with parameters; None when that is all of them (the whole stage)."""
    if count >= sum(flags):
        return None
    seen = 0
    for i, has in enumerate(flags):
        seen += has
        if seen == count:
            return i + 1
    return 0  # count 0: nothing


def tied_across_stages(model: PipelineModule) -> list[bool]:
    """For each layer of ``model``: whether it is a module tied to a layer of another stage (a
    ``TiedLayerSpec`` whose key other stages hold too), from the layer specs every rank has."""
    from .tied import tie_holders
    tied = {i for stages in tie_holders(model).values() for layers in stages.values() for i in layers}
    return [i in tied for i in range(len(model._layer_specs))]


def untied_layers(flags: list[bool], tied: list[bool]) -> int:
    """``"untied"``: raw leading layers of a stage (``flags``: which of its layers hold parameters,
    ``tied``: which are modules tied to another stage) up to and including its first layer with
    parameters that is not tied; 0 when it has none (the stage delays nothing)."""
    for i, (has, across) in enumerate(zip(flags, tied)):
        if has and not across:
            return i + 1
    return 0


def deferred_layers(model: PipelineModule, options, compiled, choices: dict | None = None) -> dict[int, int]:
    """``hippie.deferred_layers`` per deferred stage ({stage: leading layers delayed}), only for
    stages it delays partly (0: nothing, see :func:`without_undelayed`); checked before any
    process group exists. The default ("untied") applies to the schedules that have deferred
    stages and is ignored by the others; under it every deferred stage gets a count, its whole
    stage included (the tied modules among those layers stay in-step: ``delay_ties(untied=True)``);
    a value the config sets is checked against the schedule; "auto" is
    chosen from costs (:func:`auto_deferred_layers`); ``choices``, when given, receives them
    ({stage: LayersChoice}; :func:`initialize` logs them once the engine has set DeepSpeed's log
    level from the config)."""
    value = options.deferred_layers
    explicit = "deferred_layers" in options.model_fields_set
    deferred = compiled.deferred_stages()
    shown = f'config key "hippie.deferred_layers" = {value!r}'
    if "deferred_stages" not in compiled.params:
        if explicit and value != WHOLE_STAGE:
            raise ConfigError(f"{shown}: schedule {compiled.name!r} has no deferred stages (partial deferral applies "
                              f"to the deferred stages of {', '.join(schedules_with_param('deferred_stages'))})")
        return {}
    if options.staleness_price is not None and value != AUTO_LAYERS:
        raise ConfigError(f'config key "hippie.staleness_price" = {options.staleness_price!r}: it prices only '
                          f'"hippie.deferred_layers": "auto", and that key is {value!r} here; remove one of them')
    if value == WHOLE_STAGE:
        return {}
    if value == UNTIED_LAYERS:
        flags = layers_with_parameters(model)
        if flags is None:  # a stand-in without built layers (nor ties): its first layer
            return {s: 1 for s in deferred if model.parts[s + 1] - model.parts[s] > 1}
        tied = tied_across_stages(model)
        return {s: untied_layers(flags[model.parts[s]:model.parts[s + 1]], tied[model.parts[s]:model.parts[s + 1]])
                for s in deferred}
    chosen = value == AUTO_LAYERS  # counts of raw layers, from a cost file's
    if chosen:
        auto = auto_deferred_layers(model, options, compiled)
        (choices if choices is not None else {}).update(auto)
        value = {s: c.layers for s, c in auto.items()}
    if isinstance(value, dict):
        extra = sorted(set(value) - set(deferred))
        if extra:
            raise ConfigError(f"{shown}: stage(s) {extra} are not deferred; deferred stages: {deferred}")
    counts = {s: value if isinstance(value, int) else value.get(s) for s in deferred}
    counts = {s: k for s, k in counts.items() if k is not None}
    flags = None if chosen else layers_with_parameters(model)
    if flags is not None:  # the config counts layers with parameters
        counts = {s: leading_layers(flags[model.parts[s]:model.parts[s + 1]], k) for s, k in counts.items()}
    layers = {s: model.parts[s + 1] - model.parts[s] for s in deferred}
    return {s: k for s, k in counts.items() if k is not None and k < layers[s]}


def auto_deferred_layers(model: PipelineModule, options, compiled) -> dict:
    """``hippie.deferred_layers: "auto"``: {deferred stage: LayersChoice}, by
    :func:`~hippie_ds.schedules.partial_deferral.choose_deferred_layers` under ``hippie.costs``
    (a plan carries its own choice, merged into the config before this). A deferred stage whose
    costs have no per-layer breakdown takes the model's own layers' parameter bytes, built on the
    meta device from the layer specs, the same on every rank. When a layer cannot be built there,
    this rank's stage counts its built layers (``model.forward_funcs``, which the engine splits)
    and another stage is taken as equal layers (a stage's choice depends on the others' only
    through the link they share); every replica of a stage still chooses alike."""
    from ..schedules.costs import Costs, CostsError, LayerShare
    from ..schedules.partial_deferral import choose_deferred_layers

    shown = f'config key "hippie.deferred_layers" = {AUTO_LAYERS!r}'
    if options.costs is None:
        made = (f'; the plan {options.plan!r} ("hippie.plan") states no choice (made before "auto" existed): make it '
                "again with `hippie-ds plan`" if options.plan is not None else
                '; or "hippie.plan", a plan from `hippie-ds plan` (it carries the choice)')
        raise ConfigError(f'{shown}: needs costs to choose from: "hippie.costs", a cost file with per-stage costs '
                          f"(per-layer ones optional, see docs/reference.md){made}")
    try:
        costs = Costs.from_file(options.costs, num_stages=model.num_stages)
    except CostsError as exc:
        raise ConfigError(f'{shown}: config key "hippie.costs" = {options.costs!r}: {exc}') from None
    from .pipeline_module import layer_param_bytes

    stages, every = list(costs.stages), None
    for s in compiled.deferred_stages():
        count = model.parts[s + 1] - model.parts[s]
        if stages[s].layers is None:
            every = layer_param_bytes(model._layer_specs) if every is None else every
            sizes = (every[model.parts[s]:model.parts[s + 1]] if every is not None else
                     _layer_sizes(model) if s == model.stage_id else [1.0] * count)
            stages[s] = stages[s].model_copy(update={"layers": [LayerShare(param_bytes=x) for x in sizes]})
        elif len(stages[s].layers) != count:
            raise ConfigError(f'{shown}: config key "hippie.costs" = {options.costs!r}: stage {s} lists '
                              f"{len(stages[s].layers)} layers, the model's stage {s} has {count}")
    return choose_deferred_layers(compiled, costs.model_copy(update={"stages": stages}),
                                  staleness_price=options.staleness_price)


def log_choice(model: PipelineModule, choices: dict) -> None:
    """The 'auto' choice of this rank's stage, on its first replica (DeepSpeed logger, INFO)."""
    mine = choices.get(model.stage_id)
    if mine is not None and model._topo.get_coord(model.global_rank).data == 0:
        from deepspeed.utils import logger
        logger.info(f"hippie-ds: deferred_layers auto, {mine.describe()}")


def _layer_sizes(model: PipelineModule) -> list[float]:
    """Parameter count of each of this rank's stage's layers (0 for functions and tied modules
    reached through a function, which the engine never delays either)."""
    import torch
    return [float(sum(p.numel() for p in f.parameters())) if isinstance(f, torch.nn.Module) else 0.0
            for f in model.forward_funcs]


def without_undelayed(compiled, partial: dict[int, int]):
    """(schedule, partial) with the deferred stages that delay 0 layers made ordinary stages:
    delaying nothing is all-reducing and updating in-step, with no gradient buffer to keep."""
    idle = sorted(s for s, k in partial.items() if k == 0)
    if not idle:
        return compiled, partial
    kept = [s for s in compiled.deferred_stages() if s not in idle]
    return recompile(compiled, deferred_stages=kept), {s: k for s, k in partial.items() if k}


def schedules_with_param(param: str) -> list[str]:
    """The built-in schedules that declare ``param`` (asked of their specs)."""
    from ..schedules.spec import available
    return [name for name in available() if param in load_spec(name).params]


