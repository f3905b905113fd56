"""Where a stage's accumulated gradients live, for each optimizer path DeepSpeed picks.

- fp32 (a torch optimizer, no wrapper): each parameter's ``.grad``.
- ZeRO-1 (DeepSpeed's ``DeepSpeedZeroOptimizer``: fp32, or bf16 accumulated in bf16): each
  parameter's ``.grad`` too, where ZeRO-1 leaves it until its own reduce, which hippie-ds never
  calls; the per-stage step hands ZeRO its partition of it (:mod:`hippie_ds.adapter.ds.zero`).
- bf16, with or without ZeRO-1 (DeepSpeed's ``BF16_Optimizer``): the bf16 ``.grad`` of a backward
  is added into the optimizer's flat accumulator (fp32 with ``data_types.grad_accum_dtype: fp32``,
  else bf16) after each backward, or by DeepSpeed's own hooks with ``immediate_grad_update``. A
  parameter's accumulated gradient is its view into that buffer; the fp32 master weights and the
  optimizer state are partitioned over the stage's data-parallel group (ZeRO-1), every rank keeps
  the whole accumulator. DeepSpeed's stock pipeline all-reduces that whole accumulator too.

Everything the engine does to gradients (the early and the deferred all-reduce, the gradient
buffer, the split backward's weight pass) goes through :class:`GradStore`, so that each path acts
on the gradients DeepSpeed's own step reads, never on both copies. DeepSpeed's other wrappers
(``FP16_Optimizer``, ZeRO with ``overlap_comm``, a separate accumulation dtype or an offloaded
optimizer) reduce or scale gradients inside their own machinery; schedules that need this store
refuse them at ``initialize`` (:func:`hippie_ds.adapter.integration.check_precision`).
"""

from __future__ import annotations

import torch
from torch._utils import _unflatten_dense_tensors

from ..ds import zero as ds_zero
from ..ds.zero import BF16_Optimizer, DeepSpeedOptimizer, ZeroUnmoved, is_zero
from ..module.tensor_calls import flat_copy  # noqa: F401 (the store's callers take it from here too)
from ..precision.fp16_stage import fp16_unfused, fp16_unmoved


def supports(optimizer) -> bool:
    """True when :class:`GradStore` knows where ``optimizer`` keeps gradients."""
    # every DeepSpeed wrapper (ZeRO, fp16) derives from DeepSpeedOptimizer; fp32 gets the bare one
    return (
        isinstance(optimizer, BF16_Optimizer)
        or is_zero(optimizer)
        or fp16_unfused(optimizer)
        or not isinstance(optimizer, DeepSpeedOptimizer)
    )


