"""``hippie_ds.initialize``: a drop-in for ``deepspeed.initialize``.

Mirrors DeepSpeed's pipeline branch, with everything that can be wrong with the config or the
schedule checked first, identically on every rank, before the engine's first collective.
"""
from __future__ import annotations

import os

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology

from .._compat import check_deepspeed_version
from ..config import AUTO_LAYERS, WHOLE_STAGE, ConfigError, merge_plan, read_config, schedule_params, split_config
from ..schedules import compile as compile_schedule, load_spec, recompile
from .precision import check_precision
from .tied import check_tied, delay_ties

check_deepspeed_version()


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
    if options.placement is not None or model._topo.get_dim("data") < 2 or not compiled.has_early_allreduce:
        return
    if _placement_of(model._topo) != "data_parallel_in_node":
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
    return read_config(config)


def _apply_plan(model: PipelineModule, config: dict, options, config_path: str | None) -> dict:
    """The config with the plan's keys merged in, after checking that ``model`` was built from
    the same plan (boundaries, checkpointed layers, model, world size)."""
    from .pipeline_module import check_plan, locate_plan, resolve_plan

    plan = resolve_plan(locate_plan(options.plan, config_path))
    check_plan(plan, model._layer_specs, world_size=model.world_size, num_stages=model.num_stages)
    ckpt = list(getattr(model, "checkpointed_layers", []))
    if list(model.parts) != plan.boundaries or ckpt != plan.checkpointed_layers or \
            model.activation_checkpoint_interval:
        raise ConfigError(f'config key "hippie.plan" = {options.plan!r}: the plan has stage boundaries '
                          f"{plan.boundaries} and checkpointed layers {plan.checkpointed_layers}, but the model was "
                          f"built with boundaries {list(model.parts)} and checkpointed layers {ckpt}"
                          f"{' and an activation_checkpoint_interval' if model.activation_checkpoint_interval else ''}"
                          "; build it with hippie_ds.PipelineModule(layers, ..., config=<this config>) (or plan=...)")
    return merge_plan(config, plan.deepspeed_config(), options.plan)


def prepare(model: PipelineModule, config: dict, config_path: str | None = None):
    """Validate the config and compile the schedule for ``model``: (ds_config, config_class,
    compiled schedule, hippie options). Pure checks, no collectives."""
    ds_config, schedule_name, options = split_config(config)
    if options.plan is not None:
        ds_config, schedule_name, options = split_config(_apply_plan(model, config, options, config_path))
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    stages = model.num_stages
    micro_batches = config_class.gradient_accumulation_steps
    spec = load_spec(schedule_name)
    params = schedule_params(options, spec.params, schedules_with_param)
    if options.costs is not None and any(params.get(n, p.default) == "auto" for n, p in spec.params.items()
                                         if p.kind == "stage_list"):
        from ..schedules.costs import Costs
        from ..schedules.auto_params import resolve_auto_params
        resolved = resolve_auto_params(schedule_name, stages, micro_batches,
                                       Costs.from_file(options.costs, num_stages=stages))
        params = {**resolved, **{k: v for k, v in params.items() if v != "auto"}}
    compiled = compile_schedule(schedule_name, stages, micro_batches, **params)
    from .engine import check_single_grad_slot
    for stage in range(stages):
        check_single_grad_slot(compiled, stage)
    placement = _placement_of(model._topo)
    if options.placement is not None and placement is not None and placement != options.placement and \
            model._topo.get_dim("data") > 1:
        raise ConfigError(f'config key "hippie.placement" = {options.placement!r}, but the PipelineModule was built '
                          f"with the {placement!r} layout; build it with "
                          f"topology=hippie_ds.make_topology(num_stages, world_size, {options.placement!r})")
    check_tied(model, compiled)
    check_precision(compiled, config_class)
    if compiled.splits_backward:
        from .split_backward import check_torch_version
        try:
            check_torch_version()
        except ImportError as exc:
            raise ConfigError(str(exc)) from None
    return ds_config, config_class, compiled, options


def deferred_layers(model: PipelineModule, options, compiled, choices: dict | None = None) -> dict[int, int]:
    """``hippie.deferred_layers`` per deferred stage ({stage: leading layers delayed}), only for
    stages it delays partly (0: nothing, see :func:`without_undelayed`); checked before any
    process group exists. The default applies to the schedules that have deferred stages and is
    ignored by the others; a value the config sets is checked against the schedule; "auto" is
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
    if value == AUTO_LAYERS:
        auto = auto_deferred_layers(model, options, compiled)
        (choices if choices is not None else {}).update(auto)
        value = {s: c.layers for s, c in auto.items()}
    if isinstance(value, dict):
        extra = sorted(set(value) - set(deferred))
        if extra:
            raise ConfigError(f"{shown}: stage(s) {extra} are not deferred; deferred stages: {deferred}")
    counts = {s: value if isinstance(value, int) else value.get(s) for s in deferred}
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


def _log_choice(model: PipelineModule, choices: dict) -> None:
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


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """Same arguments and return value as ``deepspeed.initialize``. A ``PipelineModule`` gets a
    :class:`HippiePipelineEngine` running ``config["pipeline"]["schedule"]``; anything else goes
    to ``deepspeed.initialize`` unchanged."""
    if not isinstance(model, PipelineModule):
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

    from .engine import HippiePipelineEngine

    config_path = _config_path(args, config, config_params)
    config = _load_config(args, config, config_params)
    ds_config, config_class, compiled, options = prepare(model, config, config_path)
    choices: dict = {}
    compiled, partial = without_undelayed(compiled, deferred_layers(model, options, compiled, choices))
    compiled, partial, tied_delayed = delay_ties(model, compiled, partial)  # tied copies: one rule

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
                                  deferred_layers=partial, tied_delayed=tied_delayed)
    zero.partition_parameters.restore_init_context()
    _log_choice(model, choices)
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
