"""What start-up reads, once: the DeepSpeed config ``hippie_ds.initialize`` is given and the plan it
names. A ``hippie_ds.PipelineModule`` has read them already when it was built (its config:
:mod:`hippie_ds.adapter.module.config_discovery`; ``hippie_config``, ``hippie_config_path`` and
``hippie_plan`` record them): given the same config, start-up takes the module's instead of reading
the files again."""

from __future__ import annotations

import os
from pathlib import Path

from ...config import ConfigError, merge_plan, read_config
from ..ds import module as ds_module
from ..module.chunks import chunks_phrase, held_chunks
from ..module.config_discovery import decode
from ..module.pipeline_module import check_plan, locate_plan, module_stages_source, resolve_plan


def config_path(args, config, config_params, model=None) -> str | None:
    """The config file's path, which plan paths are relative to: the one given as a file, else (a
    dict) the file the module found (``hippie_ds.set_config``, ``sys.argv``)."""
    for c in (getattr(args, "deepspeed_config", None), config, config_params):
        if isinstance(c, (str, os.PathLike)):
            return str(c)
    return getattr(model, "hippie_config_path", None)


def _same_file(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def load_config(args, config, config_params, model=None) -> dict:
    """The DeepSpeed config given to ``initialize`` (``args.deepspeed_config``, ``config=`` or
    ``config_params=``), read once: the module's own read when it names the file the module read."""
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ConfigError("given both args.deepspeed_config and config=; pass one")
        config = args.deepspeed_config
    if config is None:
        raise ConfigError("DeepSpeed requires a config: pass config= or --deepspeed_config")
    if isinstance(config, (str, os.PathLike)):
        if getattr(model, "hippie_config", None) is not None and _same_file(config, model.hippie_config_path):
            return model.hippie_config
        return decode(config)[0]  # a file, or the base64 JSON DeepSpeed also accepts
    return read_config(config)


def module_plan(model, config: dict, path: str | None):
    """The plan the module took from this same config when it was built (and checked against itself
    then), or None: the plan is read again only when the config is another one."""
    if getattr(model, "hippie_plan_source", None) is None or getattr(model, "hippie_config", None) != config:
        return None
    return model.hippie_plan if path == getattr(model, "hippie_config_path", None) else None


def apply_plan(model, config: dict, options, path: str | None) -> dict:
    """The config with the plan's keys merged in. A plan the module did not take from this config is
    read here and checked against ``model`` (boundaries, checkpointed layers, model, world size)."""
    plan = module_plan(model, config, path)
    if plan is None:
        plan = resolve_plan(locate_plan(options.plan, path))
        check_plan(
            plan,
            ds_module.layer_specs(model),
            world_size=model.world_size,
            num_stages=model.num_stages,
            stages_from=module_stages_source(model),
        )
        # a chunked module's parts are its K·v+1 model-part boundaries (adapter/module/chunks.py), placed by its layout
        held, planned = held_chunks(model), (plan.virtual_stages, plan.layout)
        ckpt = list(getattr(model, "checkpointed_layers", []))
        interval = " and an activation_checkpoint_interval" if model.activation_checkpoint_interval else ""
        if (
            chunks_phrase(*held) != chunks_phrase(*planned)
            or list(model.parts) != plan.boundaries
            or ckpt != plan.checkpointed_layers
            or model.activation_checkpoint_interval
        ):
            raise ConfigError(
                f'config key "hippie.plan" = {options.plan!r}: the plan has {chunks_phrase(*planned)}, '
                f"boundaries {plan.boundaries} and checkpointed layers {plan.checkpointed_layers}, but "
                f"the model was built with {chunks_phrase(*held)}, boundaries {list(model.parts)} and "
                f"checkpointed layers {ckpt}{interval}; " + module_fix(model, "the plan's model parts")
            )
    return merge_plan(config, plan.deepspeed_config(), options.plan)


def module_fix(model, what: str) -> str:
    """How to build ``model`` so that it holds ``what`` this config asks for: it names where the
    module took its config from (:mod:`hippie_ds.adapter.module.config_discovery`)."""
    if not hasattr(model, "hippie_config_source"):
        return (
            f"the model is DeepSpeed's PipelineModule ({type(model).__name__}), which cannot hold {what}: build it "
            "with hippie_ds.PipelineModule, which takes DeepSpeed's arguments (`from hippie_ds import "
            "PipelineModule` in place of DeepSpeed's, also as a base class) and reads this config from "
            "--deepspeed_config in sys.argv, hippie_ds.set_config(<config>) or config=<config>"
        )
    source = model.hippie_config_source
    if source is None:
        return (
            "the hippie_ds.PipelineModule was built without a DeepSpeed config (no config=, no "
            "hippie_ds.set_config(), no --deepspeed_config in sys.argv): give it this config with config=<config>, "
            "hippie_ds.set_config(<config>) before building it, or --deepspeed_config"
        )
    if source == "config=":
        return "the hippie_ds.PipelineModule was built with another config=: give it and hippie_ds.initialize the same"
    return (
        f"the hippie_ds.PipelineModule took its layout from the DeepSpeed config {source}, which differs: give the "
        "module and hippie_ds.initialize the same config (hippie_ds.set_config(<config>) before building the "
        "module sets the module's, ahead of sys.argv)"
    )
