"""DeepSpeed's fp16 wrappers without ZeRO reached by name: ``FP16_UnfusedOptimizer`` (a torch
optimizer) and ``FP16_Optimizer`` (DeepSpeed's fused Adam, ``"optimizer": {"type": "Adam"}``); the
internals fp16 per-stage steps (:mod:`hippie_ds.adapter.precision.fp16_stage`) read or swap, each as a named
operation (roughly: what it does in DeepSpeed's own terms)."""

from __future__ import annotations

import contextlib

import torch

import deepspeed.runtime.fp16.fused_optimizer as fused
import deepspeed.runtime.fp16.unfused_optimizer as unfused
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

__all__ = [
    "FP16_UnfusedOptimizer",
    "FP16_Optimizer",
    "is_unfused",
    "is_fused",
    "decided",
    "update_scale",
    "scale_moves",
    "unscaled",
    "masters",
    "FusedUnmoved",
    "set_step_applied",
]


def is_unfused(optimizer) -> bool:
    """Roughly: ``isinstance(optimizer, FP16_UnfusedOptimizer)``."""
    return isinstance(optimizer, FP16_UnfusedOptimizer)


def is_fused(optimizer) -> bool:
    """Roughly: ``isinstance(optimizer, FP16_Optimizer)`` (fp32 masters flat per parameter group)."""
    return isinstance(optimizer, FP16_Optimizer)


@contextlib.contextmanager
def decided(optimizer, overflow: bool, joint: float | None = None):
    """Inside: the wrapper's step takes ``overflow`` and (with ``joint``) that gradient norm as given.
    Roughly: FP16_UnfusedOptimizer: ``optimizer.overflow_checker.check`` answers ``overflow``; with
    ``joint``, ``unfused_optimizer.get_weight_norm`` answers 0 and ``get_global_norm`` answers ``joint``.
    FP16_Optimizer: ``optimizer.overflow_checker.has_overflow`` answers ``overflow``; with ``joint``,
    ``fused_optimizer.get_flattened_grad_norm`` answers ``joint`` (its ``get_global_norm`` of that one
    norm is itself). All put back after."""
    checker = optimizer.overflow_checker
    check, has_overflow = checker.check, checker.has_overflow
    weight_norm, global_norm = unfused.get_weight_norm, unfused.get_global_norm
    flattened = fused.get_flattened_grad_norm
    checker.check = lambda *args, **kwargs: overflow
    checker.has_overflow = lambda *args, **kwargs: overflow
    if joint is not None:
        unfused.get_weight_norm = lambda *args, **kwargs: 0.0
        unfused.get_global_norm = lambda *args, **kwargs: joint
        fused.get_flattened_grad_norm = lambda *args, **kwargs: joint
    try:
        yield
    finally:
        checker.check, checker.has_overflow = check, has_overflow
        unfused.get_weight_norm, unfused.get_global_norm = weight_norm, global_norm
        fused.get_flattened_grad_norm = flattened


def set_step_applied(engine, applied: bool) -> None:
    """Roughly: ``engine._step_applied = applied`` (what ``engine.was_step_applied()`` answers until the
    next step sets it)."""
    engine._step_applied = applied


def update_scale(optimizer, overflow: bool) -> None:
    """Roughly: ``optimizer._update_scale(overflow)`` (the dynamic loss scale moves as after a step)."""
    optimizer._update_scale(overflow)


@contextlib.contextmanager
def _replaced(obj, name: str, replacement):
    """Inside: ``obj.name`` is ``replacement`` on the instance; afterwards the instance's own attribute
    comes back, or the class's shows through again."""
    own = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def scale_moves(optimizer, moved: bool | None):
    """Inside: the wrapper's step moves its dynamic loss scale (and the scaler's iteration count) as
    after a step whose overflow flag is ``moved``, whatever flag it has itself; None: not at all.
    Roughly: ``optimizer._update_scale`` (FP16_UnfusedOptimizer, FP16_Optimizer, ZeRO's) replaced
    on the instance by a call with ``moved`` or by nothing; put back after."""
    original = optimizer._update_scale
    with _replaced(
        optimizer,
        "_update_scale",
        (lambda *args, **kwargs: None) if moved is None else (lambda *args, **kwargs: original(moved)),
    ):
        yield


@contextlib.contextmanager
def unscaled(optimizer):
    """Inside: the wrapper's step divides the gradients by 1, not by its loss scale (the clipping
    factor taken from their norm as it is), while the scale itself moves as the step moves it.
    Roughly: ``optimizer.unscale_and_clip_grads`` (FP16_UnfusedOptimizer, FP16_Optimizer) replaced on
    the instance by a call with ``optimizer.loss_scale_config.cur_scale`` 1.0, put back after it."""
    original = optimizer.unscale_and_clip_grads
    config = optimizer.loss_scale_config

    def by_one(*args, **kwargs):
        scale, config.cur_scale = config.cur_scale, 1.0
        try:
            return original(*args, **kwargs)
        finally:
            config.cur_scale = scale

    with _replaced(optimizer, "unscale_and_clip_grads", by_one):
        yield


def masters(optimizer) -> dict:
    """Roughly: ``{id(p): master}`` over ``zip(optimizer.fp16_groups, optimizer.fp32_groups)`` (each
    fp16 parameter's fp32 master weight; FP16_UnfusedOptimizer)."""
    return {id(p): m for lows, highs in zip(optimizer.fp16_groups, optimizer.fp32_groups) for p, m in zip(lows, highs)}


class FusedUnmoved:
    """Around an FP16_Optimizer step that has nothing to apply to ``params``: their fp16 weights, their
    slices of the flat fp32 master and of every optimizer-state tensor of the master's size (Adam's
    moments) put back after it (Adam's step count, one per flat group, still advances). Roughly:
    slices of ``optimizer.fp32_groups_flat[i]`` and ``optimizer.optimizer.state[...]`` at each
    parameter's offset in ``optimizer.fp16_groups[i]``."""

    def __init__(self, params: list[torch.Tensor], optimizer):
        where = {}
        for i, group in enumerate(optimizer.fp16_groups):
            offset = 0
            for p in group:
                where[id(p)] = (i, offset, torch.Tensor.numel(p))  # a user's parameter: through torch.Tensor
                offset += torch.Tensor.numel(p)
        self.saved = []
        for p in params:
            i, offset, n = where[id(p)]
            master = optimizer.fp32_groups_flat[i]
            state = optimizer.optimizer.state.get(master, {})
            tensors = [master] + [v for v in state.values() if torch.is_tensor(v) and v.numel() == master.numel()]
            self.saved.append(
                (
                    p,
                    torch.Tensor.clone(torch.Tensor.detach(p)),
                    [
                        (t, torch.Tensor.clone(torch.Tensor.narrow(torch.Tensor.detach(t), 0, offset, n)), offset, n)
                        for t in tensors
                    ],
                )
            )

    @torch.no_grad()
    def restore(self) -> None:
        for p, weight, slices in self.saved:
            torch.Tensor.copy_(p, weight)
            for t, value, offset, n in slices:
                torch.Tensor.copy_(torch.Tensor.narrow(t, 0, offset, n), value)
