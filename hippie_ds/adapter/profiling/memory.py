"""Activation memory as the bytes actually held for backward, measured with saved-tensor hooks.

:class:`ActivationMeter` counts every tensor autograd saves for backward while it is active
(``torch.autograd.graph.saved_tensors_hooks``), plus tensors registered with :meth:`hold` (a
pipeline stage's input and output, which DeepSpeed keeps in its pipe buffers until the
backward). A storage is counted once however many tensors or views refer to it, from the
first reference until the last is released (the autograd graph frees saved tensors after the
backward; a held tensor is released when it is garbage collected). ``peak`` is the largest sum
seen. Parameters (and views of them) that autograd saves are not activations: storages
registered with :meth:`ignore` (``ActivationMeter(module)`` ignores the module's parameters)
are skipped. Works on any device; it does not see memory that is not a saved or held tensor
(gradients, optimizer state, temporaries).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    s = torch.Tensor.untyped_storage(t)
    return (str(t.device), s.data_ptr(), s.nbytes())


class _Saved:
    """What the pack hook returns: keeps the tensor and releases its storage when freed."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Context manager: ``with meter:`` counts saved tensors; ``meter.hold(x)`` counts ``x``
    until it is garbage collected. ``current`` / ``peak`` are bytes."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self._refs: dict[tuple, int] = {}
        self._ignored: set[tuple] = set()
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        if module is not None:
            self.ignore(module.parameters())

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Do not count these tensors' storages (parameters)."""
        self._ignored.update(storage_key(t) for t in tensors)

    # -- counting -------------------------------------------------------------------------------
    def _acquire(self, t: torch.Tensor) -> tuple:
        key = storage_key(t)
        n = self._refs.get(key, 0)
        if n == 0:
            self.current += key[2]
            self.peak = max(self.peak, self.current)
        self._refs[key] = n + 1
        return key

    def _release(self, key: tuple) -> None:
        n = self._refs.get(key, 0)
        if n <= 1:
            if n == 1:
                del self._refs[key]
                self.current -= key[2]
        else:
            self._refs[key] = n - 1

    def _pack(self, tensor: torch.Tensor):
        if tensor.layout != torch.strided or tensor.device.type == "meta" or storage_key(tensor) in self._ignored:
            return tensor
        # Keep a detached alias: a node that saves its own output would otherwise hold, through
        # this Python object, a tensor whose grad_fn is the node: a cycle through C++ that Python's
        # collector cannot see, so a graph that is dropped without a backward (retain_graph, the
        # split backward's I) would never be freed.
        return _Saved(torch.Tensor.detach(tensor), self, self._acquire(tensor))

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def hold(self, obj: Any) -> None:
        """Count the tensors in ``obj`` (a tensor or nested tuple/list/dict) while they live."""
        for t in _tensors(obj):
            if t.layout == torch.strided and t.device.type != "meta" and storage_key(t) not in self._ignored:
                weakref.finalize(t, self._release, self._acquire(t))

    def reset_peak(self) -> None:
        self.peak = self.current

    # -- context ----------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def hold_stage_io(module: torch.nn.Module, meter: ActivationMeter):
    """Count a pipeline stage's input and output (held by DeepSpeed until the backward) in
    ``meter``: a forward hook on the stage's module. Returns the hook handle."""

    def hook(_module, inputs, output):
        meter.hold(inputs)
        meter.hold(output)

    return module.register_forward_hook(hook)
