"""The hippie family's rule in fp16, one process: DeepSpeed's FP16_UnfusedOptimizer (a torch optimizer
under ``"fp16": {"enabled": true}``) with its dynamic loss scale, and one overflow decision per
update for the whole pipeline (hippie_ds/adapter/precision/fp16_stage.py).

- the model and the data are fp16; each rank's ``.grad`` accumulates its micro-batches in fp16 (the
  loss divided by the micro-batches, not scaled: DeepSpeed 0.19's backward scales the loss only for
  its ZeRO-family wrappers); the replicas average on an fp16 wire (each divided by dp, summed);
- update t applies the in-step stages' gradient of batch t and the deferred stages' buffered one of
  batch t-1; if any of them holds a non-finite value, the whole update is skipped (the buffer of
  t-1 dropped) and the scale halves, else the scale may grow (every ``window`` stable updates);
- a stage's step, as the wrapper's: the fp16 gradients' norm, the scale updated first, the fp32
  gradients multiplied by 1 / (scale, or scale x the clipping factor), the fp32 masters stepped,
  the fp16 weights their rounding. A missing gradient steps as a zero one. The wrapper takes one
  step of zero gradients when it is made (its ``initialize_optimizer_states``: Adam's step count 1,
  the weight decay applied to the masters once).
"""

import math

import torch

from reference import Precision, _make_optimizers


class LossScale:
    """DeepSpeed's dynamic loss scale of FP16_UnfusedOptimizer (``_update_scale``): no hysteresis."""

    def __init__(self, power: int, window: int, min_scale: float = 1.0, factor: float = 2.0):
        self.scale, self.window, self.min_scale, self.factor = 2.0**power, window, min_scale, factor
        self.iteration, self.last_overflow = 0, -1
        self.history = []  # (update, skipped)

    def update(self, skip: bool) -> None:
        if skip:
            self.scale = max(self.scale / self.factor, self.min_scale)
            self.last_overflow = self.iteration
        else:
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= self.factor
        self.history.append((self.iteration, skip))
        self.iteration += 1


