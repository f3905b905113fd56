"""Gradient reduction and the deferred update of a ``HippiePipelineEngine`` stage: the async
per-stage all-reduce, the gradient buffer of deferred stages (applied one step late, with the
``hippie.staleness`` correction), partial deferral (``hippie.deferred_layers``) and the flush.

Buffer states: empty -> filled (copy_grads_to_buffer) -> reducing (start_allreduce(buffer)) ->
reduced (wait_allreduce(buffer)) -> empty (apply_buffered_update). A deferred stage delays the
gradient of ``_delayed_params`` (all its parameters, or with partial deferral those of its first
layers); ``_synced_params`` are all-reduced and applied in-step, their all-reduce started inside
the stage's last backward once their gradients are final (the delayed layers come later in
backward); the declared ``start_allreduce(grads)`` then finds it in flight. Every gradient is
read and written through :class:`~hippie_ds.adapter.grad_store.GradStore` (fp32: ``.grad``; bf16
and bf16 + ZeRO-1: BF16_Optimizer's accumulator).
"""
from __future__ import annotations

import contextlib
import time

import torch
from deepspeed.utils import logger
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..schedules.grad_buffer import FILLED, GradBuffer
from ..schedules.ir import WHOLE_BACKWARD_KINDS, CompiledSchedule
from .allreduce_stream import AllReduceStream
from .grad_store import GradStore
from .staleness import make_corrector


def _checked(transition: tuple[bool, str | None]) -> bool:
    """A buffer transition's outcome; an illegal one (the validator rules it out) is a bug here."""
    does, error = transition
    if error is not None:
        raise RuntimeError(f"hippie-ds gradient buffer: {error}")
    return does


