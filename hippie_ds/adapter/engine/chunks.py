"""Virtual stages in ``HippiePipelineEngine``: the engine's overrides of DeepSpeed's methods
(:class:`ChunkedEngine`), reading one :class:`~hippie_ds.adapter.engine.chunk_selector.ChunkSelector`
(``engine._chunks``) that holds every per-chunk state. Before each op of a model chunk the
engine selects that chunk, so DeepSpeed's own handlers run on it unchanged:

* the module runs the chunk's layers (``hippie_ds.PipelineModule.set_chunk``);
* ``is_first_stage()`` / ``is_last_stage()`` mean the first / last model part (loads, the loss,
  bf16's gradient hand-off), outside ops DeepSpeed's meaning (the loss broadcast);
* ``next_stage`` / ``prev_stage`` are the chunk's neighbours in the layout (the interleaved
  layout's last stage sends to the first over DeepSpeed's wrap-around p2p);
* DeepSpeed's per-engine p2p state (activation shape handshake, receive buffers) is kept per
  chunk: each chunk boundary has its own shapes;
* gradients travel with their own tag (:data:`~hippie_ds.adapter.engine.chunk_selector.GRADIENT_TAG`),
  sent and received by hippie's handlers here through
  :mod:`~hippie_ds.adapter.engine.chunk_selector`'s tagged p2p (DeepSpeed's own send no tag);
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

import torch
from ..ds import engine as ds_engine

from ...schedules.compiler import inference_stream
from . import chunk_selector as chunk_p2p
from .chunk_selector import ChunkSelector
from ..precision.layout_clip import clip_like_one_chunk


class ChunkedEngine:
    """Mixin of ``HippiePipelineEngine``: DeepSpeed's methods that virtual stages change, each
    asking ``self._chunks`` (made by :meth:`_init_chunks` after DeepSpeed's ``__init__``, which
    asks ``is_first_stage`` with its own meaning)."""

    _chunks: ChunkSelector | None = None

    def _init_chunks(self, compiled) -> None:
        self._chunks = ChunkSelector(self, compiled.layout, compiled.virtual_stages)

    def is_first_stage(self):
        first = None if self._chunks is None else self._chunks.is_first()
        return super().is_first_stage() if first is None else first

    def is_last_stage(self):
        last = None if self._chunks is None else self._chunks.is_last()
        return super().is_last_stage() if last is None else last

    def _chunked(self) -> bool:
        return self._chunks is not None and self._chunks.chunked  # DeepSpeed's __init__ runs before _init_chunks

    def clip_fp32_gradients(self):
        # DeepSpeed's OptimizerStep (the pipeline-wide norm; a per-stage step swaps in its own mpu):
        # 1F1B's clip coefficient, whatever the layout (layout_clip.py)
        if self._chunked() and getattr(self.module, "one_chunk_parts", None) and self.mpu is self.grid:
            return clip_like_one_chunk(self, self.gradient_clipping())
        return super().clip_fp32_gradients()

    def _loss_stage_global_rank(self):
        if not self._chunked():
            return super()._loss_stage_global_rank()
        return self.grid.stage_to_global(self._chunks.loss_stage())

    def _next_batch(self):
        chunks = self._chunks
        if chunks is None or not chunks.both_ends or chunks.chunk is None:
            return super()._next_batch()
        # the inputs' load reads; the labels' load of the same micro-batch reuses it
        return chunks.read(super()._next_batch()) if self.is_first_stage() else chunks.reread()

    def reset_activation_shape(self):
        if self._chunks is not None:
            self._chunks.forget_shapes()
        super().reset_activation_shape()

    def _inference_schedule(self, micro_batches):
        if not self._chunked():
            return super()._inference_schedule(micro_batches)
        from .instructions import OpSchedule
        return OpSchedule(inference_stream(self._chunks.layout, self.stage_id, micro_batches), micro_batches,
                          self.num_stages, self.stage_id, num_buffers=2)

    # -- activations: local hand-overs ---------------------------------------------------------
    def _exec_send_activations_chunked(self, buffer_id):
        if self._chunks.local(self.next_stage):
            self._chunks.hand_over("activation", self.pipe_buffers["outputs"][buffer_id])
        else:
            ds_engine.stock_send_activations(self, buffer_id)

    def _exec_isend_activations_chunked(self, buffer_id):
        if self._chunks.local(self.next_stage):
            self._chunks.hand_over("activation", self.pipe_buffers["outputs"][buffer_id])
        else:
            self._exec_isend_activations(buffer_id)

    def _exec_recv_activations_chunked(self, buffer_id):
        if not self._chunks.local(self.prev_stage):
            return ds_engine.stock_recv_activations(self, buffer_id)

        def received(t):  # as DeepSpeed receives: a fresh contiguous leaf, requiring grad when floating point
            out = torch.Tensor.clone(torch.Tensor.detach(t), memory_format=torch.contiguous_format)
            out.requires_grad_(out.is_floating_point())
            return out
        sent = self._chunks.take("activation")
        self.pipe_buffers["inputs"][buffer_id] = received(sent) if torch.is_tensor(sent) else \
            tuple(received(t) for t in sent)

    # -- gradients: tagged, or local hand-overs --------------------------------------------------
    def _input_grads(self, buffer_id) -> list:
        """The gradients of micro-batch ``buffer_id``'s inputs that go to the previous stage, in
        DeepSpeed's order (``_exec_send_grads``: the attention mask and integer inputs have none)."""
        inputs = self.pipe_buffers["inputs"][buffer_id]
        if torch.is_tensor(inputs):
            assert inputs.grad is not None
            return [inputs.grad]
        if self.has_attention_mask or self.has_bool_tensors:
            inputs = tuple(inputs[:-1])
        grads = []
        for tensor in inputs:
            if not torch.Tensor.is_floating_point(tensor):
                assert tensor.grad is None
                continue
            assert tensor.grad is not None
            grads.append(tensor.grad)
        return grads

    def _local_input_grads(self, buffer_id):
        inputs = self.pipe_buffers["inputs"][buffer_id]

        def received(grad):  # as DeepSpeed receives into grad_layer: contiguous
            return self._not_receive_buffer(grad).contiguous()
        grads = received(inputs.grad) if torch.is_tensor(inputs) else \
            [received(t.grad) for t in inputs if torch.Tensor.is_floating_point(t)]
        self._chunks.hand_over("gradient", grads)
        self.pipe_buffers["inputs"][buffer_id] = None

    @contextlib.contextmanager
    def _timed(self, name: str):
        timed = self.wall_clock_breakdown()
        if timed:
            self.timers(name).start()
        yield
        if timed:
            self.timers(name).stop()

    def _exec_send_grads_chunked(self, buffer_id):
        if self._chunks.local(self.prev_stage):
            return self._local_input_grads(buffer_id)
        if not self._chunks.chunked:
            return ds_engine.stock_send_grads(self, buffer_id)
        with self._timed(ds_engine.PIPE_SEND_GRAD_TIMER):  # DeepSpeed's _exec_send_grads, tagged
            for grad in self._input_grads(buffer_id):
                chunk_p2p.send(self.grid, grad, self.prev_stage, self._chunks.gradient_tag)
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_isend_grads_chunked(self, buffer_id):
        if self._chunks.local(self.prev_stage):
            return self._local_input_grads(buffer_id)
        self._exec_isend_grads(buffer_id)

    def _exec_recv_grads_chunked(self, buffer_id):
        if self._chunks.local(self.next_stage):
            ds_engine.set_received_gradient(self, self._chunks.take("gradient"))
            return
        if not self._chunks.chunked:
            return ds_engine.stock_recv_grads(self, buffer_id)
        with self._timed(ds_engine.PIPE_RECV_GRAD_TIMER):  # DeepSpeed's _exec_recv_grads (not partitioned), tagged
            grad_layer = ds_engine.receive_buffers(self, self.pipe_buffers["outputs"][buffer_id])
            for buffer in (grad_layer, ) if torch.is_tensor(grad_layer) else grad_layer:
                chunk_p2p.recv(self.grid, buffer, self.next_stage, self._chunks.gradient_tag)
