"""Per-stage steps on DeepSpeed's ZeRO-1 optimizer (``DeepSpeedZeroOptimizer``, stage 1): what
DeepSpeed picks for ``"zero_optimization": {"stage": 1}`` in fp32, or with ``bf16`` and no
``data_types.grad_accum_dtype`` (:mod:`hippie_ds.adapter.precision.paths`'s ``zero`` path).

ZeRO-1 keeps a backward's gradients on the parameters' ``.grad`` (in the model dtype) until its own
reduce (``reduce_gradients``, from DeepSpeed's ``reduce_grads``), which averages them over the
data-parallel group and builds each rank's flat partition of them (``averaged_gradients``); its
``step`` reduces the gradient norm over the data-parallel group (the partitions) and the
model-parallel group cached at construction (the pipe grid's: the whole pipeline), clips, steps the
rank's fp32 partition (master weights and optimizer state: 1/dp of them per rank) and all-gathers
the updated parameters over the stage's data-parallel group.

Schedules that handle gradients themselves keep ``.grad`` as the gradient store (as fp32 does,
:mod:`hippie_ds.adapter.gradients.store`): hippie-ds all-reduces it at the rule's time (early, deferred,
buffered) and never calls ZeRO's reduce. At the per-stage step, :func:`stage_step` hands ZeRO the
reduced ``.grad`` as its partition (what its reduce's epilogue builds, without a second average)
and makes its norm and overflow reductions run over the stage (or its tie group) instead of the
pipeline. A flat partition cannot skip a parameter: one without a gradient takes a zero one (as
under BF16_Optimizer: AdamW still decays it and counts the step).

Also DeepSpeed's other optimizer wrappers' internals the gradient store reaches (``BF16_Optimizer``'s
accumulator, ``DeepSpeedOptimizer``), each a named operation. Part of :mod:`hippie_ds.adapter.ds`:
the one package that reaches DeepSpeed's internals.
"""

from __future__ import annotations

import contextlib

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["BF16_Optimizer", "DeepSpeedOptimizer", "DeepSpeedZeroOptimizer", "ZeroUnmoved", "is_zero", "stage_step"]


def is_zero(optimizer) -> bool:
    """True for DeepSpeed's ZeRO stage 1/2 optimizer (hippie-ds runs stage 1 only, precision/paths.py)."""
    return isinstance(optimizer, DeepSpeedZeroOptimizer)


@contextlib.contextmanager
def _stage_groups(optimizer, mpu):
    """ZeRO's norm and overflow all-reduces over ``mpu``'s model-parallel group (the stage's, or
    its tie group) instead of the one cached at construction (the pipeline)."""
    saved = optimizer.model_parallel_group, optimizer.model_parallel_world_size, optimizer.model_parallel_rank
    optimizer.model_parallel_group = mpu.get_model_parallel_group()
    optimizer.model_parallel_world_size = mpu.get_model_parallel_world_size()
    optimizer.model_parallel_rank = mpu.get_model_parallel_rank()
    try:
        yield
    finally:
        optimizer.model_parallel_group, optimizer.model_parallel_world_size, optimizer.model_parallel_rank = saved


@torch.no_grad()
def _hand_gradients(optimizer) -> None:
    """Each group's partition of the (already reduced) ``.grad``, as ZeRO's own reduce epilogue
    builds it (``get_flat_partition``), for ``step`` to read; a missing gradient reads as zeros."""
    device = get_accelerator().current_device_name()
    for i in range(len(optimizer.bit16_groups)):
        params = optimizer.params_in_partition[i]
        optimizer.all_grad_tensors[i] = optimizer.get_all_grad_tensors(
            params, dtype=optimizer.gradient_accumulation_dtype
        )
        optimizer.averaged_gradients[i] = optimizer.get_flat_partition(
            params,
            optimizer.first_offset[i],
            optimizer.partition_size[i],
            dtype=optimizer.gradient_accumulation_dtype,
            device=device,
            param_group_idx=i,
            return_tensor_list=True,
        )
        optimizer.all_grad_tensors[i] = None
    # as the reduce epilogue ends: the reduce bucket its backward hooks allocated (reduce_bucket_size
    # elements, 2 GB in fp32 by default) is let go; kept, every rank would hold it between steps
    optimizer._release_ipg_buffers()


