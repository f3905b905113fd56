"""The engine's per-stage optimizer step (``StageOptimizerStep``, and the step a deferred stage's
``ApplyBufferedUpdate`` makes): DeepSpeed's ``_take_model_step`` with the gradient norm reduced over
the stage (or its tie group), not the pipeline; the step counters and the LR schedule advanced as
stock DeepSpeed advances them; a continuous schedule's update at its batch's learning rates."""
from __future__ import annotations

import torch
from deepspeed import comm as dist

from .zero_stage import stage_step


class _StageLocalMPU:
    """Proxy mpu whose model-parallel group is this stage's tensor-slice group: gradient norms
    (clipping, bf16 overflow) of a per-stage step reduce over the stage, not the pipeline. A stage
    holding a tied module reduces over the tie group instead (``clip_group``: the stages that hold
    it clip by their joint norm, so every copy is scaled alike; adapter/tied.py), every holder
    counting its own gradients (rank 0)."""

    def __init__(self, mpu, grid, clip_group=None):
        self._mpu, self._grid, self._clip_group = mpu, grid, clip_group

    def get_model_parallel_group(self):
        return self._clip_group if self._clip_group is not None else self._grid.get_slice_parallel_group()

    def get_model_parallel_world_size(self):
        if self._clip_group is not None:
            return dist.get_world_size(group=self._clip_group)
        return self._grid.get_slice_parallel_world_size()

    def get_model_parallel_rank(self):
        return 0 if self._clip_group is not None else self._grid.get_slice_parallel_rank()

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def __getattr__(self, name):
        return getattr(self._mpu, name)



class StageStepMixin:
    """Per-stage steps of :class:`~hippie_ds.adapter.engine.HippiePipelineEngine`."""

    _clip_group = None  # the tie group whose joint norm a per-stage step clips by (adapter/tied.py)

    def _exec_stage_optimizer_step(self, batch: int = 0):
        if not self._continuous:
            self._stage_step(apply=True)
            return
        # a per-stage update of a continuous schedule: on the current version, per-stage
        # clipping, no step counters (the call advances them), at its batch's learning rates
        # (an update may run in the next call: every stage, and every holder of a tied module,
        # applies a batch's gradient at the same rate wherever the call boundary falls)
        groups = self.optimizer.param_groups
        rates = self._batch_lrs.get(self._op_call + batch)
        now = [g["lr"] for g in groups]
        try:
            for g, lr in zip(groups, rates or now):
                g["lr"] = lr
            self._versions.update(self._stage_step_without_counters)
        finally:
            for g, lr in zip(groups, now):
                g["lr"] = lr

    def _stage_step(self, apply: bool):
        """DeepSpeed's ``_take_model_step`` with the gradient norm reduced over this stage only."""
        if not apply:
            self._join_tie_norm()
            self._step_bookkeeping()
            return
        saved = getattr(self.optimizer, "mpu", None)
        local = _StageLocalMPU(self.mpu, self.grid, self._clip_group)
        mpu = self.mpu
        clip = self._config.gradient_clipping, getattr(self.optimizer, "clip_grad", None)
        try:
            self.mpu = local
            if hasattr(self.optimizer, "mpu"):
                self.optimizer.mpu = local
            if self._gradients.clips_itself:  # clipped already (the lagged tie sum, adapter/tied.py)
                self._config.gradient_clipping = 0.0
                if clip[1] is not None:
                    self.optimizer.clip_grad = 0.0
            self._force_grad_boundary = True
            self._gradients.store.count_for_norm()
            with stage_step(self.optimizer, local):  # ZeRO-1: its partition of .grad, its norm over the stage
                self._take_model_step(None)
        finally:
            self._force_grad_boundary = False
            self.mpu = mpu
            if hasattr(self.optimizer, "mpu"):
                self.optimizer.mpu = saved
            self._config.gradient_clipping = clip[0]
            if clip[1] is not None:
                self.optimizer.clip_grad = clip[1]

    def _join_tie_norm(self):
        """A holder of a tied module that has nothing to apply (a whole deferred stage's first
        step) still joins the gradient-norm reduction its tie group's other holders make in their
        steps, with a zero gradient: DeepSpeed's own norm function under the per-stage mpu (bf16
        reduces the norm for its overflow check always, fp32 only to clip)."""
        if self._clip_group is None:
            return
        from deepspeed.runtime.utils import clip_grad_norm_, get_global_norm_of_tensors
        local = _StageLocalMPU(self.mpu, self.grid, self._clip_group)
        zero = torch.nn.Parameter(torch.zeros(1, device=self.device))
        zero.grad = torch.zeros_like(zero)
        if self.bfloat16_enabled():
            get_global_norm_of_tensors([zero.grad], mpu=local, norm_type=getattr(self.optimizer, "norm_type", 2))
        elif self.gradient_clipping() > 0:
            clip_grad_norm_([zero], self.gradient_clipping(), mpu=local)

    def _flush_buffered(self) -> bool:
        """A deferred stage's buffered gradient applied now (``drain()``). Its step clips by the
        tie group's joint norm only when the buffer holds this stage's tied weights (then every
        holder delays them and flushes too, adapter/tied.py); else (``deferred_layers: "untied"``:
        the tied copy in-step) the other holders do not step and it clips by the stage's own norm."""
        delayed = {id(p) for p in self._gradients.delayed}
        clip_group = self._clip_group
        if not any(id(w) in delayed for w, _ in self._tied_weights()):
            self._clip_group = None
        try:
            return self._gradients.flush()
        finally:
            self._clip_group = clip_group

    def _stage_step_without_counters(self):
        """A per-stage optimizer step that leaves the LR schedule, ``global_steps`` and
        ``global_samples`` as they were (updates outside the once-per-call bookkeeping)."""
        lr_scheduler, steps, samples = self.lr_scheduler, self.global_steps, self.global_samples
        self.lr_scheduler = None
        try:
            self._stage_step(apply=True)
        finally:
            self.lr_scheduler, self.global_steps, self.global_samples = lr_scheduler, steps, samples

    def _step_bookkeeping(self):
        if self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step()
            except TypeError:  # as DeepSpeed's _take_model_step: Megatron's scheduler takes the samples
                self.lr_scheduler.step(self.train_batch_size())
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

