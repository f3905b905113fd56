"""Gradient reduction and the deferred update of one ``HippiePipelineEngine`` stage
(:class:`StageGradients`): the async per-stage all-reduce, the gradient buffer of deferred stages
(applied one step late, with the ``hippie.staleness`` correction), partial deferral
(``hippie.deferred_layers``) and the flush.

Buffer states: empty -> filled (copy_to_buffer) -> reducing (start_allreduce(buffer)) ->
reduced (wait_allreduce(buffer)) -> empty (apply_buffered_update). A deferred stage delays the
gradient of ``delayed`` (all its parameters, or with partial deferral those of its first
layers); ``synced`` are all-reduced and applied in-step, their all-reduce started inside
the stage's last backward once their gradients are final (the delayed layers come later in
backward); the declared ``start_allreduce(grads)`` then finds it in flight. Every gradient is
read and written through :class:`~hippie_ds.adapter.gradients.store.GradStore` (fp32 and ZeRO-1's
DeepSpeedZeroOptimizer: ``.grad``; bf16 and bf16 + ZeRO-1: BF16_Optimizer's accumulator).

From the config to the wire: ``hippie.deferred_layers`` -> ``schedules.resolve.resolve`` (a
:class:`~hippie_ds.schedules.deferral.Deferral`, global layer indices) -> ``HippiePipelineEngine(deferral=)``
-> :func:`split_deferred` (delayed, synced)
-> :class:`StageGradients`: the synced part's hooks start the ``grads`` all-reduce inside the last backward,
the delayed part goes through ``copy_to_buffer`` and the ``buffer`` all-reduce across the next step.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ...schedules.deferral import StageDeferral
from ...schedules.grad_buffer import FILLED, GradBuffer
from .allreduce_stream import AllReduceStream
from .store import GradStore, flat_copy
from ..module.tensor_calls import numel


def _checked(transition: tuple[bool, str | None]) -> bool:
    """A buffer transition's outcome; an illegal one (the validator rules it out) is a bug here."""
    does, error = transition
    if error is not None:
        raise RuntimeError(f"hippie-ds gradient buffer: {error}")
    return does


