"""A stage's per-stage optimizer step (:class:`StageStep`): the step of ``StageOptimizerStep``,
of a deferred stage's ``ApplyBufferedUpdate`` and of its ``drain()``. DeepSpeed's
``_take_model_step`` with the gradient norm reduced over the stage (or its tie group), not the
pipeline; the step counters and the LR schedule advanced as stock DeepSpeed advances them, or left
still (a continuous schedule's updates, the flush); a continuous schedule's update at its batch's
learning rates. Every engine setting a per-stage step changes for the duration of the step is
swapped and put back in one place, :meth:`StageStep.swapped` (exception-safe)."""

from __future__ import annotations

import contextlib

import torch
from deepspeed import comm as dist

from ..ds.engine import ModelStep
from ..ds.runtime import clip_grad_norm_, get_global_norm_of_tensors
from ..ds.zero import stage_step
from .fp16_stage import Fp16Votes, check_fp16_wrapper, fp16_per_stage
from .paths import SPLIT_BACKWARD_KINDS, own_gradient_ops


class _StageLocalMPU:
    """Proxy mpu whose model-parallel group is this stage's tensor-slice group: gradient norms
    (clipping, bf16 overflow) of a per-stage step reduce over the stage, not the pipeline. A stage
    holding a tied module reduces over the tie group instead (``clip_group``: the stages that hold
    it clip by their joint norm, so every copy is scaled alike; adapter/gradients/tied.py), every holder
    counting its own gradients (rank 0)."""

    def __init__(self, mpu, grid, clip_group=None):
        self._mpu, self._stage_grid, self._clip_group = mpu, grid, clip_group

    def get_model_parallel_group(self):
        return self._clip_group if self._clip_group is not None else self._stage_grid.get_slice_parallel_group()

    def get_model_parallel_world_size(self):
        if self._clip_group is not None:
            return dist.get_world_size(group=self._clip_group)
        return self._stage_grid.get_slice_parallel_world_size()

    def get_model_parallel_rank(self):
        return 0 if self._clip_group is not None else self._stage_grid.get_slice_parallel_rank()

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def __getattr__(self, name):
        return getattr(self._mpu, name)


