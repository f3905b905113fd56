"""fp16 under per-stage updates (the hippie family): one pipeline-wide overflow decision per update.

DeepSpeed's fp16 wrappers (``FP16_UnfusedOptimizer``, ``FP16_Optimizer``, ZeRO-1's) skip a step whose
gradients overflow, lowers its loss scale, and otherwise steps and may raise it; stock takes that
flag over the whole pipeline inside the one step every stage takes at the flush. hippie-ds's
stages step apart (an in-step stage as its own backward ends, a deferred stage one batch late), so:

- **One decision per update.** Each rank flags the gradients it is about to apply (any
  non-finite value: an in-step stage's all-reduced gradient, a deferred stage's buffered gradient
  of the batch before and its in-step part) and one MAX all-reduce over the whole job ORs the flags
  (:meth:`Fp16Votes.vote`). Every rank votes exactly once per ``train_batch``: in its one step op
  (``stage_optimizer_step`` or ``apply_buffered_update``; the hippie family has exactly one per
  stage and call), and in ``drain()``. The cost: an in-step stage waits in the vote for the earlier
  stages' backward, so its optimizer step no longer overlaps them (its all-reduce still does).
- **A skipped update is skipped everywhere**, a deferred stage's buffered gradient included (it is
  dropped; the batch just run is buffered for the next update as usual); the step counts as
  DeepSpeed's skipped step (``skipped_steps``, no LR-schedule step).
- **One scale.** Every rank updates the loss scale once per update with the same flag (in the
  wrapper's step, or :meth:`Fp16Votes.update_scale` where a rank has nothing to apply).
- **One scale per update.** Every gradient of an update, a deferred stage's buffered one included,
  is divided by the scale the wrapper unscales that update with. DeepSpeed 0.19's backward does not
  scale the loss for FP16_UnfusedOptimizer (docs/precision.md): no gradient carries a scale of its
  own. ZeRO-1 (DeepSpeedZeroOptimizer) scales it: a buffered gradient carries its batch's scale and is
  multiplied by S(now) / S(then) when applied (``GradStore.rescale``).

The wrapper's own flag reduction (a collective over the pipeline inside ``step``) is replaced by
the vote's result for the step's duration (:meth:`Fp16Votes.decided`), and so is, on the holders of
a module tied across stages, its per-parameter-group norm reduction over the tie group: one joint
norm, reduced once (:meth:`Fp16Votes.joint_norm`); on ZeRO-1 its flag check answers the vote (its
norms already follow the stage's mpu, ds/zero.py). ``FP16_Optimizer`` (DeepSpeed's fused Adam,
``"optimizer": {"type": "Adam"}``) is decided for as ``FP16_UnfusedOptimizer`` is: its overflow check
answers the vote, its flattened norm the joint norm (ds/fp16.py); it keeps flat fp32 masters per
parameter group, so a step with nothing to apply to some parameters puts back their slices
(``ds.fp16.FusedUnmoved``). ZeRO's other configurations are refused at start-up (precision/paths.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from deepspeed import comm as dist

from ..ds import fp16 as ds_fp16


def fp16_unfused(optimizer) -> bool:
    """DeepSpeed's fp16 wrapper without ZeRO: FP16_UnfusedOptimizer (a torch optimizer) or
    FP16_Optimizer (its fused Adam). Both keep fp16 ``.grad`` and whole fp32 masters on every rank,
    do not scale the loss, and step every parameter of their groups."""
    return ds_fp16.is_unfused(optimizer) or ds_fp16.is_fused(optimizer)


def fp16_per_stage(fp16: bool, optimizer) -> bool:
    """fp16 (``fp16``: the engine's ``fp16_enabled()``) on a wrapper whose per-stage steps
    :class:`Fp16Votes` decides: FP16_UnfusedOptimizer, FP16_Optimizer (DeepSpeed's fused Adam), or
    ZeRO-1's DeepSpeedZeroOptimizer (which scales the loss)."""
    from ..ds.zero import is_zero

    return bool(fp16) and (fp16_unfused(optimizer) or is_zero(optimizer))


def check_fp16_wrapper(fp16: bool, optimizer, schedule: str) -> None:
    """On every rank as the engine is built, before any collective: refuse an fp16 wrapper that
    :class:`Fp16Votes` cannot decide for under a schedule with per-stage updates (none of
    DeepSpeed 0.19's fp16 pipeline paths: a safeguard for another wrapper)."""
    if fp16 and not fp16_per_stage(fp16, optimizer):
        raise ValueError(
            f"schedule {schedule!r} in fp16 needs DeepSpeed's FP16_UnfusedOptimizer (a torch "
            "optimizer), FP16_Optimizer (its fused Adam) or ZeRO-1's DeepSpeedZeroOptimizer, not "
            f"{type(optimizer).__name__}, whose step hippie-ds cannot split by stage"
        )


class Fp16Votes:
    """A stage's fp16 decisions (module docstring); None-safe helpers for its steps. Built with what it
    reads: the ``optimizer`` (the fp16 wrapper), the ``device`` its flags go on, and ``count_skipped``
    (DeepSpeed's count of a skipped step, ``ds.engine.ModelStep.count_skipped``)."""

    def __init__(self, optimizer, device, count_skipped: Callable[[], None]):
        self._optimizer, self._device, self._count_skipped = optimizer, device, count_skipped

    def vote(self, params: list[torch.Tensor] | None) -> bool:
        """True when any rank's gradients of ``params`` (this rank's part of the update; None:
        nothing) hold a non-finite value. A collective of the whole job."""
        local = any(not bool(torch.isfinite(p.grad).all()) for p in params or () if p.grad is not None)
        flag = torch.tensor([1.0 if local else 0.0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def joint_norm(self, params: list[torch.Tensor], group) -> float:
        """The gradient norm of ``params`` joined over ``group`` (a tied module's holders: they clip
        by it): one all-reduce, the same on every holder whatever its parameter groups."""
        local = sum(float(torch.Tensor.float(p.grad).norm(2)) ** 2 for p in params if p.grad is not None)
        total = torch.tensor([local], dtype=torch.float32, device=self._device)
        dist.all_reduce(total, group=group)
        return float(total.item()) ** 0.5

    @contextlib.contextmanager
    def decided(self, overflow: bool, joint: float | None = None):
        """Inside: the wrapper's overflow check answers ``overflow`` (no collective of its own); with
        ``joint``, its gradient norm is that (:meth:`joint_norm`), where it would reduce one norm per
        parameter group over the tie group (holders with other groups would wait on each other)."""
        optimizer = self._optimizer
        if not fp16_unfused(optimizer):  # ZeRO-1: its flag check sets ``overflow``; its norms follow the stage's mpu
            optimizer.check_overflow = lambda *args, **kwargs: setattr(optimizer, "overflow", overflow)
            try:
                yield
            finally:
                del optimizer.check_overflow  # the instance's: the class's method again
            return
        with ds_fp16.decided(optimizer, overflow, joint):  # its overflow check (and norms) answer these
            yield

    def update_scale(self, overflow: bool, counters: bool = True) -> None:
        """A rank with nothing to apply in an update: the scale moves as the steppers' does, and
        the step counts as stock counts a skipped one (``counters``: an update that advances them)."""
        ds_fp16.update_scale(self._optimizer, overflow)
        self._optimizer.overflow = overflow
        if overflow and counters:
            self._count_skipped()


def fp16_unmoved(params: list[torch.Tensor], optimizer):
    """:class:`Fp16Unmoved` (FP16_UnfusedOptimizer) or ``ds.fp16.FusedUnmoved`` (FP16_Optimizer)."""
    return ds_fp16.FusedUnmoved(params, optimizer) if ds_fp16.is_fused(optimizer) else Fp16Unmoved(params, optimizer)


class Fp16Unmoved:
    """Around a step that has nothing to apply to ``params`` (a partly deferred stage's ``drain()``):
    FP16_UnfusedOptimizer steps every parameter of its groups (a missing gradient becomes a zero
    one, which still moves Adam's weights), so their fp16 weights, fp32 masters and optimizer state
    are put back afterwards. Local: the wrapper keeps whole masters on every rank."""

    def __init__(self, params: list[torch.Tensor], optimizer):
        masters = ds_fp16.masters(optimizer)
        self.opt_state = optimizer.optimizer.state
        self.saved = []
        for p in params:
            m = masters[id(p)]
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.opt_state.get(m, {}).items()}
            self.saved.append((p, m, torch.Tensor.clone(torch.Tensor.detach(p)), m.detach().clone(), state))

    @torch.no_grad()
    def restore(self) -> None:
        for p, m, weight, master, state in self.saved:
            torch.Tensor.copy_(p, weight)
            m.copy_(master)
            if state:
                self.opt_state[m] = state
            else:
                self.opt_state.pop(m, None)
