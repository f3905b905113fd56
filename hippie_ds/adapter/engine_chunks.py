"""Virtual stages in ``HippiePipelineEngine``: before each op of a model chunk the engine selects
that chunk (:class:`ChunkSelection`), so DeepSpeed's own handlers run on it unchanged:

* the module runs the chunk's layers (``hippie_ds.PipelineModule.set_chunk``);
* ``is_first_stage()`` / ``is_last_stage()`` mean the first / last model part (loads, the loss,
  bf16's gradient hand-off), outside ops DeepSpeed's meaning (the loss broadcast);
* ``next_stage`` / ``prev_stage`` are the chunk's neighbours in the layout (the interleaved
  layout's last stage sends to the first over DeepSpeed's wrap-around p2p);
* DeepSpeed's per-engine p2p state (activation shape handshake, receive buffers) is kept per
  chunk: each chunk boundary has its own shapes;
* gradients travel with their own tag (:data:`GRADIENT_TAG`): a stage pair's link can carry
  activations and gradients in each direction, in different orders (the V, interleaved at K=2),
  and DeepSpeed's p2p matches messages in order per (peer, tag); the validator models it so
  (``schedules.deadlock.link_of``);
* a hand-over between two chunks of one stage (the V's turn at the last stage) is local: the
  tensors go through a queue, as if sent and received (a receive gives a contiguous tensor);
* the V's first stage holds the first and the last part: it reads the data iterator once per
  micro-batch (the labels' load takes what the inputs' load read) and computes the loss
  (``_loss_stage_global_rank``).

``eval_batch`` runs :func:`hippie_ds.schedules.compiler.inference_stream` instead of DeepSpeed's
``InferenceSchedule``, which knows one part per stage.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
from deepspeed import comm as _dist
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..schedules.compiler import inference_stream

# PipelineEngine attributes describing one p2p boundary (reset_activation_shape's list)
_P2P_STATE = {"first_output_send": True, "pipe_recv_buf": None, "grad_layer": None, "meta_buffer": None,
              "pipe_partition_input_meta_cache": None, "pipe_partition_output_meta_cache": None,
              "pipe_partition_grad_meta_cache": None, "grad_partition_grad_layer_meta_cache": None}


GRADIENT_TAG = 1  # gradients' p2p tag under virtual stages (activations keep DeepSpeed's 0)


class _TaggedComm:
    """``deepspeed.comm`` as DeepSpeed's p2p module calls it, with every send and receive tagged."""

    def __init__(self, tag: int):
        self._tag = tag

    def send(self, tensor, dst, **kw):
        return _dist.send(tensor, dst, tag=self._tag, **kw)

    def recv(self, tensor, src=None, **kw):
        return _dist.recv(tensor, src, tag=self._tag, **kw)

    def __getattr__(self, name):
        return getattr(_dist, name)


@contextlib.contextmanager
def _gradient_tag():
    """DeepSpeed's p2p functions send and receive with :data:`GRADIENT_TAG` inside."""
    p2p.dist = _TaggedComm(GRADIENT_TAG)
    try:
        yield
    finally:
        p2p.dist = _dist


