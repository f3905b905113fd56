"""``hippie_ds.initialize``: a drop-in for ``deepspeed.initialize``.

Mirrors DeepSpeed's pipeline branch, with everything that can be wrong with the config or the
schedule checked first, identically on every rank, before the engine's first collective.
"""

from __future__ import annotations

import deepspeed

from .._compat import check_deepspeed
from ..config import ConfigError
from .process.clean_exit import wait_at_exit
from .ds import engine as ds_engine, module as ds_module
from .ds.module import PipelineModule, ProcessTopology
from .module.deferred_layers import log_choice
from .startup.checks import placement_of, start, start_stock

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


def _suggest_placement(model: PipelineModule, options, compiled) -> None:
    """One info line (rank 0) when the model keeps DeepSpeed's layout and Hippie's would help."""
    if (
        options.placement is not None
        or ds_module.topology(model).get_dim("data") < 2
        or not compiled.has_early_allreduce
    ):
        return
    if placement_of(ds_module.topology(model)) != "data_parallel_in_node":
        return
    from deepspeed.utils import log_dist

    log_dist(
        f"hippie-ds: schedule {compiled.name!r} runs in the module's layout (DeepSpeed's default: data-parallel "
        "peers on one node, the pipeline across nodes). Its hidden all-reduce pays most with whole pipelines "
        "inside a node and the all-reduce across nodes: build the module with topology="
        "hippie_ds.make_topology(num_stages, world_size) and set \"hippie\": {\"placement\": "
        "\"pipeline_in_node\"}",
        ranks=[0],
    )


def _is_dualpipev(model) -> bool:
    try:
        return isinstance(model, ds_module.dualpipev_module())
    except ImportError:  # DeepSpeed before DualPipeV
        return False


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """Same arguments and return value as ``deepspeed.initialize``. A ``PipelineModule`` gets a
    :class:`HippiePipelineEngine` running ``config["pipeline"]["schedule"]``; anything else, and
    DeepSpeed's ``DualPipeVModule`` (:func:`~hippie_ds.adapter.startup.checks.start_stock`), goes to
    ``deepspeed.initialize`` unchanged."""
    wait_at_exit()  # gloo's workers release their last collectives before the interpreter finalizes
    if not isinstance(model, PipelineModule) or _is_dualpipev(model):
        start_stock(args, model, config, config_params)
        kwargs = dict(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            dist_init_required=dist_init_required,
            collate_fn=collate_fn,
            config=config,
            mesh_param=mesh_param,
            config_params=config_params,
        )
        if distributed_port is not None:
            kwargs["distributed_port"] = distributed_port
        return deepspeed.initialize(**kwargs)
    choices: dict = {}
    started = start(args, model, optimizer, mpu, config, config_params, choices)  # every check, before any group
    options, compiled, config_class = started.options, started.compiled, started.config_class
    from deepspeed import comm as dist
    from deepspeed import zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed import set_optimizer_flags

    from .engine.engine import HippiePipelineEngine

    zero.partition_parameters.shutdown_init_context()
    init_kwargs = dict(
        dist_backend=get_accelerator().communication_backend_name(), dist_init_required=dist_init_required
    )
    if distributed_port is not None:
        init_kwargs["distributed_port"] = distributed_port
    dist.init_distributed(**init_kwargs)
    _release_shm_at_exit()  # otherwise every CPU job leaves ~64 MB per rank in /dev/shm
    _suggest_placement(model, options, compiled)
    set_optimizer_flags(config_class, model)
    engine = HippiePipelineEngine(
        args=args,
        model=model,
        optimizer=started.optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=model.mpu(),
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=started.ds_config,
        config_class=config_class,
        compiled_schedule=compiled,
        timeline_dir=options.timeline_dir,
        timeline_steps=options.timeline_steps,
        staleness=options.staleness,
        deferral=started.deferral,
    )
    zero.partition_parameters.restore_init_context()
    log_choice(model, choices)
    if options.profile is not None:  # hippie.profile: measure the layers in place, write one profile
        from .profiling.profile_in_place import profile_in_place

        profile_in_place(
            options.profile,
            engine.module,
            engine.add_train_batch_hook,
            device=engine.device,
            stage=engine.stage_id,
            rank=engine.global_rank,
            replica=engine.grid.data_parallel_id,
            data_parallel=engine.grid.data_parallel_size,
            micro_batch_size=engine.train_micro_batch_size_per_gpu(),
            global_batch=engine.train_batch_size(),
        )
    ds_engine.configure_python_gc(engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
