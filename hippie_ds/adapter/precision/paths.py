"""Which precision and ZeRO configurations each schedule runs, decided before any process group.

DeepSpeed 0.19 picks the optimizer wrapper from the config alone
(``DeepSpeedEngine._do_optimizer_sanity_check``); :func:`optimizer_path` repeats that choice:

=========  ==========================================================================  ==============
path       config                                                                      wrapper
=========  ==========================================================================  ==============
fp32       no ``bf16``/``fp16``, ZeRO stage 0                                          the torch one
bf16       ``bf16``; ZeRO 0, or ZeRO 1 with ``data_types.grad_accum_dtype: fp32``      BF16_Optimizer
zero       ZeRO 1 otherwise (fp32, or bf16 accumulated in bf16)                        DeepSpeedZeroOptimizer
fp16       ``fp16``                                                                    FP16_Optimizer / ZeRO
=========  ==========================================================================  ==============

Schedules made only of DeepSpeed's own gradient ops (backward, ``reduce_grads``,
``optimizer_step``: 1f1b, gpipe) run on every path, as stock DeepSpeed does. The others reduce,
buffer or apply gradients themselves (:mod:`hippie_ds.adapter.gradients.store`), which hippie-ds does on
the fp32, bf16 and zero paths:

=========  ====================================  ===========================================================
path       where a stage's gradients live        what hippie-ds hands the wrapper's step
=========  ====================================  ===========================================================
fp32       ``.grad``                             the all-reduced ``.grad``; a per-stage norm
bf16       BF16_Optimizer's flat accumulator     the all-reduced accumulator; a per-stage norm
zero       ``.grad`` (ZeRO-1 leaves it there)    its partition of the all-reduced ``.grad`` (ds/zero.py);
                                                 its norm and overflow reductions over the stage
=========  ====================================  ===========================================================

BF16_Optimizer keeps fp32 master weights and optimizer state partitioned over the stage's
data-parallel group (ZeRO-1) and a whole gradient accumulator on every rank, so hippie-ds's early
and deferred all-reduces act on that accumulator, as DeepSpeed's own pipeline reduction does.
DeepSpeedZeroOptimizer (stage 1) keeps each backward's gradients on ``.grad`` until its own reduce,
which hippie-ds does not call: it all-reduces ``.grad`` at its rule's time and, at a stage's step,
hands ZeRO that stage's partition of it (what ZeRO's reduce would have built) and points ZeRO's
norm at the stage instead of the pipeline; ZeRO then clips, steps its partition (fp32 master
weights and optimizer state: 1/dp per rank) and all-gathers the stage's parameters. The refusals,
with their reasons:

- ``zero`` path with ``overlap_comm``, an offloaded optimizer, an accumulation dtype other than the
  model's, or ZeRO stage 2 or 3: ZeRO reduces gradients inside its own machinery (hooks during the
  backward, ``grad_accum`` copies, CPU buffers), where an all-reduce or a per-stage step outside it
  would be repeated, lost or hang. A split backward alone (``zb-h1``) also runs with an offloaded
  optimizer (fp32 accumulation of an fp32 model).
- ``fp16``: DeepSpeed's own gradient ops run as stock (1f1b, gpipe, interleaved-1f1b), and so does a
  split backward (zb-h1, zb-v: gradients on ``.grad``, its input pass scales the loss as
  ``DeepSpeedEngine.backward`` does), with ZeRO stage 0 or stage 1 as written. Per-stage updates
  need one pipeline-wide overflow decision per update (the dynamic loss scale skips an update when
  any stage overflows): the hippie family votes in its step op (fp16_stage.py; ZeRO stage 0 or
  stage 1 as written); 2bw and pipedream, whose stages update before stage 0 has run the
  update's last backward, vote asynchronously and apply an update once decided (fp16_async.py;
  ZeRO stage 0 or stage 1 as written, and only where
  :func:`~hippie_ds.adapter.precision.fp16_async.vote_problem` finds every wait after the votes it waits for:
  2bw at every shape, pipedream at 2 stages). The rest is refused (docs/precision.md).
"""

from __future__ import annotations

