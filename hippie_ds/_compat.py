"""The DeepSpeed releases hippie-ds runs on, and the DeepSpeed internals ("seams") it relies on.

hippie-ds subclasses ``PipelineEngine`` and ``PipelineModule``, reads, sets or calls internals of
DeepSpeed's engines, pipeline module and optimizer wrappers, and overrides some of their private
methods. :data:`SEAMS` lists every internal it reaches, by the DeepSpeed module that defines it: all
of them are reached in one package, :mod:`hippie_ds.adapter.ds`, as named operations.
:data:`OVERRIDES` lists the private methods its subclasses override by name (or the op table names
as handlers); :data:`RELIED_ON` what it relies on without naming. The supported range is the
releases where all of them exist. ``tests/compat/test_seams.py`` checks the installed DeepSpeed against the
lists, that only ``adapter/ds`` (and this module) imports ``deepspeed.runtime`` or reaches those
names, and that every SEAMS entry is used there. ``_train_schedule``, ``_inference_schedule``,
``_loss_stage_global_rank`` and ``_configure_python_gc`` appeared in 0.19.8, hence the floor.

Importing this module does not import DeepSpeed; :func:`check_deepspeed_version` and
:func:`missing_seams` do when called.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

SUPPORTED_DEEPSPEED = ((0, 19, 8), (0, 20, 0))  # [0.19.8, 0.20)
REQUIREMENT = "deepspeed>=0.19.8,<0.20"

# DeepSpeed module -> {class name, or "" for module-level names: the internals hippie-ds reaches}.
# A name is a method or class attribute, or an instance attribute the class sets (``self._x = ...``).
# Every one is used in hippie_ds/adapter/ds/ and nowhere else (tests/compat/test_seams.py).
SEAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "deepspeed.runtime.engine": {
        "DeepSpeedEngine": (
            "_backward_epilogue",
            "_config",
            "_configure_python_gc",
            "_get_all_ckpt_names",
            "_get_ckpt_name",
            "_running_engine_backward",
            "_take_model_step",
            "torch_autocast_z0_gradscaler",
        ),
    },
    "deepspeed.runtime.pipe.engine": {
        # DeepSpeed's own handlers the stage runtime runs (ds/stage.py), the pipe buffers, the instruction map
        "PipelineEngine": (
            "_INSTRUCTION_MAP",
            "_allocate_or_extend_buffers",
            "_exec_backward_pass",
            "_exec_forward_pass",
            "_exec_load_micro_batch",
            "_exec_optimizer_step",
            "_exec_recv_activations",
            "_exec_recv_grads",
            "_exec_reduce_grads",
            "_exec_reduce_tied_grads",
            "_exec_send_activations",
            "_exec_send_grads",
            "_force_grad_boundary",
            "_grad_layer_buf",
            "_reserve_pipe_buffers",
            "_send_tensor_meta",
            # one p2p boundary's state, kept per model chunk (ds.engine.P2P_STATE): public names,
            # internals all the same
            "first_output_send",
            "grad_layer",
            "grad_partition_grad_layer_meta_cache",
            "meta_buffer",
            "pipe_partition_grad_meta_cache",
            "pipe_partition_input_meta_cache",
            "pipe_partition_output_meta_cache",
            "pipe_recv_buf",
        ),
    },
    "deepspeed.runtime.pipe.module": {
        "PipelineModule": (
            "_layer_specs",
            "_local_start",
            "_local_stop",
            "_precompute_checkpointable_values",
            "_recursive_getattr",
            "_set_bounds",
            "_topo",
        ),
    },
    # the loss scale DeepSpeedEngine.backward applies (the split backward's input pass applies it alike)
    "deepspeed.runtime.base_optimizer": {"ZeROOptimizer": ("scale_if_loss",)},
    # fp16 under per-stage updates: the wrapper's scale update and flag check (fp16_stage.py)
    # pipedream's micro-batch updates: the unscale by 1 (ds.fp16.unscaled)
    "deepspeed.runtime.fp16.unfused_optimizer": {
        "FP16_UnfusedOptimizer": (
            "_update_scale",
            "fp16_groups",
            "fp32_groups",
            "loss_scale_config",
            "overflow_checker",
            "unscale_and_clip_grads",
        ),
        "": ("get_global_norm", "get_weight_norm"),
    },
    # fp16 with DeepSpeed's fused Adam (FP16_Optimizer): its scale update, flag check, flattened norm and flat
    # masters (ds/fp16.py); both wrappers' overflow checker (CheckOverflow)
    "deepspeed.runtime.fp16.fused_optimizer": {
        "FP16_Optimizer": (
            "_update_scale",
            "fp16_groups",
            "fp32_groups_flat",
            "loss_scale_config",
            "overflow_checker",
            "unscale_and_clip_grads",
        ),
        "": ("get_flattened_grad_norm",),
    },
    "deepspeed.runtime.utils": {"CheckOverflow": ("has_overflow",)},
    # the data-parallel group clip_grad_norm_ averages the norm over (layout_clip.py computes it as stock does)
    "deepspeed.utils.groups": {"": ("_get_data_parallel_group",)},
    "deepspeed.runtime.bf16_optimizer": {"BF16_Optimizer": ("_lazy_init_hp_params_optimizer_state", "_update_hp_grad")},
    # ZeRO-1's internals the per-stage step hands gradients through (public names, but internals all the same)
    "deepspeed.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer": (
            "_lazy_init_hp_params_optimizer_state",
            "_release_ipg_buffers",
            "all_grad_tensors",
            "averaged_gradients",
            "bit16_groups",
            "bit16_groups_flat",
            "first_offset",
            "get_all_grad_tensors",
            "get_flat_partition",
            "gradient_accumulation_dtype",
            "model_parallel_group",
            "model_parallel_rank",
            "model_parallel_world_size",
            "parallel_partitioned_bit16_groups",
            "params_in_partition",
            "partition_size",
            "real_dp_process_group",
            "single_partition_of_fp32_groups",
        ),
    },
}

# DeepSpeed's private methods hippie-ds's subclasses override by name (HippiePipelineEngine,
# hippie_ds.PipelineModule). Checked to exist like SEAMS; tests/compat/test_seams.py allows them outside
# adapter/ds only as a subclass's ``def``, its ``super().name(...)`` / ``self.name(...)``.
OVERRIDES: dict[str, dict[str, tuple[str, ...]]] = {
    "deepspeed.runtime.engine": {
        # the split backward's hook: no second division where the loss stage divided the loss itself
        "DeepSpeedEngine": ("_backward_prologue_per_tensor",),
    },
    "deepspeed.runtime.pipe.engine": {
        "PipelineEngine": (
            # the declared schedule and its loop (engine.py, delegating to the stage runtime)
            "_train_schedule",
            "_exec_schedule",
            # virtual stages (adapter/engine/chunks.py)
            "_inference_schedule",
            "_loss_stage_global_rank",
            "_next_batch",
        ),
    },
    # virtual stages and plans' boundaries (adapter/module/pipeline_module.py, chunks.py)
    "deepspeed.runtime.pipe.module": {"PipelineModule": ("_build", "_partition_layers")},
}

# Internals hippie-ds relies on without naming them: swapping ZeRO-1's cached model-parallel group
# (ds/zero.py's _stage_groups) redirects the reductions these methods make to the stage; DeepSpeed's
# checkpoint load overwrites every copy of a tied weight with the first holder's (adapter/checkpoint/in_flight.py
# puts each stage's own back). Checked to exist like SEAMS; tests/compat/test_seams.py checks that nothing
# names these.
RELIED_ON: dict[str, dict[str, tuple[str, ...]]] = {
    "deepspeed.runtime.zero.stage_1_and_2": {
        # (its has_overflow too; the name is CheckOverflow's in SEAMS, which ds/fp16.py swaps)
        "DeepSpeedZeroOptimizer": ("check_grad_overflow", "compute_grad_norm", "scaled_global_norm"),
    },
    "deepspeed.runtime.pipe.module": {"PipelineModule": ("_synchronize_tied_weights",)},
    # the optimizer path DeepSpeed picks for a config, which precision.optimizer_path repeats
    "deepspeed.runtime.engine": {"DeepSpeedEngine": ("_do_optimizer_sanity_check",)},
}


def _parse(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ImportError(f"hippie-ds cannot parse the DeepSpeed version {version!r}; it needs {REQUIREMENT}")
    return tuple(int(x or 0) for x in match.groups())


def _shown(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


def check_deepspeed_version(version: str | None = None) -> None:
    """ImportError naming the version found and the supported range when DeepSpeed is outside it."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    lo, hi = SUPPORTED_DEEPSPEED
    if not lo <= _parse(version) < hi:
        raise ImportError(
            f"hippie-ds supports DeepSpeed >= {_shown(lo)}, < {_shown(hi)} (it subclasses "
            f"PipelineEngine internals that exist only there: hippie_ds/_compat.py lists them); "
            f"found DeepSpeed {version}. Install '{REQUIREMENT}'."
        )


