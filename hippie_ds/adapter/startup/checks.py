"""Every check ``hippie_ds.initialize`` makes, in one order, before the engine's first collective:
:func:`start` for a ``PipelineModule`` (:func:`prepare` lists the order), :func:`start_stock` for
a model DeepSpeed trains itself. Each rank reads the same config and module, so every rank refuses
alike, with one line naming the config key (the only collective before them is the all-reduce that
gathers the module's layers when a deferral needs them, ``layers_with_parameters``). An optimizer a
callable builds is checked as DeepSpeed builds it (:func:`~hippie_ds.adapter.staleness.adam.checked_when_built`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ...config import AUTO_LAYERS, ConfigError, schedule_params, split_config
from ...schedules import load_spec, validator
from ...schedules.compiler import resolve_virtual_stages
from ...schedules.deferral import Deferral
from ...schedules.ir import CompiledSchedule
from ...schedules.resolve import Shape
from ...schedules.stage_checks import check_single_grad_slot
from ..ds import module as ds_module
from ..ds.module import PipelineModule, ProcessTopology
from ..ds.runtime import DeepSpeedConfig
from ..gradients.tied import check_tied, tied_stage_groups
from ..module.chunks import chunks_phrase, held_chunks
from ..module.deferred_layers import read_costs, resolve_for_module, schedules_with_param
from ..precision.paths import check_precision
from ..staleness import adam, delay_compensation, error_feedback
from . import inputs


class Started(NamedTuple):
    """What start-up hands the engine: the client's ``optimizer`` (a callable: checked as it builds),
    the DeepSpeed config without ``hippie`` and DeepSpeed's reading of it, the compiled and validated
    schedule, the ``hippie`` options and the deferral."""

    optimizer: Any
    ds_config: dict
    config_class: Any
    compiled: CompiledSchedule
    options: Any
    deferral: Deferral


def start(args, model: PipelineModule, optimizer, mpu, config, config_params, choices: dict | None = None) -> Started:
    """The start-up of a ``PipelineModule``: the config read once (:mod:`.inputs`), then every check
    (:func:`prepare`). ``choices``: filled with the "auto" choices, for the log."""
    if mpu is not None:
        raise ConfigError("mpu must be None with pipeline parallelism (the PipelineModule provides it)")
    # plan paths: relative to the config file; for a dict, to the file the module found (set_config, sys.argv)
    path = inputs.config_path(args, config, config_params, model)
    return prepare(model, inputs.load_config(args, config, config_params, model), path, choices, optimizer)


def start_stock(args, model, config, config_params) -> None:
    """The start-up of a model ``deepspeed.initialize`` trains: a DualPipeVModule's config asks
    hippie-ds for nothing (:func:`check_dualpipev_config`); anything else is not a PipelineModule."""
    if isinstance(model, PipelineModule):
        check_dualpipev_config(inputs.load_config(args, config, config_params))


def prepare(
    model: PipelineModule, config: dict, config_path: str | None = None, choices: dict | None = None, optimizer=None
) -> Started:
    """Validate the config and resolve the schedule for ``model`` (:func:`~hippie_ds.schedules.resolve.resolve`:
    'auto' parameters, one compile, the deferral), once. The checks, in this order: the plan
    (:func:`~.inputs.apply_plan`), DeepSpeed's reading of the config, the module's chunks, the
    resolution's own (keys, costs), the validator, DeepSpeed's single received-gradient slot, the
    placement, tied modules, the precision path, the split backward's torch, the staleness options
    (the optimizer ``adam`` reads, error feedback, delay compensation, the wrapper ``adam`` reads).
    The cost file is read once; the schedule is validated once (``choices``: the "auto" choice, for the log)."""
    ds_config, schedule_name, options = split_config(config)
    if options.plan is None and getattr(model, "hippie_plan_source", None) is not None:
        raise ConfigError(
            f'config key "hippie.plan" is not set, but the hippie_ds.PipelineModule took the plan '
            f"for {model.hippie_plan.model!r} from the DeepSpeed config {model.hippie_plan_source}: give "
            "the module and hippie_ds.initialize the same config"
        )
    if options.plan is not None:
        ds_config, schedule_name, options = split_config(inputs.apply_plan(model, config, options, config_path))
    config_class = DeepSpeedConfig(ds_config, model.mpu())
    stages = model.num_stages
    micro_batches = config_class.gradient_accumulation_steps
    spec = load_spec(schedule_name)
    # the module first: a user who fixes the micro-batch count must not meet the module next
    check_chunks(
        model,
        schedule_name,
        (resolve_virtual_stages(spec, stages, micro_batches, options.virtual_stages), spec.layout),
        options.virtual_stages,
    )
    params = schedule_params(options, spec.params, schedules_with_param)
    auto_stages = any(params.get(n, p.default) == "auto" for n, p in spec.params.items() if p.kind == "stage_list")
    costs = (
        read_costs(options, stages)
        if options.costs is not None and (auto_stages or options.deferred_layers == AUTO_LAYERS)
        else None
    )  # read once
    if costs is not None and costs.tied_groups is None:  # what ReduceTiedGrads waits for
        costs = costs.model_copy(update={"tied_groups": tied_stage_groups(model)})
    resolved = resolve_for_module(
        model, options, spec, Shape(stages, micro_batches, options.virtual_stages), params, costs
    )
    if choices is not None:
        choices.update(resolved.choices)
    compiled = validator.validate(resolved.compiled)
    for stage in range(stages):
        check_single_grad_slot(compiled, stage)
    check_placement(model, options.placement)
    check_tied(model, compiled)
    check_precision(compiled, config_class, held_chunks(model))
    if compiled.splits_backward:
        from ..gradients.split_backward import check_torch_version

        try:
            check_torch_version()
        except ImportError as exc:
            raise ConfigError(str(exc)) from None
    adam.check_config(options.staleness, ds_config, optimizer)  # an Adam it reads
    error_feedback.check(options.staleness, compiled)  # hippie.staleness.error_feedback: 2bw only
    delay_compensation.check(options.staleness, compiled)  # 2bw with method "none" only
    adam.check_wrapper(options.staleness, config_class)  # the wrapper DeepSpeed will put around it
    return Started(
        adam.checked_when_built(options.staleness, optimizer),
        ds_config,
        config_class,
        compiled,
        options,
        resolved.deferral,
    )


def placement_of(topology: ProcessTopology) -> str | None:
    """The ``hippie.placement`` a topology has: ``pipeline_in_node`` (Hippie's), ``data_parallel_in_node``
    (DeepSpeed's), or None (another)."""
    axes = list(topology.get_axis_names())
    if axes == ["data", "pipe"]:
        return "pipeline_in_node"
    if axes[:2] == ["pipe", "data"]:
        return "data_parallel_in_node"
    return None


def check_placement(model: PipelineModule, wanted: str | None) -> None:
    """``hippie.placement``, when set, is the layout the module was built with (with data parallelism)."""
    placement = placement_of(ds_module.topology(model))
    if (
        wanted is not None
        and placement is not None
        and placement != wanted
        and ds_module.topology(model).get_dim("data") > 1
    ):
        raise ConfigError(
            f'config key "hippie.placement" = {wanted!r}, but the PipelineModule was built '
            f"with the {placement!r} layout; build it with "
            f"topology=hippie_ds.make_topology(num_stages, world_size, {wanted!r})"
        )


def check_chunks(model: PipelineModule, schedule: str, wanted: tuple[int, str], given: int | None = None) -> None:
    """The module holds the model chunks the schedule runs (virtual stages are built with the layers);
    checked before anything else about the schedule, since the module is what to change first."""
    held = held_chunks(model)
    if held == wanted or held[0] == wanted[0] == 1:
        return
    key = f'"pipeline.virtual_stages" = {given} with ' if given is not None else ""
    what = f'config key {key}"pipeline.schedule" = {schedule!r} runs {chunks_phrase(*wanted)}, but the PipelineModule'
    if getattr(model, "hippie_config_source", "") is None and held[0] > 1:  # virtual_stages= given, no config
        raise ConfigError(
            f"{what} was built with virtual_stages={held[0]}, layout={held[1]!r}; build it with "
            f"virtual_stages={wanted[0]}, layout={wanted[1]!r}, or with config=<this config>"
        )
    raise ConfigError(f"{what} holds {chunks_phrase(*held)}; {inputs.module_fix(model, chunks_phrase(*wanted))}")


def check_dualpipev_config(config: dict) -> None:
    """A ``DualPipeVModule`` (two stages per pipeline rank) is DeepSpeed's own schedule: stock
    ``deepspeed.initialize`` runs it with ``DualPipeVEngine``, and so does ``hippie_ds.initialize``.
    A config that asks hippie-ds for something there is refused, before any collective."""
    pipeline = config.get("pipeline")
    what = (
        'the model is a DualPipeVModule, which DeepSpeed trains with its own DualPipeV schedule '
        "(DualPipeVEngine, two stages per pipeline rank); hippie-ds schedules run on a "
        "deepspeed.pipe.PipelineModule"
    )
    if isinstance(pipeline, dict) and "schedule" in pipeline:
        raise ConfigError(
            f'config key "pipeline.schedule" = {pipeline["schedule"]!r}: {what}. Remove '
            '"pipeline.schedule" to train the DualPipeVModule as stock DeepSpeed does, or build a '
            "PipelineModule to run a hippie-ds schedule"
        )
    if config.get("hippie"):
        raise ConfigError(
            f'config key "hippie" = {config["hippie"]!r}: {what}, and these options configure only '
            'those. Remove "hippie" to train the DualPipeVModule as stock DeepSpeed does, or build a '
            "PipelineModule to run a hippie-ds schedule"
        )
