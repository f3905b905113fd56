"""The engine's p2p handlers (:class:`P2PHandlers`, a part of ``HippiePipelineEngine``): non-blocking
sends, and virtual stages' sends and receives (tagged gradients, local hand-overs between a stage's
own chunks). Every p2p path runs here and goes down only: to
:mod:`~hippie_ds.adapter.engine.chunk_selector` (the chunk's neighbours, the tagged p2p, the
hand-over queues), to :mod:`~hippie_ds.adapter.gradients.split_backward` (a gradient that shares
the received buffer, copied) and to the seam (:mod:`hippie_ds.adapter.ds.engine`). An ``ISendGrad``:
:meth:`P2PHandlers._exec_isend_grads_chunked` -> :meth:`~P2PHandlers._exec_isend_grads` ->
:meth:`~P2PHandlers._input_grads`, :meth:`~P2PHandlers._not_receive_buffer` -> :meth:`~P2PHandlers._isend`
-> ``chunk_selector.isend``."""
from __future__ import annotations

import contextlib

import torch

from ..ds import engine as ds_engine
from ..gradients.split_backward import copy_if_shared, storages_of
from . import chunk_selector as chunk_p2p


class P2PHandlers:
    """Mixin of ``HippiePipelineEngine``: the handlers of the p2p instructions (their names are
    ``OP_INFO``'s ``handler``s, DeepSpeed's ``_INSTRUCTION_MAP`` calls them) and what they share.
    Reads the engine's ``_chunks`` (a ``ChunkSelector``) and ``_pending_sends``."""

    # ------------------------------------------------------------------ non-blocking sends
    def _isend(self, tensor, stage, tag=chunk_p2p.ACTIVATION_TAG):
        # Keep the tensor with its work handle: the buffer slot may be reused before completion.
        # A detached alias (same storage): an output the split backward cannot detach in place
        # (a view) must not keep its micro-batch's graph alive until the sends are waited for.
        work = chunk_p2p.isend(self.grid, tensor, stage, tag)
        self._pending_sends.append((work, torch.Tensor.detach(tensor)))

    def _exec_isend_activations(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.has_attention_mask or self.has_bool_tensors:
            outputs = tuple(outputs[:-1]) + (torch.Tensor.half(outputs[-1]), )
        ds_engine.send_meta_once(self, outputs)  # DeepSpeed's shape handshake, before the first send
        for tensor in (outputs, ) if torch.is_tensor(outputs) else outputs:
            self._isend(tensor, self.next_stage)

    def _exec_isend_grads(self, buffer_id):
        for grad in self._input_grads(buffer_id):  # DeepSpeed's choice of gradients
            self._isend(self._not_receive_buffer(grad), self.prev_stage, self._chunks.gradient_tag)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _not_receive_buffer(self, grad):
        """``grad``, copied when it shares memory with DeepSpeed's reused received-gradient buffer:
        autograd passes a gradient on without a copy through views and identities, so a stage whose
        input reaches its output through such ops alone has the received gradient as its input's;
        sent without blocking (or handed to another chunk), the next receive would overwrite it."""
        return copy_if_shared(grad, storages_of(ds_engine.receive_buffer_tensors(self)))

    def _exec_wait_sends(self):
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

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

    # ------------------------------------------------------------------ virtual stages: activations
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

    # ------------------------------------------------------------------ virtual stages: gradients
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