class Fp16(Precision):
    """``overflow_at``: {(batch, stage)}: that stage's first parameter gradient of that batch made
    infinite (what the rank worker's ``+ovfS.T`` injects)."""

    tie_before_dp = True  # the hippie family sums a tied module's copies, then all-reduces over the replicas
    ds_clipping = True  # 2bw's and pipedream's tied model: clipped apart by DeepSpeed's clip_tensors_by_global_norm

    def __init__(self, scale: LossScale, overflow_at=()):
        super().__init__(comm=torch.float16, flat=True)
        self.loss_scale = scale
        self.overflow_at = set(overflow_at)

    def model(self, layers):
        for layer in layers:
            (layer.args[0] if hasattr(layer, "args") else layer).half()
        return layers

    def data(self, x, y):
        return x.half(), y.half()

    def optimizers(self, stage_params, optimizer, lr):
        masters = [[p.detach().float().clone() for p in ps] for ps in stage_params]
        optimizers = _make_optimizers(masters, optimizer, lr)
        for opt, ms in zip(optimizers, masters):  # the wrapper's initialize_optimizer_states: one step of zeros
            for m in ms:
                m.grad = torch.zeros_like(m)
            opt.step()
            for m in ms:
                m.grad = None
        return list(zip(optimizers, masters))

    def inject(self, step, grads):
        for s, gs in enumerate(grads):
            if (step, s) in self.overflow_at and gs:
                gs[0].mul_(math.inf)

    def decide(self, applies) -> bool:
        skip = any(not bool(torch.isfinite(g).all()) for gs in applies for g in gs if g is not None)
        self.loss_scale.update(skip)
        return skip

    def apply_only(self, ps, opt, grads, clip):
        """The wrapper steps every parameter (a missing gradient as zeros): the others' fp16 weights,
        masters and optimizer state are put back afterwards (hippie_ds.adapter.precision.fp16_stage.Fp16Unmoved)."""
        optimizer, masters = opt
        kept = [
            (
                p,
                m,
                p.detach().clone(),
                m.detach().clone(),
                {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state.get(m, {}).items()},
            )
            for p, m, g in zip(ps, masters, grads)
            if g is None
        ]
        self.apply(ps, opt, grads, clip)
        with torch.no_grad():
            for p, m, weight, master, state in kept:
                p.copy_(weight)
                m.copy_(master)
                optimizer.state[m] = state

    counts_replicated = True  # Fp16Votes.joint_norm: every holder counts its own copy

    def joint_norm(self, grads_per_holder, replicated):
        """A tied module's holders' joint gradient norm (``Fp16Votes.joint_norm``; ZeRO-1's over the tie
        group): each holder's sum of squared norms, an fp32 value each, summed over the holders.
        ``replicated``: per holder, the indices of its tied copies DeepSpeed marks ``ds_pipe_replicated``
        (every holder's but the first), which ZeRO-1's norm leaves out (:attr:`counts_replicated`)."""
        total = torch.zeros(1, dtype=torch.float32)
        for gs, skip in zip(grads_per_holder, replicated):
            total += torch.tensor(
                [
                    sum(
                        float(g.float().norm(2)) ** 2
                        for j, g in enumerate(gs)
                        if g is not None and (self.counts_replicated or j not in skip)
                    )
                ],
                dtype=torch.float32,
            )
        return float(total.item()) ** 0.5

    def unscale_by(self) -> float:
        """What the step divides the gradients by (times the clipping factor): the loss scale."""
        return self.loss_scale.scale

    def apply(self, ps, opt, grads, clip, norm=None):
        """``norm``: a tied module's holders' joint norm (:meth:`joint_norm`), else this stage's."""
        optimizer, masters = opt
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, ps)]
        total = norm if norm is not None else math.sqrt(sum(float(g.float().norm(2)) ** 2 for g in grads))
        combined = self.unscale_by()
        if clip > 0:
            factor = ((total / combined) + 1e-6) / clip
            if factor > 1:
                combined = factor * combined
        for m, g in zip(masters, grads):
            m.grad = g.float().mul_(1.0 / combined)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(ps, masters):
                p.copy_(m)


class Fp16Zero(Fp16):
    """fp16 with ZeRO-1 as written (DeepSpeedZeroOptimizer; hippie_ds/adapter/ds/zero.py): the
    backward takes the loss times the scale, so every gradient carries the scale of the batch that
    made it, and a deferred stage's buffered one is multiplied by S(now) / S(then) when applied
    (GradStore.rescale); no zero-gradient step at creation; the same flag, norm and unscale rule."""

    counts_replicated = False  # ZeRO's norm (get_grad_norm_direct) skips a ds_pipe_replicated tied copy

    def optimizers(self, stage_params, optimizer, lr):
        masters = [[p.detach().float().clone() for p in ps] for ps in stage_params]
        return list(zip(_make_optimizers(masters, optimizer, lr), masters))

    def scale_loss(self, loss):
        return loss * self.loss_scale.scale

    def grad_scale(self):
        return self.loss_scale.scale

    def rescaled(self, grads, made_at):
        if made_at is None or made_at == self.loss_scale.scale:
            return grads
        return [None if g is None else g * (self.loss_scale.scale / made_at) for g in grads]


