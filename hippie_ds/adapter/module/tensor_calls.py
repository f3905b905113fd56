"""Calls on tensors that user code owns (parameters, activations, gradients), made through torch's class.
And `flat_copy`, a flat copy of tensors (the gradient buffer, weight versions, held fp16 updates).

Model code sets plain attributes on its parameters, and an instance attribute hides the tensor
method of the same name: Megatron's ``ColumnParallelLinear`` sets ``bias.stride = stride`` (an int),
so ``bias.stride()`` raises ``TypeError: 'int' object is not callable``. Every call hippie-ds makes
on a tensor it did not create goes through ``torch.Tensor`` (``torch.Tensor.stride(t)``), which no
instance attribute hides; ``tests/adapter/module/test_user_tensor_attributes.py`` checks the sweep over the package.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch._utils import _flatten_dense_tensors


def numel(tensors: Iterable[torch.Tensor]) -> int:
    """Elements in ``tensors``."""
    return sum(torch.Tensor.numel(t) for t in tensors)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``' elements (not of their storages)."""
    return sum(torch.Tensor.numel(t) * torch.Tensor.element_size(t) for t in tensors)


def flat_copy(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding a copy of ``tensors``. torch's ``_flatten_dense_tensors`` returns a
    view of a lone tensor, not a copy: a buffer or a saved version made of one parameter (a
    bias-free embedding delayed alone) would change with it. No tensors: an empty one (a deferred
    stage without parameters)."""
    if not tensors:
        return torch.empty(0)
    flat = _flatten_dense_tensors(tensors)
    return flat.clone() if len(tensors) == 1 else flat
