"""``hippie_ds.initialize``: a drop-in for ``deepspeed.initialize``.

Mirrors DeepSpeed's pipeline branch, with everything that can be wrong with the config or the
schedule checked first, identically on every rank, before the engine's first collective.
"""
from __future__ import annotations

import os

import deepspeed

from .._compat import check_deepspeed
from ..config import AUTO_LAYERS, ConfigError, merge_plan, read_config, schedule_params, split_config
from ..schedules import load_spec, validator
from ..schedules.compiler import resolve_virtual_stages
from ..schedules.resolve import Shape
from .process.clean_exit import wait_at_exit
from .ds import engine as ds_engine, module as ds_module
from .ds.module import PipelineModule, ProcessTopology
from .ds.runtime import DeepSpeedConfig
from .module.deferred_layers import log_choice, read_costs, resolve_for_module, schedules_with_param
from .module.chunks import chunks_phrase as _chunks, held_chunks
from .precision.paths import check_precision
from .gradients.tied import check_tied, tied_stage_groups

check_deepspeed()


def make_topology(num_stages: int, world_size: int, placement: str = "pipeline_in_node") -> ProcessTopology:
    """Process topology for a ``PipelineModule``.

    ``pipeline_in_node`` (Hippie's layout): consecutive ranks are consecutive pipeline stages, so
    a node holds whole pipelines and data-parallel all-reduces cross nodes.
    ``data_parallel_in_node`` is DeepSpeed's ``PipeDataParallelTopology``: consecutive ranks are
    data-parallel peers and the pipeline crosses nodes.
    """
    if num_stages < 1 or world_size % num_stages:
        raise ConfigError(f"num_stages = {num_stages}: must divide the world size {world_size}")
    dp = world_size // num_stages
    if placement == "pipeline_in_node":
        return ProcessTopology(axes=["data", "pipe"], dims=[dp, num_stages])
    if placement == "data_parallel_in_node":
        return ProcessTopology(axes=["pipe", "data"], dims=[num_stages, dp])
    raise ConfigError(f'placement = {placement!r}: allowed "pipeline_in_node", "data_parallel_in_node"')


SHM_DIR = "/dev/shm"


def deepspeed_shm_segments(port: str | int, rank: str | int | None = None, addr: str | None = None) -> list[str]:
    """Paths of the shared-memory segments DeepSpeed's CPU comm op made for a job (by master
    port, optionally one rank's). DeepSpeed 0.19 creates one per rank
    (``deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}``) and never unlinks it."""
    import glob
    import os
    pattern = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr or '*'}_{port}_{'*' if rank is None else rank}"
    return glob.glob(os.path.join(SHM_DIR, pattern))


def _release_shm_at_exit():
    import atexit
    import os
    port, rank = os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if port is None or rank is None:
        return

    def release():
        for path in deepspeed_shm_segments(port, rank, os.environ.get("MASTER_ADDR")):
            try:
                os.unlink(path)  # peers that mapped it keep their mapping
            except OSError:
                pass
    atexit.register(release)


def _placement_of(topology: ProcessTopology) -> str | None:
    axes = list(topology.get_axis_names())
    if axes == ["data", "pipe"]:
        return "pipeline_in_node"
    if axes[:2] == ["pipe", "data"]:
        return "data_parallel_in_node"
    return None


def _suggest_placement(model: PipelineModule, options, compiled) -> None:
    """One info line (rank 0) when the model keeps DeepSpeed's layout and Hippie's would help."""
    if options.placement is not None or ds_module.topology(model).get_dim("data") < 2 or \
            not compiled.has_early_allreduce:
        return
    if _placement_of(ds_module.topology(model)) != "data_parallel_in_node":
        return
    from deepspeed.utils import log_dist
    log_dist(f"hippie-ds: schedule {compiled.name!r} runs in the module's layout (DeepSpeed's default: data-parallel "
             "peers on one node, the pipeline across nodes). Its hidden all-reduce pays most with whole pipelines "
             "inside a node and the all-reduce across nodes: build the module with topology="
             "hippie_ds.make_topology(num_stages, world_size) and set \"hippie\": {\"placement\": "
             "\"pipeline_in_node\"}", ranks=[0])


