"""``deepspeed.runtime``'s configuration and utilities hippie-ds calls, re-exported or as named
operations (roughly: what each does in DeepSpeed's own terms): the config classes, the gradient-norm
helpers, the data-parallel group the stock clip averages over."""
from __future__ import annotations

from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum
from deepspeed.runtime.utils import (clip_grad_norm_, clip_tensors_by_global_norm, get_global_norm_of_tensors,
                                     is_model_parallel_parameter)

__all__ = ["DeepSpeedConfig", "DtypeEnum", "clip_grad_norm_", "clip_tensors_by_global_norm",
           "get_global_norm_of_tensors", "is_model_parallel_parameter", "data_parallel_group"]


def data_parallel_group():
    """Roughly: ``deepspeed.utils.groups._get_data_parallel_group()`` (the group ``clip_grad_norm_``
    averages the norm over)."""
    from deepspeed.utils import groups
    return groups._get_data_parallel_group()