def split_deferred(
    params: list[torch.Tensor], layers: list, first: int, delays: StageDeferral | None, also: list[torch.Tensor] = ()
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(delayed, synchronous) parameters of a deferred stage whose layers (``forward_funcs``, the
    first at global index ``first``) are ``layers``: those of the layers ``delays`` lists (global
    indices, :class:`~hippie_ds.schedules.deferral.StageDeferral`), and ``also`` (tied weights
    another holder delays) are delayed; all of them when the stage is delayed whole (or
    ``delays`` is None)."""
    if delays is None or delays.whole:
        return params, []
    picked = {g - first for g in delays.layers}
    delayed = {
        id(p)
        for i, layer in enumerate(layers)
        if i in picked and isinstance(layer, torch.nn.Module)
        for p in layer.parameters()
    } | {id(p) for p in also}
    return [p for p in params if id(p) in delayed], [p for p in params if id(p) not in delayed]


class StageGradients:
    """One stage's gradient state: what the ``StartAllReduce``, ``WaitAllReduce``,
    ``CopyGradsToBuffer`` and ``ApplyBufferedUpdate`` handlers act on.

    It takes no optimizer step itself: :meth:`buffered_update` and :meth:`flushing` put the
    gradients in place around the step the engine takes inside them
    (:class:`~hippie_ds.adapter.precision.step.StageStep`). ``on_early_start()`` is called when the
    synced part's all-reduce starts inside a backward (the timeline marks it)."""

    def __init__(
        self,
        store: GradStore,
        stream: AllReduceStream,
        *,
        reduce: bool,
        deferred: bool,
        delayed: list[torch.Tensor],
        synced: list[torch.Tensor],
        backwards_per_call: int,
        ties: list[tuple[torch.Tensor, object]] = (),
        lagged_ties=None,
        tie_clip: float = 0.0,
        prediction=None,
        on_early_start: Callable[[], None] | None = None,
    ):
        # prediction: the deferred stage's staleness.prediction.InPlacePrediction, or None (the staleness
        # package is above this one: not imported here)
        self.store = store  # where gradients live (fp32 / bf16)
        self._stream = stream  # on CUDA a side stream (see allreduce_stream); on the CPU gloo's own threads
        self._reduce = reduce  # the stage has data-parallel peers
        self.deferred = deferred
        self.delayed, self.synced = (delayed, synced) if deferred else ([], store.params)
        self.prediction = prediction  # the deferred stage's staleness correction (None: plain delayed rule)
        self._ties = list(ties)  # (tied weight, tie group): summed over the tie group (adapter/gradients/tied.py)
        self._lagged_ties = lagged_ties  # schedules that never flush: tied.LaggedTieSums instead
        self._skip_ties = False  # the lagged tie sum's first update: the tied weights have nothing yet
        self._batch_scale = self._buffer_scale = None  # fp16 + ZeRO-1: loss scales (GradStore.rescale)
        self._tie_clip = tie_clip  # > 0: the lagged tie sum's clipping, apart from the rest (the step's is off)
        # fp16 + ZeRO-1: the lagged tie sums are clipped at the update op, once every part carries one loss
        # scale (fp16_async.AsyncVotes sets it)
        self.clip_at_update = False
        self._on_early_start = on_early_start
        self._allreduce: dict[str, tuple | None] = {"grads": None, "buffer": None}
        self._chunk_parts: list[tuple] = []  # start_chunk_allreduce's (work, flat, grads), waited with "grads"
        self._chunk_started: set[int] = set()  # ids of the parameters they cover
        self.buffer: torch.Tensor | None = None
        self.buffer_sm = GradBuffer()  # the buffer's state machine (hippie_ds.schedules.grad_buffer)
        self._early_pending: set[int] | None = None
        # the stage's whole backwards per train_batch call; the early all-reduce arms in the last
        self._backwards_per_call = backwards_per_call
        self._backwards_done = 0
        if self.delayed and self.synced:
            for p in self.synced:
                torch.Tensor.register_post_accumulate_grad_hook(p, self._on_grad_final)

    def log_delayed_share(self, stage: int) -> None:
        delayed = numel(self.delayed)
        logger.info(
            f"hippie-ds: stage {stage} applies {self.delayed_fraction():.1%} of its gradient one step late "
            f"({delayed} of {numel(self.store.params)} elements)"
        )

    def count_backwards_from_zero(self) -> None:
        """At the start of a train_batch call (the early all-reduce arms in its last backward)."""
        self._backwards_done = 0
        self._batch_scale = self.store.loss_scale  # fp16 + ZeRO-1: the scale this call's backwards use

    @contextlib.contextmanager
    def early_allreduce_window(self):
        """Around a whole backward: arms the synchronous part's early all-reduce in the stage's
        last one of the call."""
        self._backwards_done += 1
        if self.delayed and self.synced and self._backwards_done == self._backwards_per_call:
            self._early_pending = {id(p) for p in self.synced}
        try:
            yield
        finally:
            self._early_pending = None  # unused parameters: the declared start_allreduce starts it

    def delayed_fraction(self) -> float:
        """The fraction of this stage's gradient (by elements) that is applied one step late."""
        total = numel(self.store.params)
        return numel(self.delayed) / total if total else 0.0

    def _on_grad_final(self, param):
        """Post-accumulate-grad hook of a partially deferred stage's synchronous parameters."""
        if self._early_pending is None:
            return
        self.store.finalize(param)  # bf16: into the accumulator the all-reduce reads
        self._early_pending.discard(id(param))
        if not self._early_pending:
            self._early_pending = None
            if self._on_early_start is not None:
                self._on_early_start()
            self.start_allreduce("grads")

    # ------------------------------------------------------------------ gradients
    def _synced_grads(self) -> list[torch.Tensor]:
        """The gradients this step's all-reduce covers: the whole stage, or none of a deferred
        stage but its undelayed part (partial deferral)."""
        return self.store.of(self.synced if self.delayed else None)

    def _delayed_subset(self) -> list[torch.Tensor] | None:
        """The parameters a deferred stage delays; None: all of them (the whole accumulator)."""
        return self.delayed if self.synced else None

    def delayed_grads(self) -> list[torch.Tensor]:
        """The gradients a deferred stage buffers and applies one step late."""
        return self.store.of(self._delayed_subset())

    def _sum_ties(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of the tied weights among ``params`` over their tie groups (every
        copy's contribution), before the data-parallel all-reduce; blocking, in DeepSpeed's order."""
        among = {id(p) for p in params}
        for weight, group in self._ties:
            if id(weight) in among:
                dist.all_reduce(self.store.of([weight])[0], group=group)

    def start_chunk_allreduce(self, params: list[torch.Tensor]) -> None:
        """Roughly: start the data-parallel all-reduce of one model chunk's gradients (virtual
        stages: its backwards are done) while the other chunks still compute; ``start_allreduce
        ("grads")`` takes the rest, tied weights included, and ``wait_allreduce("grads")`` waits
        for both. Elementwise, so the result is the same as one all-reduce of the whole stage."""
        if not self._reduce:
            return
        tied = {id(w) for w, _ in self._ties}
        synced = {id(p) for p in self.synced}
        part = [p for p in params if id(p) in synced and id(p) not in tied and id(p) not in self._chunk_started]
        if not part:
            return
        grads = self.store.of(part)
        flat = _flatten_dense_tensors(grads)
        self._chunk_parts.append((self._stream.start(flat), flat, grads))
        self._chunk_started |= {id(p) for p in part}

    def start_allreduce(self, target: str) -> None:
        """Roughly: start the data-parallel all-reduce of ``target`` ("grads" or "buffer")."""
        if target == "grads":
            if self._allreduce["grads"] is not None:
                return  # started early, inside the last backward (_on_grad_final)
            self._sum_ties(self.synced)
            if self._lagged_ties is not None:
                self._skip_ties = not self._lagged_ties.exchange()
            grads = (
                self._synced_grads()
                if not self._chunk_started
                else self.store.of([p for p in self.synced if id(p) not in self._chunk_started])
            )
            if not grads:  # a wholly deferred stage: everything waits for the buffer
                self._allreduce["grads"] = (None, None, grads)
                return
            flat = _flatten_dense_tensors(grads)
            work = self._stream.start(flat) if self._reduce else None
            self._allreduce["grads"] = (work, flat, grads)
        elif _checked(self.buffer_sm.start(reduce=self._reduce)):
            self._allreduce["buffer"] = (self._stream.start(self.buffer), None, None)

    def wait_allreduce(self, target: str) -> None:
        if target == "grads":
            for work, flat, grads in self._chunk_parts + [self._allreduce["grads"]]:
                if work is not None:
                    self._stream.wait(work)
                    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                        grad.copy_(reduced)
            self._allreduce["grads"] = None
            self._chunk_parts, self._chunk_started = [], set()
            if self.clips_itself and not self.clip_at_update:
                self._lagged_ties.clip_apart(self._tie_clip)
            if self._skip_ties:  # after clipping: the fp32 store would materialise a skipped gradient again
                self.store.skip(self._lagged_ties.weights)
                self._skip_ties = False
        else:
            self.wait_buffer()

    @property
    def lagged_ties(self):
        """The lagged tie sums (tied.LaggedTieSums) and their clip, or None."""
        return None if self._lagged_ties is None else (self._lagged_ties, self._tie_clip)

    @property
    def clips_itself(self) -> bool:
        """True when the gradients come clipped out of ``wait_allreduce("grads")`` (a lagged tie
        sum, clipped apart): the step must not clip again."""
        return self._lagged_ties is not None and self._tie_clip > 0

    def wait_buffer(self) -> None:
        if _checked(self.buffer_sm.wait()):
            self._stream.wait(self._allreduce["buffer"][0])
            self._allreduce["buffer"] = None

    def copy_to_buffer(self) -> None:
        self._sum_ties(self.delayed)
        grads = self.delayed_grads()
        flat = flat_copy(grads)
        if self.buffer is None:
            self.buffer = flat
        else:
            self.buffer.copy_(flat)
        for g in grads:
            g.zero_()
        self._buffer_scale = self._batch_scale  # the loss scale its gradients carry (GradStore.rescale)
        _checked((None, self.buffer_sm.copy()))

    @contextlib.contextmanager
    def buffered_update(self):
        """Around ``ApplyBufferedUpdate``'s step: yields whether the step updates (True: the
        buffered gradient, and the synchronous part's, are in place inside; this step's delayed
        gradient is put back afterwards) or only advances the step counters (False)."""
        if self.prediction is not None:
            self.prediction.begin_update()  # the update applies to the true weights, not the predicted ones
        try:
            applies = _checked(self.buffer_sm.apply())
            if not applies and not self.synced and not self._steps_first:
                # First step: nothing buffered yet. Keep step counters and the LR schedule in
                # lock-step with the other stages (checkpoint tags use global_steps).
                yield False
                return
            current = flat_copy(self.delayed_grads())  # this step's delayed gradient, buffered next
            if applies:
                self.store.load(self._delayed_subset(), self.buffer)
                self.store.rescale(self._delayed_subset(), self._buffer_scale)
            else:  # first step, partial deferral (or a bf16 tie holder: _steps_first): the synchronous part
                self.store.skip(self.delayed)  # updates, the delayed part has nothing yet
            yield True
            self.store.load(self._delayed_subset(), current)
        finally:
            if self.prediction is not None:
                self.prediction.end_update()  # the update just applied: the next step's prediction

    @property
    def _steps_first(self) -> bool:
        """Whether a wholly deferred stage takes its first step (nothing buffered yet) with zero
        gradients rather than none: a holder of tied weights under bf16 or ZeRO-1. Its tie group's
        partially deferred holders (a holder added to the deferred stages delays the tied weights
        only, adapter/gradients/tied.py) step then for their synchronous part, and BF16_Optimizer (or ZeRO-1)
        steps one flat partition: their tied copy takes a zero gradient, still decays (AdamW) and advances the
        partition's step count (Adam's bias correction). Stepping every holder alike keeps the
        copies bit-identical. fp32 skips a parameter outright (``.grad`` None) on every holder."""
        return bool(self._ties) and self.store.flat

    # ------------------------------------------------------------------ deferred state
    def has_pending_update(self) -> bool:
        """True when this stage holds a buffered gradient not yet applied."""
        return self.buffer_sm.pending

    @contextlib.contextmanager
    def flushing(self):
        """Around ``drain()``'s step of the buffered gradient (a collective of the stage's
        data-parallel group; the step leaves the counters still): yields whether there is one to
        apply, in place inside."""
        if not self.buffer_sm.pending:
            yield False
            return
        if self.buffer_sm.state == FILLED:
            self.start_allreduce("buffer")
        self.wait_buffer()
        _checked(self.buffer_sm.apply())
        if self.prediction is not None:
            self.prediction.begin_update()
        self.store.load(self._delayed_subset(), self.buffer)
        self.store.rescale(self._delayed_subset(), self._buffer_scale)
        self.store.skip(self.synced)  # applied in their own step already
        unmoved = self.store.unmoved(self.synced)  # a flat step would move them too
        yield True
        if unmoved is not None:
            unmoved.restore()
        if self.prediction is not None:
            self.prediction.end_update()

    # ------------------------------------------------------------------ checkpoints
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the stage keeps between calls beside its parameters' gradients, by kind, uncopied and
        with no collective (a memory probe's view; :meth:`state_dict` reduces and copies)."""
        return {
            "gradient_buffer": [] if self.buffer is None else [self.buffer],
            "tie_sums": [] if self._lagged_ties is None else self._lagged_ties.held_tensors(),
            "prediction": [] if self.prediction is None else self.prediction.held_tensors(),
        }

    def state_dict(self) -> dict:
        """The buffer, reduced first (each replica holds its own part until then; identical on
        every replica afterwards), and its state."""
        if self.buffer_sm.state == FILLED:
            self.start_allreduce("buffer")
        self.wait_buffer()
        empty = self.buffer_sm.state == "empty" or self.buffer is None  # a spare buffer is not state
        return {
            "state": self.buffer_sm.state,
            "buffer": None if empty else self.buffer.clone(),
            "scale": self._buffer_scale,
            "tie_sums": None if self._lagged_ties is None else self._lagged_ties.state_dict(),
        }

    def load_state_dict(self, state: dict, device) -> None:
        self.buffer_sm.state = state["state"]
        # an empty buffer is re-allocated at this layout's size on first use
        self.buffer = None if state["buffer"] is None else state["buffer"].to(device)
        self._buffer_scale = state.get("scale")  # fp16 + ZeRO-1: the loss scale the buffer carries
        if self._lagged_ties is not None:  # a checkpoint without them: the lag restarts (nothing applied first)
            self._lagged_ties.load_state_dict(state.get("tie_sums"), device)
