"""What the corrections built as step hooks on the config's optimizer share (error_feedback.py,
delay_compensation.py): where they apply (a stage one update behind, checked at start-up) and the
torch optimizer they hook (the one DeepSpeed's wrapper steps: its fp32 values)."""

from __future__ import annotations

import torch

from ...config import ConfigError


def require_stage_one_behind(key: str, value: float, compiled) -> None:
    """At start-up, before any process group: the correction ``key`` = ``value`` needs a schedule
    with a stage one update behind (2bw's); a ConfigError naming the key otherwise."""
    stages = range(compiled.stages)
    if not (compiled.versioned and any(compiled.one_version_behind(s) for s in stages)):
        raise ConfigError(
            f'config key "{key}" = {value!r}: schedule {compiled.name!r} has no stage one update '
            "behind that it applies to; it is built for 2bw (not for the hippie family's delayed "
            "layers or pipedream); allowed there: 0 (off)"
        )


def hooked_optimizer(optimizer, key: str, value: float) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's ``optimizer`` (ds.runtime.torch_optimizer) that the
    correction ``key`` = ``value`` hooks; a ConfigError when it holds none."""
    from ..ds.runtime import torch_optimizer

    inner = torch_optimizer(optimizer)
    if inner is None:
        raise ConfigError(
            f'config key "{key}" = {value!r}: the optimizer {type(optimizer).__qualname__} holds '
            "no torch.optim.Optimizer to wrap"
        )
    return inner