def _config_path(args, config, config_params):
    """The config file's path when the config was given as one (plan paths are relative to it)."""
    for c in (getattr(args, "deepspeed_config", None), config, config_params):
        if isinstance(c, (str, os.PathLike)):
            return str(c)
    return None


def _load_config(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ConfigError("given both args.deepspeed_config and config=; pass one")
        config = args.deepspeed_config
    if config is None:
        raise ConfigError("DeepSpeed requires a config: pass config= or --deepspeed_config")
    if isinstance(config, (str, os.PathLike)):
        from .module.config_discovery import decode
        return decode(config)[0]  # a file, or the base64 JSON DeepSpeed also accepts
    return read_config(config)


def _apply_plan(model: PipelineModule, config: dict, options, config_path: str | None) -> dict:
    """The config with the plan's keys merged in, after checking that ``model`` was built from
    the same plan (boundaries, checkpointed layers, model, world size)."""
    from .module.pipeline_module import check_plan, locate_plan, module_stages_source, resolve_plan

    plan = resolve_plan(locate_plan(options.plan, config_path))
    check_plan(plan, ds_module.layer_specs(model), world_size=model.world_size, num_stages=model.num_stages,
               stages_from=module_stages_source(model))
    # a chunked module's parts are its K·v+1 model-part boundaries (adapter/module/chunks.py), placed by its layout
    held, planned = held_chunks(model), (plan.virtual_stages, plan.layout)
    ckpt = list(getattr(model, "checkpointed_layers", []))
    if _chunks(*held) != _chunks(*planned) or list(model.parts) != plan.boundaries or \
            ckpt != plan.checkpointed_layers or model.activation_checkpoint_interval:
        raise ConfigError(f'config key "hippie.plan" = {options.plan!r}: the plan has {_chunks(*planned)}, '
                          f"boundaries {plan.boundaries} and checkpointed layers {plan.checkpointed_layers}, but the "
                          f"model was built with {_chunks(*held)}, boundaries {list(model.parts)} and checkpointed "
                          f"layers {ckpt}"
                          f"{' and an activation_checkpoint_interval' if model.activation_checkpoint_interval else ''}"
                          "; " + module_fix(model, "the plan's model parts"))
    return merge_plan(config, plan.deepspeed_config(), options.plan)


def prepare(model: PipelineModule, config: dict, config_path: str | None = None, choices: dict | None = None):
    """Validate the config and resolve the schedule for ``model`` (:func:`~hippie_ds.schedules.resolve.resolve`:
    'auto' parameters, one compile, the deferral), once: (ds_config, config_class, compiled
    schedule, hippie options, Deferral). The cost file is read once; the schedule is validated
    once. Checks only; the one collective is ``layers_with_parameters``' all-reduce
    (``choices``: the "auto" choice, for the log)."""
    ds_config, schedule_name, options = split_config(config)
    if options.plan is None and getattr(model, "hippie_plan_source", None) is not None:
        raise ConfigError(f'config key "hippie.plan" is not set, but the hippie_ds.PipelineModule took the plan '
                          f"for {model.hippie_plan.model!r} from the DeepSpeed config {model.hippie_plan_source}: give "
                          "the module and hippie_ds.initialize the same config")
    if options.plan is not None:
        ds_config, schedule_name, options = split_config(_apply_plan(model, config, options, config_path))
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    stages = model.num_stages
    micro_batches = config_class.gradient_accumulation_steps
    spec = load_spec(schedule_name)
    # the module first: a user who fixes the micro-batch count must not meet the module next
    check_chunks(model, schedule_name, (resolve_virtual_stages(spec, stages, micro_batches, options.virtual_stages),
                                        spec.layout), options.virtual_stages)
    params = schedule_params(options, spec.params, schedules_with_param)
    auto_stages = any(params.get(n, p.default) == "auto" for n, p in spec.params.items() if p.kind == "stage_list")
    costs = (read_costs(options, stages) if options.costs is not None and
             (auto_stages or options.deferred_layers == AUTO_LAYERS) else None)  # read once
    if costs is not None and costs.tied_groups is None:  # what ReduceTiedGrads waits for
        costs = costs.model_copy(update={"tied_groups": tied_stage_groups(model)})
    resolved = resolve_for_module(model, options, spec, Shape(stages, micro_batches, options.virtual_stages), params,
                                  costs)
    if choices is not None:
        choices.update(resolved.choices)
    compiled = validator.validate(resolved.compiled)
    from .engine.engine import check_single_grad_slot
    for stage in range(stages):
        check_single_grad_slot(compiled, stage)
    placement = _placement_of(ds_module.topology(model))
    if options.placement is not None and placement is not None and placement != options.placement and \
            ds_module.topology(model).get_dim("data") > 1:
        raise ConfigError(f'config key "hippie.placement" = {options.placement!r}, but the PipelineModule was built '
                          f"with the {placement!r} layout; build it with "
                          f"topology=hippie_ds.make_topology(num_stages, world_size, {options.placement!r})")
    check_tied(model, compiled)
    check_precision(compiled, config_class, held_chunks(model))
    if compiled.splits_backward:
        from .gradients.split_backward import check_torch_version
        try:
            check_torch_version()
        except ImportError as exc:
            raise ConfigError(str(exc)) from None
    return ds_config, config_class, compiled, options, resolved.deferral


def module_fix(model, what: str) -> str:
    """How to build ``model`` so that it holds ``what`` this config asks for: it names where the
    module took its config from (:mod:`hippie_ds.adapter.module.config_discovery`)."""
    if not hasattr(model, "hippie_config_source"):
        return (f"the model is DeepSpeed's PipelineModule ({type(model).__name__}), which cannot hold {what}: build it "
                "with hippie_ds.PipelineModule, which takes DeepSpeed's arguments (`from hippie_ds import "
                "PipelineModule` in place of DeepSpeed's, also as a base class) and reads this config from "
                "--deepspeed_config in sys.argv, hippie_ds.set_config(<config>) or config=<config>")
    source = model.hippie_config_source
    if source is None:
        return ("the hippie_ds.PipelineModule was built without a DeepSpeed config (no config=, no "
                "hippie_ds.set_config(), no --deepspeed_config in sys.argv): give it this config with config=<config>, "
                "hippie_ds.set_config(<config>) before building it, or --deepspeed_config")
    if source == "config=":
        return "the hippie_ds.PipelineModule was built with another config=: give it and hippie_ds.initialize the same"
    return (f"the hippie_ds.PipelineModule took its layout from the DeepSpeed config {source}, which differs: give the "
            "module and hippie_ds.initialize the same config (hippie_ds.set_config(<config>) before building the "
            "module sets the module's, ahead of sys.argv)")


def check_chunks(model: PipelineModule, schedule: str, wanted: tuple[int, str], given: int | None = None) -> None:
    """The module holds the model chunks the schedule runs (virtual stages are built with the layers);
    checked before anything else about the schedule, since the module is what to change first."""
    held = held_chunks(model)
    if held == wanted or held[0] == wanted[0] == 1:
        return
    key = f'"pipeline.virtual_stages" = {given} with ' if given is not None else ""
    what = f'config key {key}"pipeline.schedule" = {schedule!r} runs {_chunks(*wanted)}, but the PipelineModule'
    if getattr(model, "hippie_config_source", "") is None and held[0] > 1:  # virtual_stages= given, no config
        raise ConfigError(f"{what} was built with virtual_stages={held[0]}, layout={held[1]!r}; build it with "
                          f"virtual_stages={wanted[0]}, layout={wanted[1]!r}, or with config=<this config>")
    raise ConfigError(f"{what} holds {_chunks(*held)}; {module_fix(model, _chunks(*wanted))}")


def _is_dualpipev(model) -> bool:
    try:
        return isinstance(model, ds_module.dualpipev_module())
    except ImportError:  # DeepSpeed before DualPipeV
        return False


def check_dualpipev_config(config: dict) -> None:
    """A ``DualPipeVModule`` (two stages per pipeline rank) is DeepSpeed's own schedule: stock
    ``deepspeed.initialize`` runs it with ``DualPipeVEngine``, and so does ``hippie_ds.initialize``.
    A config that asks hippie-ds for something there is refused, before any collective."""
    pipeline = config.get("pipeline")
    what = ('the model is a DualPipeVModule, which DeepSpeed trains with its own DualPipeV schedule '
            "(DualPipeVEngine, two stages per pipeline rank); hippie-ds schedules run on a "
            "deepspeed.pipe.PipelineModule")
    if isinstance(pipeline, dict) and "schedule" in pipeline:
        raise ConfigError(f'config key "pipeline.schedule" = {pipeline["schedule"]!r}: {what}. Remove '
                          '"pipeline.schedule" to train the DualPipeVModule as stock DeepSpeed does, or build a '
                          "PipelineModule to run a hippie-ds schedule")
    if config.get("hippie"):
        raise ConfigError(f'config key "hippie" = {config["hippie"]!r}: {what}, and these options configure only '
                          'those. Remove "hippie" to train the DualPipeVModule as stock DeepSpeed does, or build a '
                          "PipelineModule to run a hippie-ds schedule")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """Same arguments and return value as ``deepspeed.initialize``. A ``PipelineModule`` gets a
    :class:`HippiePipelineEngine` running ``config["pipeline"]["schedule"]``; anything else, and
    DeepSpeed's ``DualPipeVModule`` (:func:`check_dualpipev_config`), goes to
    ``deepspeed.initialize`` unchanged."""
    wait_at_exit()  # gloo's workers release their last collectives before the interpreter finalizes
    if not isinstance(model, PipelineModule) or _is_dualpipev(model):
        if isinstance(model, PipelineModule):
            check_dualpipev_config(_load_config(args, config, config_params))
        kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                      training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                      dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                      mesh_param=mesh_param, config_params=config_params)
        if distributed_port is not None:
            kwargs["distributed_port"] = distributed_port
        return deepspeed.initialize(**kwargs)
    if mpu is not None:
        raise ConfigError("mpu must be None with pipeline parallelism (the PipelineModule provides it)")
    from deepspeed import comm as dist
    from deepspeed import zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed import set_optimizer_flags

    from .engine.engine import HippiePipelineEngine

    # plan paths: relative to the config file; for a dict, to the file the module found (set_config, sys.argv)
    config_path = _config_path(args, config, config_params) or getattr(model, "hippie_config_path", None)
    config = _load_config(args, config, config_params)
    choices: dict = {}
    ds_config, config_class, compiled, options, deferral = prepare(model, config, config_path, choices)
    # hippie.staleness "adam": an Adam it reads (importing it registers the method, which the engine builds with
    # the optimizer DeepSpeed makes)
    from .staleness.adam import check_config as check_staleness
    check_staleness(options.staleness, ds_config, optimizer)
    from .staleness.error_feedback import check as check_error_feedback  # hippie.staleness.error_feedback: 2bw only
    check_error_feedback(options.staleness, compiled)
    from .staleness.delay_compensation import check as check_delay_compensation  # 2bw with method "none" only
    check_delay_compensation(options.staleness, compiled)

    zero.partition_parameters.shutdown_init_context()
    init_kwargs = dict(dist_backend=get_accelerator().communication_backend_name(),
                       dist_init_required=dist_init_required)
    if distributed_port is not None:
        init_kwargs["distributed_port"] = distributed_port
    dist.init_distributed(**init_kwargs)
    _release_shm_at_exit()  # otherwise every CPU job leaves ~64 MB per rank in /dev/shm
    _suggest_placement(model, options, compiled)
    set_optimizer_flags(config_class, model)
    engine = HippiePipelineEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=model.mpu(),
                                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                                  config_class=config_class, compiled_schedule=compiled,
                                  timeline_dir=options.timeline_dir,
                                  timeline_steps=options.timeline_steps, staleness=options.staleness,
                                  deferral=deferral)
    zero.partition_parameters.restore_init_context()
    log_choice(model, choices)
    if options.profile is not None:  # hippie.profile: measure the layers in place, write one profile
        from .profiling.profile_in_place import profile_in_place
        profile_in_place(engine, options.profile)
    ds_engine.configure_python_gc(engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
