"""``hippie.deferred_layers`` in the adapter: what the module tells the decision and what the
engine takes from it. The decision itself is :func:`hippie_ds.schedules.deferral.decide` (pure,
one unit: global layer indices); this module only

* describes every stage's layers from the module (:func:`stage_layers`: which hold trainable
  parameters as built, gathered with one all-reduce over the world since a rank builds only its
  own stage; which are modules tied to another stage, from the layer specs every rank has);
* resolves ``"auto"`` with the chooser over the cost file read once at start-up
  (:func:`auto_deferred_layers`), its leading-layer counts put in the config's unit;
* checks the value against the schedule and renders the result as the engine's arguments
  (:func:`engine_arguments`: leading-layer counts for ``split_deferred``, tied keys delayed and kept).

The default, ``"untied"``, delays a deferred stage's first layer with parameters that is not a
module tied to another stage: Megatron's stage 0 starts with the word embedding tied to the
output head on the last stage; delaying it (``1``) delays the head's weights as well (one rule
per tied module, adapter/tied.py), which cost 0.3-1.2% of loss against stock on the two GPT
codebases tried; "untied" delays the first transformer layer instead (docs/results.md).
"""
from __future__ import annotations

from deepspeed.runtime.pipe.module import PipelineModule, TiedLayerSpec

from ..config import AUTO_LAYERS, WHOLE_STAGE, ConfigError
from ..schedules import load_spec
from ..schedules.deferral import Deferral, StageLayers, delayed_layers, with_parameters, with_ties
from .tensor_calls import numel


def layers_with_parameters(model: PipelineModule) -> list[bool] | None:
    """For each layer of ``model``: whether it is a module holding trainable parameters as its
    stage built it (a function, or a tied module reached through its ``forward_fn``, is not).
    Every stage's layers, gathered with one all-reduce over the world (every rank runs
    ``initialize``; the PipelineModule has made the process group); None for a stand-in model
    with no built layers."""
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


