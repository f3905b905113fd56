"""The DeepSpeed releases hippie-ds runs on, and the DeepSpeed internals ("seams") it relies on.

hippie-ds subclasses ``PipelineEngine`` and ``PipelineModule`` and reads or overrides private names of
DeepSpeed's engine, pipeline module, p2p module and bf16 optimizer. :data:`SEAMS` lists every one
of them, by the DeepSpeed module that defines it; the supported range is the releases where all of
them exist (``tests/test_seams.py`` checks the installed DeepSpeed against the list, and that the
adapter uses no other private DeepSpeed name). ``_train_schedule``, ``_inference_schedule``,
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

# DeepSpeed module -> {class name, or "" for module-level names: private names hippie-ds uses}.
# A name is a method or class attribute, or an instance attribute the class sets (``self._x = ...``).
SEAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "deepspeed.runtime.engine": {
        "DeepSpeedEngine": ("_backward_epilogue", "_backward_prologue_per_tensor", "_config",
                            "_configure_python_gc", "_do_optimizer_sanity_check", "_get_all_ckpt_names",
                            "_get_ckpt_name", "_running_engine_backward", "_take_model_step",
                            "torch_autocast_z0_gradscaler"),
    },
    "deepspeed.runtime.pipe.engine": {
        "PipelineEngine": ("_INSTRUCTION_MAP", "_allocate_or_extend_buffers", "_exec_backward_pass", "_exec_forward_pass", "_exec_recv_activations",
                           "_exec_recv_grads", "_exec_send_activations", "_exec_send_grads", "_force_grad_boundary",
                           "_grad_layer_buf", "_inference_schedule", "_loss_stage_global_rank", "_next_batch",
                           "_reserve_pipe_buffers", "_send_tensor_meta", "_train_schedule"),
    },
    "deepspeed.runtime.pipe.module": {
        "PipelineModule": ("_build", "_layer_specs", "_local_start", "_local_stop", "_partition_layers",
                           "_precompute_checkpointable_values", "_recursive_getattr", "_set_bounds",
                           "_synchronize_tied_weights", "_topo", "_grid"),
    },
    "deepspeed.runtime.pipe.p2p": {"": ("_grid", "_groups")},
    # the loss scale DeepSpeedEngine.backward applies (the split backward's input pass applies it alike)
    "deepspeed.runtime.base_optimizer": {"ZeROOptimizer": ("scale_if_loss", )},
    # fp16 under per-stage updates: the wrapper's scale update and flag check (fp16_stage.py)
    "deepspeed.runtime.fp16.unfused_optimizer": {"FP16_UnfusedOptimizer": ("_update_scale", "fp16_groups", "fp32_groups",
                                                                           "overflow_checker"),
                                                 "": ("get_global_norm", "get_weight_norm")},
    # the data-parallel group clip_grad_norm_ averages the norm over (layout_clip.py computes it as stock does)
    "deepspeed.utils.groups": {"": ("_get_data_parallel_group", )},
    "deepspeed.runtime.bf16_optimizer": {"BF16_Optimizer": ("_lazy_init_hp_params_optimizer_state", "_update_hp_grad")},
    # ZeRO-1's internals the per-stage step hands gradients through (public names, but internals all the same)
    "deepspeed.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer": ("_lazy_init_hp_params_optimizer_state", "_release_ipg_buffers", "all_grad_tensors", "averaged_gradients", "bit16_groups",
                                   "bit16_groups_flat", "first_offset", "get_all_grad_tensors", "get_flat_partition",
                                   "gradient_accumulation_dtype", "model_parallel_group",
                                   "model_parallel_rank", "model_parallel_world_size", "parallel_partitioned_bit16_groups",
                                   "params_in_partition", "partition_size", "real_dp_process_group",
                                   "single_partition_of_fp32_groups"),
    },
}

# Internals hippie-ds relies on without naming them: swapping ZeRO-1's cached model-parallel group
# (zero_stage._stage_groups) redirects the reductions these methods make to the stage. Checked to
# exist like SEAMS; tests/test_seams.py checks that every SEAMS entry is used and these are not.
RELIED_ON: dict[str, dict[str, tuple[str, ...]]] = {
    "deepspeed.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer": ("check_grad_overflow", "compute_grad_norm", "has_overflow", "scaled_global_norm"),
    },
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
        raise ImportError(f"hippie-ds supports DeepSpeed >= {_shown(lo)}, < {_shown(hi)} (it subclasses "
                          f"PipelineEngine internals that exist only there: hippie_ds/_compat.py lists them); "
                          f"found DeepSpeed {version}. Install '{REQUIREMENT}'.")


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
    """The names of :data:`SEAMS` the installed DeepSpeed lacks, as ``module.Class.name``."""
    missing = []
    for module_name, owners in [*SEAMS.items(), *RELIED_ON.items()]:
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
            missing += [f"{module_name}.{owner_name + '.' if owner_name else ''}{n}" for n in names
                        if not _defines(owner, n)]
    return missing


@functools.cache  # engine.py and integration.py both check at import: read DeepSpeed's sources once
def check_deepspeed() -> None:
    """At import of the adapter: the installed DeepSpeed is in the range and has every seam."""
    check_deepspeed_version()
    missing = missing_seams()
    if missing:
        import deepspeed
        raise ImportError(f"hippie-ds needs DeepSpeed internals that DeepSpeed {deepspeed.__version__} lacks: "
                          f"{', '.join(missing)}; install '{REQUIREMENT}'")