class Fp16Async(Fp16):
    """The rule of ``2bw`` and ``pipedream`` in fp16 (hippie_ds/adapter/precision/fp16_async.py), for
    reference_async's ``run_2bw`` and ``run_pipedream``: one decision per update (2bw: a batch;
    pipedream: a micro-batch) over every stage's gradient of that update; a skipped update moves no
    stage (the weight version still counts it); the scale moves once per batch (:meth:`decide`), so
    an update unscales by the scale after its batch's move if it is the batch's last, else by the
    scale before it; pipedream without ZeRO unscales by 1 (:meth:`unscale_by`). ``overflow_at``:
    {(call, stage)}: that stage's first parameter gradient made
    infinite in every backward the stage runs during ``train_batch`` call ``call`` (or in the
    ``drain()`` after call ``call`` - 1): what the rank worker's ``+ovfS.T`` injects, by
    ``engine.global_steps``, which these schedules advance once per call. Where a backward runs:
    :meth:`backward_call`."""

    def __init__(self, scale: LossScale, stages: int, micro_batches: int, overflow_at=()):
        super().__init__(scale, overflow_at)
        self.stages, self.micro_batches = stages, micro_batches
        self.updates_per_batch = 1  # run_pipedream sets micro_batches: the scale moves once per batch
        self.skipped = []  # per update, whether it was skipped
        self._batch_overflow = False

    def decide(self, applies) -> bool:
        """Update u's decision; the scale moves once per batch, at its last update, by whether any of
        the batch's updates overflowed (DeepSpeed's scaler moves once per step of a batch; an update
        per micro-batch moving it would grow it M times as fast)."""
        skip = any(not bool(torch.isfinite(g).all()) for gs in applies for g in gs if g is not None)
        self.skipped.append(skip)
        self._batch_overflow = self._batch_overflow or skip
        if len(self.skipped) % self.updates_per_batch == 0:
            self.loss_scale.update(self._batch_overflow)
            self._batch_overflow = False
        return skip

    def unscale_by(self) -> float:
        """pipedream's micro-batch updates where the loss is not scaled (no ZeRO): 1, so that each applies
        the fp32 rule's gradient, not that gradient over the scale (fp16_async.py); else the scale."""
        return 1.0 if self.updates_per_batch > 1 and self.grad_scale() is None else super().unscale_by()

    def backward_call(self, stage: int, batch: int, index: int) -> int:
        """The call that runs ``stage``'s backward of micro-batch ``index`` of ``batch``: both schedules
        place it at timeline step ``batch * 2M + 2 index + 2K - 1 - stage`` and a stage's call window
        starts at step ``call * 2M + stage`` (schedules/2bw.yaml, schedules/pipedream.yaml)."""
        period = 2 * self.micro_batches
        return batch + (2 * index + 2 * self.stages - 1 - 2 * stage) // period

    def inject_backwards(self, batch, indices, grads):
        """The overflows injected into the backwards of micro-batches ``indices`` of ``batch``."""
        for s, gs in enumerate(grads):
            if gs and any((self.backward_call(s, batch, m), s) in self.overflow_at for m in indices):
                gs[0].mul_(math.inf)


class Fp16AsyncZero(Fp16Async, Fp16Zero):
    """2bw's and pipedream's rule in fp16 + ZeRO-1 as written (hippie_ds/adapter/precision/fp16_async.py): as
    :class:`Fp16Async`, with Fp16Zero's scaled loss and optimizers; update u's gradient is computed with
    the scale after decisions 0 .. u - 1 on every stage (the engine rescales what a stage accumulated
    under an older scale)."""