from ...config import ConfigError
from ...schedules import builtins_where
from ...schedules.ir import SPLIT_BACKWARD_KINDS, CompiledSchedule, OpKind, kinds

# ops whose handlers read or write gradients outside DeepSpeed's backward / reduce_grads / step (OP_INFO's
# own_gradients); SPLIT_BACKWARD_KINDS: backward_input and backward_weight (ir.py)
OWN_GRADIENT_KINDS = kinds(own_gradients=True)
PATHS = ("fp32", "bf16", "zero", "fp16")


def _fp32_accumulation(config_class) -> bool:
    from ..ds.runtime import DtypeEnum
    import torch

    dtype = config_class.grad_accum_dtype
    return dtype is not None and DtypeEnum(dtype).value == torch.float32


def _offloads_optimizer(config_class) -> bool:
    offload = config_class.zero_config.offload_optimizer
    return offload is not None and str(getattr(offload.device, "value", offload.device)) != "none"


def _grads_on_params(config_class) -> bool:
    """DeepSpeedZeroOptimizer stage 1 leaves a backward's gradients on the parameters' ``.grad``
    until DeepSpeed's own ``reduce_grads`` (no ``overlap_comm`` hooks reducing them during the
    backward, no separate accumulation dtype): a split backward's weight pass may add to them."""
    import torch
    from ..ds.runtime import DtypeEnum

    model = (
        torch.bfloat16
        if config_class.bfloat16_config.enabled
        else torch.float16
        if config_class.float16_config.enabled
        else torch.float32
    )
    accumulation = config_class.grad_accum_dtype
    separate = accumulation is not None and DtypeEnum(accumulation).value != model
    return config_class.zero_optimization_stage == 1 and not config_class.zero_config.overlap_comm and not separate


def optimizer_path(config_class) -> str:
    """The optimizer path (:data:`PATHS`) DeepSpeed takes for this config."""
    if config_class.float16_config.enabled:
        return "fp16"
    zero = config_class.zero_optimization_stage
    if config_class.bfloat16_config.enabled:
        if zero == 0 or (zero == 1 and _fp32_accumulation(config_class) and not _offloads_optimizer(config_class)):
            return "bf16"
        return "zero"
    return "zero" if zero > 0 else "fp32"


def own_gradient_ops(compiled: CompiledSchedule) -> set[OpKind]:
    """The op kinds of ``compiled`` that handle gradients outside DeepSpeed's own path."""
    return {op.kind for s in range(compiled.stages) for op in compiled.ops(s)} & OWN_GRADIENT_KINDS


def _config_key(config_class, path: str) -> str:
    if path == "fp16":
        return '"fp16.enabled" = true'
    if config_class.bfloat16_config.enabled:
        return (
            f'"zero_optimization.stage" = {config_class.zero_optimization_stage} with '
            f'"data_types.grad_accum_dtype" = {config_class.grad_accum_dtype!r}'
            f'{" and optimizer offload" if _offloads_optimizer(config_class) else ""}'
        )
    return f'"zero_optimization.stage" = {config_class.zero_optimization_stage} without bf16'


def _on_model(chunks: tuple[int, str] | None) -> str:
    if chunks is None:
        return ""
    return " and this module" + (
        f" ({chunks[0]} model chunks per stage, {chunks[1]} layout)"
        if chunks[0] > 1
        else " (one model chunk per stage)"
    )


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "none (1f1b and gpipe run on a module with one model chunk per stage)"