class GradientsMixin:
    """The engine's gradient state and handlers (``StartAllReduce``, ``WaitAllReduce``,
    ``CopyGradsToBuffer``, ``ApplyBufferedUpdate``)."""

    def _init_gradients(self, compiled: CompiledSchedule, staleness, deferred_layers: dict[int, int] | None) -> None:
        self._allreduce: dict[str, tuple | None] = {"grads": None, "buffer": None}
        # on CUDA a side stream (see allreduce_stream); on the CPU gloo's own threads
        self._allreduce_stream = AllReduceStream(self.device, self.grid.get_data_parallel_group(), self.dp_world_size)
        self._grad_buffer: torch.Tensor | None = None
        self._buffer_sm = GradBuffer()  # the buffer's state machine (hippie_ds.schedules.grad_buffer)
        self._grads = GradStore(self.optimizer, self._version_params())  # where gradients live (fp32 / bf16)
        deferred = not compiled.continuous and self.stage_id in compiled.deferred_stages()
        self._delayed_params, self._synced_params = self._split_deferred(
            (deferred_layers or {}).get(self.stage_id)) if deferred else ([], self._version_params())
        self._early_pending: set[int] | None = None
        # the stage's whole backwards per train_batch call; the early all-reduce arms in the last
        self._backwards_per_call = sum(op.kind in WHOLE_BACKWARD_KINDS for op in compiled.ops(self.stage_id))
        self._backwards_done = 0
        if self._delayed_params and self._synced_params:
            for p in self._synced_params:
                p.register_post_accumulate_grad_hook(self._on_grad_final)
        if deferred and self.grid.data_parallel_id == 0:
            delayed = sum(p.numel() for p in self._delayed_params)
            logger.info(f"hippie-ds: stage {self.stage_id} applies {self.delayed_fraction():.1%} of its gradient one "
                        f"step late ({delayed} of {sum(p.numel() for p in self._version_params())} elements)")
        # staleness correction of a deferred stage (None: the plain one-step-delayed rule)
        self._corrector = None
        if staleness is not None and deferred and self._delayed_params:
            self._corrector = make_corrector(staleness, self._delayed_params)

    def _count_backwards_from_zero(self) -> None:
        """At the start of a train_batch call (the early all-reduce arms in its last backward)."""
        self._backwards_done = 0

    @contextlib.contextmanager
    def _early_allreduce_window(self):
        """Around a whole backward: arms the synchronous part's early all-reduce in the stage's
        last one of the call."""
        self._backwards_done += 1
        if self._delayed_params and self._synced_params and self._backwards_done == self._backwards_per_call:
            self._early_pending = {id(p) for p in self._synced_params}
        try:
            yield
        finally:
            self._early_pending = None  # unused parameters: the declared start_allreduce starts it

    def _split_deferred(self, layers: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(delayed, synchronous) parameters of this deferred stage: those of its first ``layers``
        layers are delayed (all of them when ``layers`` is None)."""
        params = self._version_params()
        if layers is None:
            return params, []
        delayed = {id(p) for i, layer in enumerate(self.module.forward_funcs) if i < layers and
                   isinstance(layer, torch.nn.Module) for p in layer.parameters()}
        return [p for p in params if id(p) in delayed], [p for p in params if id(p) not in delayed]

    def delayed_fraction(self) -> float:
        """The fraction of this stage's gradient (by elements) that is applied one step late."""
        total = sum(p.numel() for p in self._version_params())
        return sum(p.numel() for p in self._delayed_params) / total if total else 0.0

    def _on_grad_final(self, param):
        """Post-accumulate-grad hook of a partially deferred stage's synchronous parameters."""
        if self._early_pending is None:
            return
        self._grads.finalize(param)  # bf16: into the accumulator the all-reduce reads
        self._early_pending.discard(id(param))
        if not self._early_pending:
            self._early_pending = None
            if self._timeline_dir is not None and self._training:
                self._inflight["grads"] = time.perf_counter()
            self._exec_start_allreduce("grads")

    # ------------------------------------------------------------------ gradients
    def _synced_grads(self) -> list[torch.Tensor]:
        """The gradients this step's all-reduce covers: the whole stage, or none of a deferred
        stage but its undelayed part (partial deferral)."""
        return self._grads.of(self._synced_params if self._delayed_params else None)

    def _delayed_subset(self) -> list[torch.Tensor] | None:
        """The parameters a deferred stage delays; None: all of them (the whole accumulator)."""
        return self._delayed_params if self._synced_params else None

    def _delayed_grads(self) -> list[torch.Tensor]:
        """The gradients a deferred stage buffers and applies one step late."""
        return self._grads.of(self._delayed_subset())

    def _exec_start_allreduce(self, target):
        if target == "grads":
            if self._allreduce["grads"] is not None:
                return  # started early, inside the last backward (_on_grad_final)
            grads = self._synced_grads()
            if not grads:  # a wholly deferred stage: everything waits for the buffer
                self._allreduce["grads"] = (None, None, grads)
                return
            flat = _flatten_dense_tensors(grads)
            work = self._allreduce_stream.start(flat) if self.is_data_parallel else None
            self._allreduce["grads"] = (work, flat, grads)
        elif _checked(self._buffer_sm.start(reduce=self.is_data_parallel)):
            self._allreduce["buffer"] = (self._allreduce_stream.start(self._grad_buffer), None, None)

    def _exec_wait_allreduce(self, target):
        if target == "grads":
            work, flat, grads = self._allreduce["grads"]
            if work is not None:
                self._allreduce_stream.wait(work)
                for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    grad.copy_(reduced)
            self._allreduce["grads"] = None
        else:
            self._wait_buffer()

    def _wait_buffer(self):
        if _checked(self._buffer_sm.wait()):
            self._allreduce_stream.wait(self._allreduce["buffer"][0])
            self._allreduce["buffer"] = None

    def _exec_copy_grads_to_buffer(self):
        grads = self._delayed_grads()
        flat = _flatten_dense_tensors(grads)
        if self._grad_buffer is None:
            self._grad_buffer = flat
        else:
            self._grad_buffer.copy_(flat)
        for g in grads:
            g.zero_()
        _checked((None, self._buffer_sm.copy()))

    def _exec_apply_buffered_update(self):
        if self._corrector is not None:
            self._corrector.restore()  # the update applies to the true weights, not the predicted ones
        applies = _checked(self._buffer_sm.apply())
        if not applies and not self._synced_params:
            # First step: nothing buffered yet. Keep step counters and the LR schedule in
            # lock-step with the other stages (checkpoint tags use global_steps).
            self._stage_step(apply=False)
            return
        current = _flatten_dense_tensors(self._delayed_grads())  # this step's delayed gradient, buffered next
        if applies:
            self._grads.load(self._delayed_subset(), self._grad_buffer)
        else:  # partial deferral, first step: the synchronous part updates, the delayed part has nothing yet
            self._grads.skip(self._delayed_params)
        self._stage_step(apply=True)
        self._grads.load(self._delayed_subset(), current)

    # ------------------------------------------------------------------ deferred state
    def has_pending_update(self) -> bool:
        """True when this stage holds a buffered gradient not yet applied."""
        return self._buffer_sm.pending

    @property
    def _grad_buffer_state(self) -> str:
        """The buffer's state name (checkpoints save and restore it)."""
        return self._buffer_sm.state

    @_grad_buffer_state.setter
    def _grad_buffer_state(self, state: str) -> None:
        self._buffer_sm.state = state

    def flush_deferred_update(self):
        """Apply the buffered gradient of the last step now (call once at the end of training
        on every rank: its all-reduce is a collective of the stage's data-parallel group).
        Step counters and the LR schedule do not advance."""
        if self._continuous:  # 2bw / pipedream: what is pending is the batches in flight
            return self.drain()
        if not self._buffer_sm.pending:
            return False
        if self._buffer_sm.state == FILLED:
            self._exec_start_allreduce("buffer")
        self._wait_buffer()
        _checked(self._buffer_sm.apply())
        self._grads.load(self._delayed_subset(), self._grad_buffer)
        self._grads.skip(self._synced_params)  # applied in their own step already
        self._stage_step_without_counters()
        return True
