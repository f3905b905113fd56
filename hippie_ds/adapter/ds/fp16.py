"""DeepSpeed's ``FP16_UnfusedOptimizer`` reached by name: the internals fp16 per-stage steps
(:mod:`hippie_ds.adapter.fp16_stage`) read or swap, each as a named operation (roughly: what it
does in DeepSpeed's own terms)."""
from __future__ import annotations

import contextlib

import deepspeed.runtime.fp16.unfused_optimizer as unfused
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer", "is_unfused", "decided", "update_scale", "masters"]


def is_unfused(optimizer) -> bool:
    """Roughly: ``isinstance(optimizer, FP16_UnfusedOptimizer)``."""
    return isinstance(optimizer, FP16_UnfusedOptimizer)


@contextlib.contextmanager
def decided(optimizer, overflow: bool, joint: float | None = None):
    """Inside: the wrapper's step takes ``overflow`` and (with ``joint``) that gradient norm as given.
    Roughly: ``optimizer.overflow_checker.check`` answers ``overflow``; with ``joint``,
    ``unfused_optimizer.get_weight_norm`` answers 0 and ``get_global_norm`` answers ``joint``; all put back after."""
    checker = optimizer.overflow_checker
    check, weight_norm, global_norm = checker.check, unfused.get_weight_norm, unfused.get_global_norm
    checker.check = lambda *args, **kwargs: overflow
    if joint is not None:
        unfused.get_weight_norm = lambda *args, **kwargs: 0.0
        unfused.get_global_norm = lambda *args, **kwargs: joint
    try:
        yield
    finally:
        checker.check = check
        unfused.get_weight_norm, unfused.get_global_norm = weight_norm, global_norm


def update_scale(optimizer, overflow: bool) -> None:
    """Roughly: ``optimizer._update_scale(overflow)`` (the dynamic loss scale moves as after a step)."""
    optimizer._update_scale(overflow)


def masters(optimizer) -> dict:
    """Roughly: ``{id(p): master}`` over ``zip(optimizer.fp16_groups, optimizer.fp32_groups)`` (each
    fp16 parameter's fp32 master weight)."""
    return {id(p): m for lows, highs in zip(optimizer.fp16_groups, optimizer.fp32_groups) for p, m in zip(lows, highs)}
