"""``hippie.deferred_layers`` in the adapter: what the module tells the one resolution pass
(:func:`hippie_ds.schedules.resolve.resolve`, pure; the decision is in global layer indices,
which the engine takes as they are). This module only

* describes every stage's layers from the module (:func:`stage_layers`: which hold trainable
  parameters as built, gathered with one all-reduce over the world since a rank builds only its
  own stage; which are modules tied to another stage, from the layer specs every rank has);
* gives "auto" the model's own layer sizes where the cost file has no per-layer breakdown
  (:func:`layer_sizes`);
* checks the value against the schedule and names the config keys in errors
  (:func:`resolve_for_module`).

The default, ``"untied"``, delays a deferred stage's first layer with parameters that is not a
module tied to another stage: Megatron's stage 0 starts with the word embedding tied to the
output head on the last stage; delaying it (``1``) delays the head's weights as well (one rule
per tied module, adapter/gradients/tied.py), which cost 0.3-1.2% of loss against stock on the two GPT
codebases tried; "untied" delays the first transformer layer instead (docs/results.md).
"""

from __future__ import annotations


from ...config import AUTO_LAYERS, WHOLE_STAGE, ConfigError
from ...schedules import load_spec
from ...schedules.costs import Costs, CostsError
from ...schedules.deferral import StageLayers
from ...schedules.resolve import Resolved, Shape, resolve
from ..ds import module as ds_module
from ..ds.module import PipelineModule, TiedLayerSpec
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

    flags = torch.zeros(
        len(ds_module.layer_specs(model)), dtype=torch.int32, device=get_accelerator().current_device_name()
    )
    for i, f in enumerate(funcs):
        if isinstance(f, torch.nn.Module) and any(p.requires_grad for p in f.parameters()):
            flags[ds_module.local_start(model) + i] = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(x) for x in flags.tolist()]


def tie_holders(model: PipelineModule) -> dict[str, dict[int, list[int]]]:
    """{tie key: {stage: the layer indices of that stage where the tied module appears}}."""
    holders: dict[str, dict[int, list[int]]] = {}
    for idx, spec in enumerate(ds_module.layer_specs(model)):
        if isinstance(spec, TiedLayerSpec):
            holders.setdefault(spec.key, {}).setdefault(model.stage_owner(idx), []).append(idx)
    return {key: stages for key, stages in holders.items() if len(stages) > 1}


def _tie_keys(model: PipelineModule) -> tuple[dict[int, str], dict[int, set[str]]]:
    """({layer index: key} of the modules tied to another stage, {stage: keys it holds})."""
    if not getattr(model, "tied_comms", None) or not ds_module.has_layer_specs(model):
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
    return [i in at for i in range(len(ds_module.layer_specs(model)))]


def stage_layers(model: PipelineModule, flags: list[bool] | None = None) -> dict[int, StageLayers]:
    """Every stage's :class:`StageLayers` (with virtual stages: its first chunk's, the leading
    ones). ``flags``: :func:`layers_with_parameters`; None: a stand-in without built layers,
    whose layers all count as holding parameters."""
    at, held = _tie_keys(model)
    out = {}
    for s in range(model.num_stages if hasattr(model, "num_stages") else len(model.parts) - 1):
        a, e = model.parts[s], model.parts[s + 1]
        tied = tuple(at.get(i) for i in range(a, e))
        out[s] = StageLayers(
            a,
            tuple(flags[a:e]) if flags is not None else (True,) * (e - a),
            tied if any(tied) else (),
            frozenset(held.get(s, set()) - set(tied)),
        )
    return out


def _check(options, spec) -> None:
    """The value against the schedule, before anything is decided."""
    value = options.deferred_layers
    if "deferred_stages" not in spec.params:
        if "deferred_layers" not in options.model_fields_set or value == WHOLE_STAGE:
            return  # the default, and "all", mean nothing to a schedule without deferred stages
        raise ConfigError(
            f'config key "hippie.deferred_layers" = {value!r}: schedule {spec.name!r} has no deferred '
            f"stages (partial deferral applies to the deferred stages of "
            f"{', '.join(schedules_with_param('deferred_stages'))})"
        )
    if options.staleness_price is not None and value != AUTO_LAYERS:
        raise ConfigError(
            f'config key "hippie.staleness_price" = {options.staleness_price!r}: it prices only '
            f'"hippie.deferred_layers": "auto", and that key is {value!r} here; remove one of them'
        )


