"""The hippie family's rule in fp16, one process: DeepSpeed's FP16_UnfusedOptimizer (a torch optimizer
under ``"fp16": {"enabled": true}``) with its dynamic loss scale, and one overflow decision per
update for the whole pipeline (hippie_ds/adapter/fp16_stage.py).

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
        self.scale, self.window, self.min_scale, self.factor = 2.0 ** power, window, min_scale, factor
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
        masters and optimizer state are put back afterwards (hippie_ds.adapter.fp16_stage.Fp16Unmoved)."""
        optimizer, masters = opt
        kept = [(p, m, p.detach().clone(), m.detach().clone(),
                 {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state.get(m, {}).items()})
                for p, m, g in zip(ps, masters, grads) if g is None]
        self.apply(ps, opt, grads, clip)
        with torch.no_grad():
            for p, m, weight, master, state in kept:
                p.copy_(weight)
                m.copy_(master)
                optimizer.state[m] = state

    def apply(self, ps, opt, grads, clip, norm=None):
        optimizer, masters = opt
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, ps)]
        total = math.sqrt(sum(float(g.float().norm(2)) ** 2 for g in grads))  # get_weight_norm on fp16 grads
        combined = self.loss_scale.scale
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
    """The rule of ``2bw`` and ``pipedream`` in fp16 (hippie_ds/adapter/fp16_async.py), for
    reference_async's ``run_2bw`` and ``run_pipedream``: one decision per update (2bw: a batch;
    pipedream: a micro-batch) over every stage's gradient of that update; a skipped update moves no
    stage (the weight version still counts it); the scale moves once per batch (:meth:`decide`), so
    an update unscales by the scale after its batch's move if it is the batch's last, else by the
    scale before it. ``overflow_at``: {(call, stage)}: that stage's first parameter gradient made
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
        per micro-batch moving it would grow it M times as fast: issue 61)."""
        skip = any(not bool(torch.isfinite(g).all()) for gs in applies for g in gs if g is not None)
        self.skipped.append(skip)
        self._batch_overflow = self._batch_overflow or skip
        if len(self.skipped) % self.updates_per_batch == 0:
            self.loss_scale.update(self._batch_overflow)
            self._batch_overflow = False
        return skip

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
    """2bw's and pipedream's rule in fp16 + ZeRO-1 as written (hippie_ds/adapter/fp16_async.py): as
    :class:`Fp16Async`, with Fp16Zero's scaled loss and optimizers; update u's gradient is computed with
    the scale after decisions 0 .. u - 1 on every stage (the engine rescales what a stage accumulated
    under an older scale)."""