class Fp16Fused(Fp16):
    """fp16 with ``"optimizer": {"type": "Adam"}`` (DeepSpeed's FP16_Optimizer over its FusedAdam, decoupled
    decay ``weight_decay``): the same update as :class:`Fp16`, computed as that wrapper computes it, so
    that a run equals it bit for bit. Per stage one flat fp32 master (the stage's parameters in the
    engine's order: a tied copy first, as PipelineModule registers ``tied_modules`` before its layers)
    stepped by DeepSpeed's own FusedAdam (its CPU kernel rounds otherwise than torch's AdamW: one fp16
    unit of a weight now and then), a zero-gradient step at creation (``initialize_optimizer_states``);
    the norm of the flat fp32 gradient as ``get_flattened_grad_norm`` takes it (an fp32 round trip), or,
    on a tied module's holders, their joint norm as ``Fp16Votes.joint_norm`` reduces it (:meth:`joint_norm`)."""

    def __init__(self, scale: LossScale, overflow_at=(), weight_decay: float = 0.01, resumed_after=None):
        super().__init__(scale, overflow_at)
        self.weight_decay, self.resumed_after = weight_decay, resumed_after

    def _resume(self):
        """A run resumed from a checkpoint after ``resumed_after`` updates: its fresh engine's creation
        step (step 1) resets the CPU FusedAdam kernel's process-wide beta powers, which it then takes
        by ``pow`` at the loaded step count instead of by one multiplication per step (fp32 rounding,
        ~2e-7 in a master: an fp16 unit of a weight now and then); the reference's steps do the same."""
        from deepspeed.ops.adam import FusedAdam

        done = len(getattr(self, "skipped", self.loss_scale.history))
        if self.resumed_after is not None and done > self.resumed_after:
            self.resumed_after = None
            x = torch.zeros(1, requires_grad=True)
            x.grad = torch.zeros(1)
            FusedAdam([x], weight_decay=self.weight_decay).step()

    @staticmethod
    def order(ps):
        """The engine's order of a stage's parameters: the tied copy (``tied_key``) first."""
        return sorted(range(len(ps)), key=lambda j: not hasattr(ps[j], "tied_key"))

    def optimizers(self, stage_params, optimizer, lr):
        from deepspeed.ops.adam import FusedAdam
        from torch._utils import _flatten_dense_tensors

        assert optimizer == "AdamW", "FP16_Optimizer is DeepSpeed's fused Adam"
        out = []
        for ps in stage_params:
            flat = _flatten_dense_tensors([ps[j].detach().clone() for j in self.order(ps)]).float().requires_grad_()
            opt = FusedAdam([flat], lr=lr, weight_decay=self.weight_decay, adam_w_mode=True)
            flat.grad = torch.zeros_like(flat)
            opt.step()
            flat.grad = None
            out.append((opt, flat))
        return out

    def apply(self, ps, opt, grads, clip, norm=None):
        from deepspeed.runtime.utils import get_flattened_grad_norm, get_global_norm
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        optimizer, flat = opt
        self._resume()
        order = self.order(ps)
        flat.grad = _flatten_dense_tensors(
            [torch.zeros(ps[j].shape) if grads[j] is None else grads[j].float() for j in order]
        )
        own = get_flattened_grad_norm([flat]) if norm is None else norm
        total = get_global_norm(norm_list=[own])
        combined = self.unscale_by()
        if clip > 0:
            factor = ((total / combined) + 1e-6) / clip
            if factor > 1:
                combined = factor * combined
        flat.grad.mul_(1.0 / combined)
        optimizer.step()
        flat.grad = None
        with torch.no_grad():
            for j, q in zip(order, _unflatten_dense_tensors(flat, [ps[j] for j in order])):
                ps[j].copy_(q)

    def apply_only(self, ps, opt, grads, clip):
        """As ``ds.fp16.FusedUnmoved``: the parameters without a gradient get their fp16 weights and
        their slices of the flat master and of Adam's moments back after the step."""
        optimizer, flat = opt
        offsets, at = {}, 0
        for j in self.order(ps):
            offsets[j], at = (at, ps[j].numel()), at + ps[j].numel()
        tensors = [flat] + [
            v for v in optimizer.state[flat].values() if torch.is_tensor(v) and v.numel() == flat.numel()
        ]
        kept = [
            (
                ps[j],
                ps[j].detach().clone(),
                [(t, *offsets[j], t.detach().narrow(0, *offsets[j]).clone()) for t in tensors],
            )
            for j, g in enumerate(grads)
            if g is None
        ]
        self.apply(ps, opt, grads, clip)
        with torch.no_grad():
            for p, weight, slices in kept:
                p.copy_(weight)
                for t, offset, n, value in slices:
                    t.narrow(0, offset, n).copy_(value)


class Fp16AsyncFused(Fp16Async, Fp16Fused):
    """2bw's and pipedream's rule in fp16 with ``"optimizer": {"type": "Adam"}`` (FP16_Optimizer over
    FusedAdam): :class:`Fp16Async`'s decisions, :class:`Fp16Fused`'s steps."""