@functools.cache
def _file_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _defines(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    # an instance attribute: assigned in the source file of the class or a base. A plain text search
    # of the file: every rank checks at import, and inspect.getsource's tokenizing of DeepSpeed's
    # classes cost each process seconds
    try:
        files = {inspect.getsourcefile(c) for c in inspect.getmro(owner) if c.__module__.startswith("deepspeed")}
    except TypeError:
        return False
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")
    return any(f is not None and pattern.search(_file_text(f)) for f in files)


def missing_seams() -> list[str]:
    """The names of :data:`SEAMS`, :data:`OVERRIDES` and :data:`RELIED_ON` the installed DeepSpeed lacks,
    as ``module.Class.name``."""
    missing = []
    for module_name, owners in [*SEAMS.items(), *OVERRIDES.items(), *RELIED_ON.items()]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for owner_name, names in owners.items():
            owner = getattr(module, owner_name, None) if owner_name else module
            if owner is None:
                missing.append(f"{module_name}.{owner_name}")
                continue
            missing += [
                f"{module_name}.{owner_name + '.' if owner_name else ''}{n}" for n in names if not _defines(owner, n)
            ]
    return missing


@functools.cache  # engine.py and integration.py both check at import: read DeepSpeed's sources once
def check_deepspeed() -> None:
    """At import of the adapter: the installed DeepSpeed is in the range and has every seam."""
    check_deepspeed_version()
    missing = missing_seams()
    if missing:
        import deepspeed

        raise ImportError(
            f"hippie-ds needs DeepSpeed internals that DeepSpeed {deepspeed.__version__} lacks: "
            f"{', '.join(missing)}; install '{REQUIREMENT}'"
        )
