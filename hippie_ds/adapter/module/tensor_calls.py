"""Calls on tensors that user code owns (parameters, activations, gradients), made through torch's class.

Model code sets plain attributes on its parameters, and an instance attribute hides the tensor
method of the same name: Megatron's ``ColumnParallelLinear`` sets ``bias.stride = stride`` (an int),
so ``bias.stride()`` raises ``TypeError: 'int' object is not callable``. Every call hippie-ds makes
on a tensor it did not create goes through ``torch.Tensor`` (``torch.Tensor.stride(t)``), which no
instance attribute hides; ``tests/test_user_tensor_attributes.py`` checks the sweep over the package.
"""
from __future__ import annotations

from typing import Iterable

import torch


def numel(tensors: Iterable[torch.Tensor]) -> int:
    """Elements in ``tensors``."""
    return sum(torch.Tensor.numel(t) for t in tensors)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``' elements (not of their storages)."""
    return sum(torch.Tensor.numel(t) * torch.Tensor.element_size(t) for t in tensors)