def tie_holders(model: PipelineModule) -> dict[str, dict[int, list[int]]]:
    """{tie key: {stage: the layer indices of that stage where the tied module appears}}."""
    holders: dict[str, dict[int, list[int]]] = {}
    for idx, spec in enumerate(model._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            holders.setdefault(spec.key, {}).setdefault(model.stage_owner(idx), []).append(idx)
    return {key: stages for key, stages in holders.items() if len(stages) > 1}


def _tie_keys(model: PipelineModule) -> tuple[dict[int, str], dict[int, set[str]]]:
    """({layer index: key} of the modules tied to another stage, {stage: keys it holds})."""
    if not getattr(model, "tied_comms", None) or not hasattr(model, "_layer_specs"):
        return {}, {}
    at, held = {}, {}
    for key, stages in tie_holders(model).items():
        for s, layers in stages.items():
            held.setdefault(s, set()).add(key)
            at.update({i: key for i in layers})
    return at, held


def tied_across_stages(model: PipelineModule) -> list[bool]:
    """For each layer of ``model``: whether it is a module tied to a layer of another stage."""
    at = _tie_keys(model)[0]
    return [i in at for i in range(len(model._layer_specs))]


def stage_layers(model: PipelineModule, flags: list[bool] | None = None) -> dict[int, StageLayers]:
    """Every stage's :class:`StageLayers` (with virtual stages: its first chunk's, the leading
    ones). ``flags``: :func:`layers_with_parameters`; None: a stand-in without built layers,
    whose layers all count as holding parameters."""
    at, held = _tie_keys(model)
    out = {}
    for s in range(model.num_stages if hasattr(model, "num_stages") else len(model.parts) - 1):
        a, e = model.parts[s], model.parts[s + 1]
        tied = tuple(at.get(i) for i in range(a, e))
        out[s] = StageLayers(a, tuple(flags[a:e]) if flags is not None else (True,) * (e - a),
                             tied if any(tied) else (), frozenset(held.get(s, set()) - set(tied)))
    return out


def _check(options, compiled) -> None:
    """The value against the schedule, before anything is decided."""
    value = options.deferred_layers
    if "deferred_stages" not in compiled.params:
        if "deferred_layers" not in options.model_fields_set or value == WHOLE_STAGE:
            return  # the default, and "all", mean nothing to a schedule without deferred stages
        raise ConfigError(f'config key "hippie.deferred_layers" = {value!r}: schedule {compiled.name!r} has no deferred '
                          f"stages (partial deferral applies to the deferred stages of "
                          f"{', '.join(schedules_with_param('deferred_stages'))})")
    if options.staleness_price is not None and value != AUTO_LAYERS:
        raise ConfigError(f'config key "hippie.staleness_price" = {options.staleness_price!r}: it prices only '
                          f'"hippie.deferred_layers": "auto", and that key is {value!r} here; remove one of them')


def _own(model: PipelineModule, options, compiled, costs=None, choices: dict | None = None):
    """(deferred stages, what each delays before the tie rule, every stage's layers)."""
    _check(options, compiled)
    deferred = [] if compiled.continuous else compiled.deferred_stages()
    value = options.deferred_layers if "deferred_stages" in compiled.params and deferred else WHOLE_STAGE
    layers = stage_layers(model, layers_with_parameters(model) if value != WHOLE_STAGE else None)
    if value == AUTO_LAYERS:
        auto = auto_deferred_layers(model, options, compiled, costs)
        (choices if choices is not None else {}).update(auto)
        value = {s: with_parameters(layers[s].params, c.layers) for s, c in auto.items()}
    return deferred, delayed_layers(deferred, value, layers), layers


def resolve(model: PipelineModule, options, compiled, costs=None,
            choices: dict | None = None) -> tuple[Deferral, dict[int, StageLayers]]:
    """(what every stage delays, every stage's layers): ``hippie.deferred_layers`` checked,
    "auto" chosen (``costs``: the cost file as read at start-up; ``choices`` receives the
    {stage: LayersChoice} for :func:`log_choice`), decided by the pure rule. The value applies
    to the schedules with a ``deferred_stages`` parameter; the others delay whole stages."""
    _, own, layers = _own(model, options, compiled, costs, choices)
    tie_rule = bool(getattr(model, "tied_comms", None)) and not compiled.uses_tied_reduction \
        and not compiled.continuous
    return with_ties(own, layers, tie_rule), layers


def read_costs(options, num_stages: int):
    """``hippie.costs`` read (once, at start-up), its errors naming the key."""
    from ..schedules.costs import Costs, CostsError
    try:
        return Costs.from_file(options.costs, num_stages=num_stages)
    except CostsError as exc:
        raise ConfigError(f'config key "hippie.costs" = {options.costs!r}: {exc}') from None


def auto_deferred_layers(model: PipelineModule, options, compiled, costs=None) -> dict:
    """``hippie.deferred_layers: "auto"``: {deferred stage: LayersChoice}, by
    :func:`~hippie_ds.schedules.partial_deferral.choose_deferred_layers` under ``costs``
    (``hippie.costs``, read here when not given; a plan carries its own choice, merged into the
    config before this). A deferred stage whose costs have no per-layer breakdown takes the
    model's own layers' parameter bytes, built on the meta device from the layer specs, the same
    on every rank. When a layer cannot be built there, this rank's stage counts its built layers
    (``model.forward_funcs``) and another stage is taken as equal layers (a stage's choice depends
    on the others' only through the link they share); every replica of a stage still chooses alike."""
    from ..schedules.costs import LayerShare
    from ..schedules.partial_deferral import choose_deferred_layers

    shown = f'config key "hippie.deferred_layers" = {AUTO_LAYERS!r}'
    if options.costs is None:
        made = (f'; the plan {options.plan!r} ("hippie.plan") states no choice (made before "auto" existed): make it '
                "again with `hippie-ds plan`" if options.plan is not None else
                '; or "hippie.plan", a plan from `hippie-ds plan` (it carries the choice)')
        raise ConfigError(f'{shown}: needs costs to choose from: "hippie.costs", a cost file with per-stage costs '
                          f"(per-layer ones optional, see docs/reference.md){made}")
    costs = read_costs(options, model.num_stages) if costs is None else costs
    from .pipeline_module import layer_param_bytes

    stages, every = list(costs.stages), None
    for s in compiled.deferred_stages():
        count = model.parts[s + 1] - model.parts[s]
        if stages[s].layers is None:
            every = layer_param_bytes(model._layer_specs) if every is None else every
            sizes = (every[model.parts[s]:model.parts[s + 1]] if every is not None else
                     _layer_sizes(model, s) if s == model.stage_id else [1.0] * count)
            stages[s] = stages[s].model_copy(update={"layers": [LayerShare(param_bytes=x) for x in sizes]})
        elif len(stages[s].layers) != count:
            raise ConfigError(f'{shown}: config key "hippie.costs" = {options.costs!r}: stage {s} lists '
                              f"{len(stages[s].layers)} layers, the model's stage {s} has {count}")
    return choose_deferred_layers(compiled, costs.model_copy(update={"stages": stages}),
                                  staleness_price=options.staleness_price)


def final_schedule(compiled, deferral: Deferral):
    """``compiled`` itself when its deferred stages are the decision's, else compiled again (not
    validated: the caller validates the schedule it runs, once) with the decision's."""
    if compiled.continuous or compiled.deferred_stages() == deferral.deferred_stages():
        return compiled
    from ..schedules import compile as compile_schedule
    return compile_schedule(compiled.source or compiled.name, compiled.stages, compiled.micro_batches, validate=False,
                            virtual_stages=compiled.virtual_stages if compiled.virtual_stages > 1 else None,
                            **{**compiled.params, "deferred_stages": deferral.deferred_stages()})


def engine_arguments(deferral: Deferral, layers: dict[int, StageLayers]) -> dict:
    """The decision as ``HippiePipelineEngine`` takes it: ``deferred_layers`` {stage: leading
    layers} (a stage left out: whole), ``tied_delayed`` and ``tied_kept`` tie keys."""
    return {"deferred_layers": deferral.leading(layers), "tied_delayed": deferral.tied_delayed,
            "tied_kept": deferral.tied_kept}


def log_choice(model: PipelineModule, choices: dict) -> None:
    """The 'auto' choice of this rank's stage, on its first replica (DeepSpeed logger, INFO)."""
    mine = choices.get(model.stage_id)
    if mine is not None and model._topo.get_coord(model.global_rank).data == 0:
        from deepspeed.utils import logger
        logger.info(f"hippie-ds: deferred_layers auto, {mine.describe()}")


def _layer_sizes(model: PipelineModule, stage: int) -> list[float]:
    """Parameter count of each of ``stage``'s layers as this rank built them (0 for functions
    and tied modules reached through a function, which the engine never delays either)."""
    import torch
    start = model.parts[stage] - getattr(model, "_local_start", model.parts[stage])
    funcs = model.forward_funcs[start:start + model.parts[stage + 1] - model.parts[stage]]
    return [float(numel(f.parameters())) if isinstance(f, torch.nn.Module) else 0.0 for f in funcs]


def schedules_with_param(param: str) -> list[str]:
    """The built-in schedules that declare ``param`` (asked of their specs)."""
    from ..schedules.spec import available
    return [name for name in available() if param in load_spec(name).params]