def resolve_for_module(
    model: PipelineModule, options, spec, shape: Shape, params: dict, costs: Costs | None = None
) -> Resolved:
    """The schedule ``model`` runs, by :func:`hippie_ds.schedules.resolve.resolve` with what the
    module tells it: every stage's layers (:func:`stage_layers`, gathered with one all-reduce
    only when the value needs them), whether it ties modules across stages, and for "auto" on a
    stage whose costs have no per-layer breakdown, the model's own layers' parameter bytes
    (:func:`layer_sizes`). ``costs``: ``hippie.costs`` as read once at start-up. Errors name the
    config keys."""
    from ...schedules.deferral.auto_layers import NeedsCosts

    _check(options, spec)
    shown = f'config key "hippie.deferred_layers" = {AUTO_LAYERS!r}'
    try:
        return resolve(
            spec,
            shape,
            params,
            options.deferred_layers,
            costs,
            lambda need: stage_layers(model, layers_with_parameters(model) if need else None),
            ties=bool(getattr(model, "tied_comms", None)),
            staleness_price=options.staleness_price,
            layer_bytes=layer_sizes(model),
            validate=False,
        )
    except NeedsCosts:
        made = (
            f'; the plan {options.plan!r} ("hippie.plan") states no choice (made before "auto" existed): make it '
            "again with `hippie-ds plan`"
            if options.plan is not None
            else '; or "hippie.plan", a plan from `hippie-ds plan` (it carries the choice)'
        )
        raise ConfigError(
            f'{shown}: needs costs to choose from: "hippie.costs", a cost file with per-stage costs '
            f"(per-layer ones optional, see docs/reference.md){made}"
        ) from None
    except CostsError as exc:
        raise ConfigError(f'{shown}: config key "hippie.costs" = {options.costs!r}: {exc}') from None


def read_costs(options, num_stages: int):
    """``hippie.costs`` read (once, at start-up), its errors naming the key."""
    try:
        return Costs.from_file(options.costs, num_stages=num_stages)
    except CostsError as exc:
        raise ConfigError(f'config key "hippie.costs" = {options.costs!r}: {exc}') from None


def layer_sizes(model: PipelineModule):
    """``layer_bytes(stage)`` for "auto" on a stage whose costs have no per-layer breakdown: the
    model's own layers' parameter bytes, built on the meta device from the layer specs, the same
    on every rank. When a layer cannot be built there, this rank's stage counts its built layers
    (``model.forward_funcs``) and another stage is taken as equal layers (a stage's choice depends
    on the others' only through the link they share); every replica of a stage still chooses alike."""
    from .pipeline_module import layer_param_bytes

    every = []

    def sizes(s: int) -> list[float]:
        if not every:
            every.append(layer_param_bytes(ds_module.layer_specs(model)))
        count = model.parts[s + 1] - model.parts[s]
        return (
            every[0][model.parts[s] : model.parts[s + 1]]
            if every[0] is not None
            else _layer_sizes(model, s)
            if s == model.stage_id
            else [1.0] * count
        )

    return sizes


def log_choice(model: PipelineModule, choices: dict) -> None:
    """The 'auto' choice of this rank's stage, on its first replica (DeepSpeed logger, INFO)."""
    mine = choices.get(model.stage_id)
    if mine is not None and ds_module.data_parallel_index(model, model.global_rank) == 0:
        from deepspeed.utils import logger

        logger.info(f"hippie-ds: deferred_layers auto, {mine.describe()}")


def _layer_sizes(model: PipelineModule, stage: int) -> list[float]:
    """Parameter count of each of ``stage``'s layers as this rank built them (0 for functions
    and tied modules reached through a function, which the engine never delays either)."""
    import torch

    start = model.parts[stage] - ds_module.local_start(model, model.parts[stage])
    funcs = model.forward_funcs[start : start + model.parts[stage + 1] - model.parts[stage]]
    return [float(numel(f.parameters())) if isinstance(f, torch.nn.Module) else 0.0 for f in funcs]


def schedules_with_param(param: str) -> list[str]:
    """The built-in schedules that declare ``param`` (asked of their specs)."""
    from ...schedules.spec import available

    return [name for name in available() if param in load_spec(name).params]