class StageStep:
    """One stage's per-stage optimizer step.

    * :meth:`step` -- an update: DeepSpeed's ``_take_model_step`` inside :meth:`swapped`;
    * :meth:`count_only` -- no update, the step counters and LR schedule advance (a wholly deferred
      stage's first step); a tie holder joins its group's norm reduction;
    * :meth:`bookkeeping` -- the LR schedule and step counters advance once (a continuous
      schedule's call);
    * :meth:`swapped` -- the context manager that owns every swap a step makes.

    Built with what it reads: the ``optimizer`` (DeepSpeed's wrapper), the engine's ``mpu`` and the
    pipe ``grid``, ``model_step`` (:class:`~hippie_ds.adapter.ds.engine.ModelStep`: DeepSpeed's step
    and the engine settings it takes), the ``device``, whether ``fp16`` / ``bf16`` is enabled;
    ``store``: the stage's :class:`~hippie_ds.adapter.gradients.store.GradStore`; ``clip_group``: the
    tie group whose joint norm the step clips by (adapter/gradients/tied.py; None: the stage's own);
    ``clips_itself``: the gradients come clipped already (a lagged tie sum, adapter/gradients/tied.py),
    so the step clips nothing; ``tie_sums``: then the lagged tie sums (tied.LaggedTieSums) whose norm
    before clipping the engine reports as its gradient norm, as DeepSpeed reports the norm its
    optimizer clipped by."""

    def __init__(
        self,
        optimizer,
        mpu,
        grid,
        model_step: ModelStep,
        store,
        device=None,
        fp16: bool = False,
        bf16: bool = False,
        clip_group=None,
        clips_itself: bool = False,
        schedule=None,
        tie_sums=None,
    ):
        self._optimizer, self._mpu, self._stage_grid, self._model = optimizer, mpu, grid, model_step
        self._device, self._bf16 = device, bf16
        self._store = store
        self.clip_group = clip_group
        self.clips_itself = clips_itself
        self._tie_sums = tie_sums
        # fp16: every update's overflow decision is the whole pipeline's (fp16_stage.py)
        self.fp16 = Fp16Votes(optimizer, device, model_step.count_skipped) if fp16_per_stage(fp16, optimizer) else None
        # drain() applies a buffered update only where some stage defers (else it votes on nothing)
        self._defers = schedule is None or bool(schedule.deferred_stages())
        if schedule is not None and own_gradient_ops(schedule) - SPLIT_BACKWARD_KINDS:  # it steps per stage
            check_fp16_wrapper(fp16, optimizer, schedule.name)

    def local_mpu(self, tie_norm: bool = True) -> _StageLocalMPU:
        """The mpu whose norms reduce over the stage (``tie_norm``: over its tie group, if any)."""
        return _StageLocalMPU(self._mpu, self._stage_grid, self.clip_group if tie_norm else None)

    @contextlib.contextmanager
    def swapped(self, counters: bool = True, lrs: list[float] | None = None, tie_norm: bool = True):
        """Inside: the engine's and the optimizer's mpu are :meth:`local_mpu`'s; gradient
        clipping (the config's and the optimizer's ``clip_grad``) is off when ``clips_itself``;
        ``_force_grad_boundary`` holds (DeepSpeed's ``OptimizerStep`` sets it too). ``counters``
        False: no LR scheduler, and ``global_steps`` / ``global_samples`` come back as they were.
        ``lrs``: the optimizer's param groups take these learning rates, put back afterwards.
        Everything is restored when the body raises, too (the engine's settings by
        :meth:`~hippie_ds.adapter.ds.engine.ModelStep.settings`). Yields the local mpu."""
        optimizer = self._optimizer
        local = self.local_mpu(tie_norm)
        groups = optimizer.param_groups
        has_mpu = hasattr(optimizer, "mpu")
        optimizer_mpu = getattr(optimizer, "mpu", None)
        clip_grad = getattr(optimizer, "clip_grad", None)
        now = [g["lr"] for g in groups]
        try:
            if lrs is not None:
                for g, lr in zip(groups, lrs):
                    g["lr"] = lr
            if has_mpu:
                optimizer.mpu = local
            if self.clips_itself and clip_grad is not None:
                optimizer.clip_grad = 0.0
            with self._model.settings(local, 0.0 if self.clips_itself else None, counters):
                yield local
        finally:
            if has_mpu:
                optimizer.mpu = optimizer_mpu
            if clip_grad is not None:
                optimizer.clip_grad = clip_grad
            if lrs is not None:
                for g, lr in zip(groups, now):
                    g["lr"] = lr

    def step(
        self, counters: bool = True, lrs: list[float] | None = None, tie_norm: bool = True, overflow: bool | None = None
    ) -> None:
        """DeepSpeed's ``_take_model_step`` with the gradient norm reduced over this stage only
        (arguments: :meth:`swapped`'s). fp16: the update's pipeline-wide overflow decision, voted
        here unless ``overflow`` gives it."""
        if self.fp16 is not None and overflow is None:
            overflow = self.fp16.vote(self._store.params)
        with self.swapped(counters, lrs, tie_norm) as local:
            self._store.count_for_norm()
            joint = (
                self.fp16.joint_norm(self._store.params, local.get_model_parallel_group())
                if self.fp16 is not None and not overflow and tie_norm and self.clip_group is not None
                else None
            )
            with (
                stage_step(self._optimizer, local),
                self.fp16.decided(overflow, joint) if self.fp16 is not None else contextlib.nullcontext(),
            ):
                self._model.take()  # ZeRO-1: its partition of .grad, its norm over the stage
        if (
            self.clips_itself
            and self._tie_sums is not None
            and not overflow
            and self._tie_sums.norm_before_clip is not None
        ):  # the optimizer saw clipped gradients
            self._model.set_global_grad_norm(self._tie_sums.norm_before_clip)

    def drain_step(self, due: bool, tie_norm: bool) -> None:
        """``drain()``'s step of a deferred stage's buffered gradient (``due``: there is one, in
        place), the counters left still. fp16: every rank calls it and votes on that update; a rank
        with nothing to apply moves its loss scale with the others."""
        if not due and not self._defers:  # no stage defers (1f1b, zb-h1, ...): no update, no vote, the scale stays
            return
        overflow = None if self.fp16 is None else self.fp16.vote(self._store.params if due else None)
        if due:
            self.step(counters=False, tie_norm=tie_norm, overflow=overflow)
        elif self.fp16 is not None:
            self.fp16.update_scale(overflow, counters=False)

    def count_only(self) -> None:
        """No update; the step counters and the LR schedule advance as an update's would (fp16: the
        rank votes, moves its loss scale with the others, and counts a skipped update as stock does)."""
        overflow = self.fp16.vote(None) if self.fp16 is not None else False
        if self.fp16 is not None:
            self.fp16.update_scale(overflow)
        self._join_tie_norm()
        self.bookkeeping(schedule=not overflow)

    def _join_tie_norm(self):
        """A holder of a tied module that has nothing to apply (a whole deferred stage's first
        step) still joins the gradient-norm reduction its tie group's other holders make in their
        steps, with a zero gradient: DeepSpeed's own norm function under the per-stage mpu (bf16
        reduces the norm for its overflow check always, fp32 only to clip)."""
        if self.clip_group is None:
            return
        local = self.local_mpu()
        if self.fp16 is not None and self._store.fp16:  # FP16_UnfusedOptimizer's holders reduce one joint norm
            self.fp16.joint_norm([], local.get_model_parallel_group())
            return
        zero = torch.nn.Parameter(torch.zeros(1, device=self._device))
        zero.grad = torch.zeros_like(zero)
        if self._bf16:
            get_global_norm_of_tensors([zero.grad], mpu=local, norm_type=getattr(self._optimizer, "norm_type", 2))
        elif self._model.clipping() > 0:
            clip_grad_norm_([zero], self._model.clipping(), mpu=local)

    def bookkeeping(self, schedule: bool = True) -> None:
        """The LR schedule steps (unless ``schedule`` is False: a skipped update) and ``global_steps``
        / ``global_samples`` advance, as DeepSpeed's ``_take_model_step`` advances them."""
        self._model.advance(schedule)
