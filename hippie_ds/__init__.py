"""hippie-ds: declarative pipeline schedules (Hippie, GPipe, 1F1B, ...) for DeepSpeed.

``hippie_ds.initialize`` is a drop-in for ``deepspeed.initialize``; the schedule is chosen by
name in the DeepSpeed config (``"pipeline": {"schedule": "hippie"}``). ``hippie_ds.PipelineModule``
is DeepSpeed's ``PipelineModule`` that also takes stage boundaries and re-computed layers from a
planner plan (``plan=`` or the config's ``hippie.plan``).
"""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize`` (see :func:`hippie_ds.adapter.integration.initialize`)."""
    from .adapter.integration import initialize as _initialize

    return _initialize(*args, **kwargs)


def make_topology(num_stages: int, world_size: int, placement: str = "pipeline_in_node"):
    """Process topology for a ``PipelineModule`` (see :func:`hippie_ds.adapter.integration.make_topology`)."""
    from .adapter.integration import make_topology as _make_topology

    return _make_topology(num_stages, world_size, placement)


def set_config(config):
    """The DeepSpeed config (dict or JSON path) a ``hippie_ds.PipelineModule`` built without ``config=``
    takes, ahead of ``--deepspeed_config`` in ``sys.argv`` (see :mod:`hippie_ds.adapter.module.config_discovery`)."""
    from .adapter.module.config_discovery import set_config as _set_config

    _set_config(config)


def shutdown(timeout: float = 10.0) -> bool:
    """The end of a script, on every rank: wait until gloo's worker threads have released their
    last collectives, then destroy the process groups; a rank exiting without it may die at exit
    with "terminate called without an active exception" (see :mod:`hippie_ds.adapter.process.clean_exit`)."""
    from .adapter.process.clean_exit import shutdown as _shutdown

    return _shutdown(timeout)


def __getattr__(name):
    # Lazy: importing hippie_ds must not import DeepSpeed (the schedule tools do without it).
    if name == "PipelineModule":
        from .adapter.module.pipeline_module import PipelineModule

        return PipelineModule
    raise AttributeError(f"module 'hippie_ds' has no attribute {name!r}")


__all__ = ["__version__", "initialize", "make_topology", "PipelineModule", "set_config", "shutdown"]