def check_precision(compiled: CompiledSchedule, config_class, chunks: tuple[int, str] | None = None) -> None:
    """Raise :class:`ConfigError` (one line: the key, the value, what is allowed) when
    ``compiled`` cannot run on the optimizer path the config selects. ``chunks``: (model chunks per
    stage, layout) the module holds; the schedules named as allowed are those that run on it."""
    from .fp16_async import vote_problem

    path = optimizer_path(config_class)
    own = own_gradient_ops(compiled)
    if path in ("fp32", "bf16") or not own:
        return
    if (
        path == "zero"
        and _grads_on_params(config_class)
        and (own <= SPLIT_BACKWARD_KINDS or not _offloads_optimizer(config_class))
    ):
        return  # ZeRO-1 with gradients on .grad: hippie-ds reduces them, hands ZeRO its partition (ds/zero.py)
    if (
        path == "fp16"
        and own <= SPLIT_BACKWARD_KINDS
        and (config_class.zero_optimization_stage == 0 or _grads_on_params(config_class))
    ):
        return  # a split backward: gradients on .grad, the loss scaled as DeepSpeed's backward scales it
    if (
        path == "fp16"
        and not compiled.continuous
        and (config_class.zero_optimization_stage == 0 or _grads_on_params(config_class))
    ):
        return  # per-stage updates with one pipeline-wide overflow decision per update (fp16_stage.py)
    if (
        path == "fp16"
        and compiled.continuous
        and (config_class.zero_optimization_stage == 0 or _grads_on_params(config_class))
        and vote_problem(compiled) is None
    ):
        return  # never flushing: one decision per update, voted asynchronously (fp16_async.py)
    ops = ", ".join(sorted(k.value for k in own))
    allowed = _listed(
        builtins_where(lambda c: not own_gradient_ops(c), compiled.stages, compiled.micro_batches, chunks)
    )
    key = _config_key(config_class, path)
    if path == "zero":
        splits = _grads_on_params(config_class)
        allowed = _listed(
            builtins_where(
                lambda c: own_gradient_ops(c) <= (SPLIT_BACKWARD_KINDS if splits else frozenset()),
                compiled.stages,
                compiled.micro_batches,
                chunks,
            )
        )
        raise ConfigError(
            f"config key {key}: schedule {compiled.name!r} handles gradients itself ({ops}); "
            "DeepSpeedZeroOptimizer, which DeepSpeed picks here, reduces gradients and their norm over "
            "the whole pipeline inside its own step (ZeRO stage 2 or 3, overlap_comm, an offloaded "
            "optimizer or a separate accumulation dtype), so a stage cannot all-reduce, defer or update "
            "apart from the others. hippie-ds does that with ZeRO stage 1 without those, or through "
            "DeepSpeed's BF16_Optimizer: set "
            '"bf16": {"enabled": true} and "data_types": {"grad_accum_dtype": "fp32"} (fp32 master '
            "weights and optimizer state partitioned over the data-parallel group), or use ZeRO stage 0; "
            f"schedules that run on this configuration{_on_model(chunks)}: {allowed}"
        )
    zero = config_class.zero_optimization_stage
    allowed = _listed(
        builtins_where(
            lambda c: (
                own_gradient_ops(c) <= SPLIT_BACKWARD_KINDS
                or ((zero == 0 or _grads_on_params(config_class)) and not c.continuous)
                or ((zero == 0 or _grads_on_params(config_class)) and c.continuous and vote_problem(c) is None)
            ),
            compiled.stages,
            compiled.micro_batches,
            chunks,
        )
    )
    if own <= SPLIT_BACKWARD_KINDS:
        reason = (
            "ZeRO reduces the gradients inside its own machinery here (stage 2 or 3, overlap_comm, an "
            "offloaded optimizer or a separate accumulation dtype)"
        )
    elif compiled.continuous and zero != 0 and not _grads_on_params(config_class):
        reason = (
            "the asynchronous overflow vote of the schedules that never flush is built on ZeRO stage 0 and "
            "on ZeRO stage 1 without overlap_comm, an offload or a separate accumulation dtype"
        )
    elif compiled.continuous:
        reason = (
            f"the asynchronous overflow vote cannot be waited for in time: {vote_problem(compiled)} "
            "(hippie_ds/adapter/precision/fp16_async.py)"
        )
    else:
        reason = (
            "the pipeline-wide overflow vote of per-stage updates is built on ZeRO stage 0 and on ZeRO stage 1 "
            "without overlap_comm, an offload or a separate accumulation dtype"
        )
    raise ConfigError(
        f"config key {key}: schedule {compiled.name!r} ({ops}) is not supported with fp16: {reason}; "
        f"use bf16, or a schedule that runs with fp16{_on_model(chunks)}: {allowed}"
    )