@contextlib.contextmanager
def stage_step(optimizer, mpu):
    """Around DeepSpeed's ``_take_model_step`` of one stage: on ZeRO-1, its partition of the
    reduced ``.grad`` handed over and its reductions over ``mpu``; nothing otherwise."""
    if not is_zero(optimizer):
        yield
        return
    _hand_gradients(optimizer)
    with _stage_groups(optimizer, mpu):
        yield


class ZeroUnmoved:
    """Around a ZeRO-1 step that has nothing to apply to ``params`` (a deferred stage's ``drain()``:
    only the delayed layers' gradient is pending), the ZeRO counterpart of
    :class:`hippie_ds.adapter.gradients.store.Unmoved`: the flat fp32 partition cannot leave a parameter
    out and a zero gradient still moves it (Adam's moments, weight decay), so ``params``' elements
    of this rank's fp32 partition and of its optimizer state, and the full model-dtype weights every
    rank holds, are put back after the step. Local to each rank: each restores the fragment it owns
    (no gather, so partitions that cut a parameter unevenly need nothing special). Adam's step
    count, one per flat group, still advances (as on BF16_Optimizer)."""

    def __init__(self, params: list[torch.Tensor], optimizer):
        from deepspeed import comm as dist

        ids = {id(p) for p in params}
        self.params, self.weights = params, [torch.Tensor.clone(torch.Tensor.detach(p)) for p in params]
        self.optimizer = optimizer
        self.saved = []  # (fp32 partition, mask over it, {state key or None (the partition): saved values})
        for i, group in enumerate(optimizer.bit16_groups):
            chosen = [p for p in group if id(p) in ids]
            if not chosen:
                continue
            flat = optimizer.bit16_groups_flat[i]
            part = optimizer.parallel_partitioned_bit16_groups[i][
                dist.get_rank(group=optimizer.real_dp_process_group[i])
            ]
            lo, n = part.storage_offset() - flat.storage_offset(), part.numel()
            mask = torch.zeros(n, dtype=torch.bool, device=flat.device)
            for p in chosen:
                if p.data.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                    raise RuntimeError(
                        "hippie-ds: a ZeRO-1 parameter is not a view of its group's flat buffer "
                        "(DeepSpeedZeroOptimizer changed: see hippie_ds/_compat.py)"
                    )
                start = p.data.storage_offset() - flat.storage_offset()
                a, b = max(start, lo), min(start + torch.Tensor.numel(p), lo + n)
                if a < b:
                    mask[a - lo : b - lo] = True
            if mask.any():
                fp32 = optimizer.single_partition_of_fp32_groups[i]
                self.saved.append((fp32, mask, {key: t[mask].clone() for key, t in self._tensors(fp32).items()}))

    def _tensors(self, fp32) -> dict:
        """The fp32 partition (key None) and its optimizer state tensors of the same shape."""
        state = self.optimizer.optimizer.state.get(fp32, {})
        return {None: fp32, **{k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == fp32.shape}}

    @torch.no_grad()
    def restore(self) -> None:
        for p, w in zip(self.params, self.weights):
            torch.Tensor.copy_(p, w)
        for fp32, mask, values in self.saved:
            for key, t in self._tensors(fp32).items():
                # state created by this very step (none before): zero for the parameters it did not concern
                t[mask] = values[key] if key in values else 0


def dp_group_of(optimizer, i: int):
    """Roughly: ``optimizer.real_dp_process_group[i]`` (the data-parallel group of parameter group ``i``'s
    partitions)."""
    return optimizer.real_dp_process_group[i]


def accumulate_hp_grad(optimizer, param, i: int, j: int, clear_lp_grads: bool) -> None:
    """Roughly: ``BF16_Optimizer._update_hp_grad(param, i, j, clear_lp_grads)`` (``param``'s bf16
    gradient added into its fp32 accumulator slot, group ``i`` index ``j``)."""
    optimizer._update_hp_grad(param, i, j, clear_lp_grads=clear_lp_grads)


def link_optimizer_state(optimizer) -> None:
    """Roughly: ``optimizer._lazy_init_hp_params_optimizer_state()`` where it has one (BF16_Optimizer,
    ZeRO-1: the moments' fragments linked to the parameters, done at the first step otherwise)."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