class ChunkSelection:
    """Mixin of ``HippiePipelineEngine``; ``_init_chunk_selection`` after DeepSpeed's ``__init__``."""

    _chunk = None  # the chunk selected; None outside ops (and always with one chunk per stage)

    _layout = None  # set after DeepSpeed's __init__ (which asks is_first_stage with its own meaning)
    _chunked = False

    def _init_chunk_selection(self, compiled) -> None:
        self._layout = compiled.layout
        self._chunked = compiled.virtual_stages > 1
        self._chunk_p2p: dict[int, dict] = {}
        self._stock_neighbours = (self.prev_stage, self.next_stage)
        self._local = {"activation": deque(), "gradient": deque()}  # hand-overs between own chunks
        self._both_ends = self._chunked and self._layout.holds_first(self.stage_id) and \
            self._layout.holds_last(self.stage_id)
        self._read_batches = deque()  # the V's first stage: batches read for inputs, awaiting labels

    # Outside ops, a stage with chunks is first / last when it holds the first / last part;
    # without chunks (and during DeepSpeed's __init__), DeepSpeed's meaning.
    def is_first_stage(self):
        if self._chunk is not None:
            return self._layout.is_first(self.stage_id, self._chunk)
        return self._layout.holds_first(self.stage_id) if self._chunked else super().is_first_stage()

    def is_last_stage(self):
        if self._chunk is not None:
            return self._layout.is_last(self.stage_id, self._chunk)
        return self._layout.holds_last(self.stage_id) if self._chunked else super().is_last_stage()

    def _loss_stage_global_rank(self):
        if not self._chunked:
            return super()._loss_stage_global_rank()
        return self.grid.stage_to_global(self._layout.place(self._layout.parts - 1)[0])

    def _next_batch(self):
        if not self._both_ends or self._chunk is None:
            return super()._next_batch()
        if self.is_first_stage():  # the inputs' load reads; the labels' load of the same micro-batch reuses it
            batch = super()._next_batch()
            self._read_batches.append(batch)
            return batch
        return self._read_batches.popleft()

    # -- p2p: tags and local hand-overs ------------------------------------------------------
    def _local_peer(self, stage: int) -> bool:
        return self._chunked and stage == self.stage_id

    def _exec_send_activations_chunked(self, buffer_id):
        if self._local_peer(self.next_stage):
            self._local["activation"].append(self.pipe_buffers["outputs"][buffer_id])
        else:
            PipelineEngine._exec_send_activations(self, buffer_id)

    def _exec_isend_activations_chunked(self, buffer_id):
        if self._local_peer(self.next_stage):
            self._local["activation"].append(self.pipe_buffers["outputs"][buffer_id])
        else:
            self._exec_isend_activations(buffer_id)

    def _exec_recv_activations_chunked(self, buffer_id):
        if not self._local_peer(self.prev_stage):
            return PipelineEngine._exec_recv_activations(self, buffer_id)

        def received(t):  # as DeepSpeed receives: a fresh contiguous leaf, requiring grad when floating point
            out = t.detach().clone(memory_format=torch.contiguous_format)
            out.requires_grad_(out.is_floating_point())
            return out
        sent = self._local["activation"].popleft()
        self.pipe_buffers["inputs"][buffer_id] = received(sent) if torch.is_tensor(sent) else \
            tuple(received(t) for t in sent)

    def _local_input_grads(self, buffer_id):
        inputs = self.pipe_buffers["inputs"][buffer_id]

        def received(grad):  # as DeepSpeed receives into grad_layer: contiguous
            return self._not_receive_buffer(grad).contiguous()
        grads = received(inputs.grad) if torch.is_tensor(inputs) else \
            [received(t.grad) for t in inputs if t.is_floating_point()]
        self._local["gradient"].append(grads)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_send_grads_chunked(self, buffer_id):
        if self._local_peer(self.prev_stage):
            return self._local_input_grads(buffer_id)
        with self._tag_gradients():
            PipelineEngine._exec_send_grads(self, buffer_id)

    def _exec_isend_grads_chunked(self, buffer_id):
        if self._local_peer(self.prev_stage):
            return self._local_input_grads(buffer_id)
        with self._tag_gradients():
            self._exec_isend_grads(buffer_id)

    def _exec_recv_grads_chunked(self, buffer_id):
        if self._local_peer(self.next_stage):
            self.grad_layer = self._local["gradient"].popleft()
            return
        with self._tag_gradients():
            PipelineEngine._exec_recv_grads(self, buffer_id)

    def _tag_gradients(self):
        return _gradient_tag() if self._chunked else contextlib.nullcontext()

    def _p2p_tag(self) -> int:
        """The tag of a send issued now (``_isend``)."""
        return GRADIENT_TAG if p2p.dist is not _dist else 0

    def _select_chunk(self, chunk: int | None) -> None:
        """Make ``chunk`` the one DeepSpeed's handlers act on (None: the stage as DeepSpeed sees it)."""
        if not self._chunked or chunk == self._chunk:
            return
        if self._chunk is not None:
            self._chunk_p2p[self._chunk] = {name: getattr(self, name) for name in _P2P_STATE}
        if chunk is None:
            self.prev_stage, self.next_stage = self._stock_neighbours
        else:
            for name, value in self._chunk_p2p.get(chunk, _P2P_STATE).items():
                setattr(self, name, value)
            nxt, prv = self._layout.next(self.stage_id, chunk), self._layout.prev(self.stage_id, chunk)
            self.next_stage = nxt[0] if nxt else self._stock_neighbours[1]
            self.prev_stage = prv[0] if prv else self._stock_neighbours[0]
        self._chunk = chunk
        self.module.set_chunk(chunk)

    def reset_activation_shape(self):
        self._chunk_p2p = {}
        super().reset_activation_shape()

    def _inference_schedule(self, micro_batches):
        if not self._chunked:
            return super()._inference_schedule(micro_batches)
        from .instructions import OpSchedule
        return OpSchedule(inference_stream(self._layout, self.stage_id, micro_batches), micro_batches,
                          self.num_stages, self.stage_id, num_buffers=2)
