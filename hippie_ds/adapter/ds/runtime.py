"""``deepspeed.runtime``'s configuration and utilities hippie-ds calls, re-exported or as named
operations (roughly: what each does in DeepSpeed's own terms): the config classes, the gradient-norm
helpers, the data-parallel group the stock clip averages over."""

from __future__ import annotations

from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum
from deepspeed.runtime.utils import (
    clip_grad_norm_,
    clip_tensors_by_global_norm,
    get_global_norm_of_tensors,
    is_model_parallel_parameter,
)

__all__ = [
    "DeepSpeedConfig",
    "DtypeEnum",
    "clip_grad_norm_",
    "clip_tensors_by_global_norm",
    "get_global_norm_of_tensors",
    "is_model_parallel_parameter",
    "data_parallel_group",
    "torch_optimizer",
]


def data_parallel_group():
    """Roughly: ``deepspeed.utils.groups._get_data_parallel_group()`` (the group ``clip_grad_norm_``
    averages the norm over)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_group()


def torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` that steps the fp32 values: ``optimizer`` itself (fp32 without
    ZeRO), or the one DeepSpeed's wrapper holds as ``.optimizer`` (FP16_Optimizer,
    FP16_UnfusedOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer: their fp32 masters, flat and
    partitioned over the data-parallel group under ZeRO). None when neither is one."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def warmup_decay_lr(optimizer, **kwargs):
    """Roughly: ``deepspeed.runtime.lr_schedules.WarmupDecayLR(optimizer, **kwargs)`` (the config's
    ``"scheduler": {"type": "WarmupDecayLR"}``), for tools that train without an engine."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    return WarmupDecayLR(optimizer, **kwargs)


def muon_with_aux_adam(groups, **kwargs):
    """Roughly: ``deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam(groups, **kwargs)`` (the
    config's ``"optimizer": {"type": "Muon"}``), for tools that train without an engine."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    return MuonWithAuxAdam(groups, **kwargs)