class GradStore:
    """The accumulated gradients of one stage's parameters, wherever the optimizer keeps them."""

    def __init__(self, optimizer, params: list[torch.Tensor]):
        self.params = params
        self.bf16 = isinstance(optimizer, BF16_Optimizer)
        self.fp16 = fp16_unfused(optimizer)  # FP16_(Unfused)Optimizer: fp16 .grad, whole fp32 masters per rank
        # a parameter cannot be left out of a step: one flat partition (BF16_Optimizer, ZeRO-1), or fp16's
        # wrapper, which steps a missing gradient as a zero one
        self.flat = self.bf16 or is_zero(optimizer) or self.fp16
        self._optimizer = optimizer
        # BF16_Optimizer: parameter -> (group, index) of its view into the flat accumulator
        self._slot = (
            {id(p): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, p in enumerate(group)}
            if self.bf16
            else {}
        )

    @property
    def moves_after_backward(self) -> bool:
        """bf16 without ``immediate_grad_update``: a backward's bf16 gradients reach the
        accumulator only after it (so a hook inside it must move them itself)."""
        return self.bf16 and not self._optimizer.immediate_grad_update

    def of(self, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The accumulated gradients of ``params`` (fp32 path: materialised as zeros where
        missing). None: all of the stage's (bf16 path: the flat accumulators, padding included,
        which is what DeepSpeed's own reduction all-reduces)."""
        if params is None:
            if self.bf16:
                grads, _ = self._optimizer.get_grads_for_reduction()
                return list(grads)
            params = self.params
        if self.bf16:
            groups = self._optimizer.fp32_groups_gradients
            return [groups[i][j] for i, j in (self._slot[id(p)] for p in params)]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in params]

    @torch.no_grad()
    def load(self, params: list[torch.Tensor] | None, flat: torch.Tensor) -> None:
        """Set the accumulated gradients of ``params`` (None: the whole stage, as :meth:`of`)
        from the flat tensor ``flat``; the next step counts them (bf16: its gradient norm too)."""
        grads = self.of(params)
        for g, value in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(value)
        if self.bf16:
            for p in self.params if params is None else params:
                i, j = self._slot[id(p)]
                self._optimizer.fp32_groups_has_gradients[i][j] = True

    @torch.no_grad()
    def finalize(self, param: torch.Tensor) -> None:
        """Called once ``param``'s gradient of the running backward is complete (its
        post-accumulate-grad hook): make the accumulator hold it now."""
        if self.moves_after_backward and param.grad is not None:
            i, j = self._slot[id(param)]
            # adds the bf16 grad into the accumulator and zeroes it: the move after the backward adds 0
            ds_zero.accumulate_hp_grad(self._optimizer, param, i, j, clear_lp_grads=True)

    @torch.no_grad()
    def skip(self, params: list[torch.Tensor]) -> None:
        """Leave ``params`` out of the next optimizer step. A torch optimizer skips a parameter
        whose ``.grad`` is None. BF16_Optimizer steps one flat partition, so those parameters get a
        zero gradient instead (SGD: no change; Adam: zero moments' input, weight decay still
        applies) and drop out of the gradient norm."""
        if self.fp16:  # a zero gradient, as the wrapper would make: its norm still counts the parameter
            for p in params:
                p.grad = torch.zeros_like(p)
            return
        if not self.bf16:
            for p in params:
                p.grad = None
            return
        for p in params:
            i, j = self._slot[id(p)]
            self._optimizer.fp32_groups_gradients[i][j].zero_()
            self._optimizer.fp32_groups_has_gradients[i][j] = False

    def unmoved(self, params: list[torch.Tensor]):
        """What puts ``params`` back after a step that has nothing to apply to them, started
        before the step (:class:`Unmoved` on BF16_Optimizer, ``ds.zero.ZeroUnmoved`` on ZeRO-1);
        None where the step skips them itself (fp32: ``.grad`` None, :meth:`skip`) or there are none."""
        if not self.flat or not params:
            return None
        if self.fp16:
            return fp16_unmoved(params, self._optimizer)
        return Unmoved(params, self._optimizer) if self.bf16 else ZeroUnmoved(params, self._optimizer)

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the backward multiplies the loss by now: ZeRO-1 in fp16 (``scale_if_loss``);
        None where DeepSpeed's backward scales nothing (FP16_UnfusedOptimizer, bf16, fp32)."""
        scaler = getattr(self._optimizer, "loss_scaler", None) if is_zero(self._optimizer) else None
        return None if scaler is None else float(scaler.loss_scale)

    @torch.no_grad()
    def rescale(self, params: list[torch.Tensor] | None, made_at: float | None) -> None:
        """Gradients of ``params`` made at loss scale ``made_at`` (a deferred stage's buffered batch),
        loaded now: multiplied by S(now) / S(then), a power of two, so that they carry this update's scale."""
        now = self.loss_scale
        if now is None or made_at is None or made_at == now:
            return
        for g in self.of(params):
            g.mul_(now / made_at)

    def count_for_norm(self) -> None:
        """Before a step: BF16_Optimizer's gradient norm stacks the gradients it counts and fails
        on none, as when a tie holder applies only its tied weight, which DeepSpeed leaves out of
        every holder's norm but the first (``ds_pipe_replicated``). Count one zero gradient then:
        the norm is the same (0), the step applies what it would."""
        if not self.bf16 or self._optimizer.get_grads_for_norm()[0]:
            return
        flags = self._optimizer.fp32_groups_has_gradients
        for i, group in enumerate(self._optimizer.bf16_groups):
            for j, p in enumerate(group):
                if not flags[i][j] and not getattr(p, "ds_pipe_replicated", False):
                    self._optimizer.fp32_groups_gradients[i][j].zero_()
                    flags[i][j] = True
                    return

    @torch.no_grad()
    def collect_weight_pass(self) -> None:
        """After a split backward's weight pass, which sets the parameters' ``.grad`` itself
        (``autograd.grad``, so DeepSpeed's gradient hooks do not see it): move each bf16 gradient
        left on a parameter into the accumulator and drop it."""
        if not self.bf16:
            return
        for group in self._optimizer.bf16_groups:
            for p in group:
                if p.grad is not None:
                    i, j = self._slot[id(p)]
                    ds_zero.accumulate_hp_grad(self._optimizer, p, i, j, clear_lp_grads=False)
                    p.grad = None


OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's per-parameter moments


def _moment(get, param, key):
    """``key`` of ``param``'s optimizer state, or None where the optimizer has not linked it (ZeRO-1
    links its moments' fragments once, at its first step; one that found no state keeps none)."""
    try:
        return get(param, key)
    except (KeyError, ValueError):
        return None


class Unmoved:
    """Around a step of BF16_Optimizer's flat partition that has nothing to apply to ``params`` (a
    deferred stage's ``drain()``: only the delayed layers' gradient is pending): a flat step cannot
    leave a parameter out, and a zero gradient still moves it (Adam's moments, weight decay), so
    their weights, fp32 masters and moments are put back afterwards. Without it a tied module kept
    in-step (``deferred_layers: "untied"``) would move on this stage only and its copies part.
    Adam's step count, one per flat group, still advances, and so do the moments of a ZeRO-1
    optimizer that has not linked them to its parameters. Collective over the data-parallel group
    (DeepSpeed's ``safe_get_full_*`` gather the partitions)."""

    def __init__(self, params: list[torch.Tensor], optimizer=None):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        ds_zero.link_optimizer_state(optimizer)  # the moments' fragments are linked after the optimizer's first step
        self.params = params
        self.weights = [torch.Tensor.clone(torch.Tensor.detach(p)) for p in params]
        self.masters = [safe_get_full_fp32_param(p) for p in params]
        self.states = {k: [_moment(safe_get_full_optimizer_state, p, k) for p in params] for k in OPTIMIZER_STATE_KEYS}

    def restore(self) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        with torch.no_grad():
            for p, w, m in zip(self.params, self.weights, self.masters):
                torch.Tensor.copy_(p, w)
                if m is not None:
                    safe_set_full_fp32_param(p, m)
            for key, values in self.states.items():
                for p, v in zip(self.params, values):
                    if v is not None:
                        safe_set_full_optimizer_state(p, v, key)
