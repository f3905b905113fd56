"""The p2p ops' handlers (:data:`~hippie_ds.adapter.stage.handlers.HANDLERS` entries): non-blocking sends,
and virtual stages' sends and receives (tagged gradients, local hand-overs between a stage's own
chunks). Each takes the stage's :class:`~hippie_ds.adapter.stage.runtime.StageRuntime` and its
instruction's arguments. Every p2p path runs here and goes down only: to
:mod:`~hippie_ds.adapter.stage.chunk_selector` (the chunk's neighbours, the tagged p2p, the hand-over
queues), to :mod:`~hippie_ds.adapter.gradients.split_backward` (a gradient that shares the received
buffer, copied) and to DeepSpeed's side of the stage (:class:`~hippie_ds.adapter.ds.stage.DeepSpeedStage`).
An ``ISendGrad``: :func:`isend_grads_chunked` -> :func:`isend_grads` -> :func:`input_grads`,
:func:`not_receive_buffer` -> :func:`_isend` -> ``chunk_selector.isend``."""

from __future__ import annotations

import torch

from ..gradients.split_backward import copy_if_shared, storages_of
from . import chunk_selector as chunk_p2p


# ------------------------------------------------------------------ non-blocking sends
def _isend(rt, tensor, stage, tag=chunk_p2p.ACTIVATION_TAG):
    # Keep the tensor with its work handle: the buffer slot may be reused before completion.
    # A detached alias (same storage): an output the split backward cannot detach in place
    # (a view) must not keep its micro-batch's graph alive until the sends are waited for.
    work = chunk_p2p.isend(rt.ds.grid, tensor, stage, tag)
    rt.pending_sends.append((work, torch.Tensor.detach(tensor)))


def isend_activations(rt, buffer_id):
    """Roughly: ``isend(buffers['outputs'][buf])`` to the next stage, after DeepSpeed's shape handshake."""
    outputs = rt.ds.pipe_buffers["outputs"][buffer_id]
    if rt.ds.masked_inputs:
        outputs = tuple(outputs[:-1]) + (torch.Tensor.half(outputs[-1]),)
    rt.ds.send_meta_once(outputs)  # DeepSpeed's shape handshake, before the first send
    for tensor in (outputs,) if torch.is_tensor(outputs) else outputs:
        _isend(rt, tensor, rt.ds.next_stage)


def isend_grads(rt, buffer_id):
    """Roughly: ``isend(buffers['inputs'][buf].grad)`` to the previous stage."""
    for grad in input_grads(rt, buffer_id):  # DeepSpeed's choice of gradients
        _isend(rt, not_receive_buffer(rt, grad), rt.ds.prev_stage, rt.chunks.gradient_tag)
    rt.ds.pipe_buffers["inputs"][buffer_id] = None


def not_receive_buffer(rt, grad):
    """``grad``, copied when it shares memory with DeepSpeed's reused received-gradient buffer:
    autograd passes a gradient on without a copy through views and identities, so a stage whose
    input reaches its output through such ops alone has the received gradient as its input's;
    sent without blocking (or handed to another chunk), the next receive would overwrite it."""
    return copy_if_shared(grad, storages_of(rt.ds.receive_buffer_tensors()))


def wait_sends(rt):
    """Roughly: ``work.wait()`` for every non-blocking send this stage issued."""
    for work, _ in rt.pending_sends:
        work.wait()
    rt.pending_sends.clear()


def input_grads(rt, buffer_id) -> list:
    """The gradients of micro-batch ``buffer_id``'s inputs that go to the previous stage, in
    DeepSpeed's order (``_exec_send_grads``: the attention mask and integer inputs have none)."""
    inputs = rt.ds.pipe_buffers["inputs"][buffer_id]
    if torch.is_tensor(inputs):
        assert inputs.grad is not None
        return [inputs.grad]
    if rt.ds.masked_inputs:
        inputs = tuple(inputs[:-1])
    grads = []
    for tensor in inputs:
        if not torch.Tensor.is_floating_point(tensor):
            assert tensor.grad is None
            continue
        assert tensor.grad is not None
        grads.append(tensor.grad)
    return grads


# ------------------------------------------------------------------ activations, chunk by chunk
def send_activations_chunked(rt, buffer_id):
    """Roughly: DeepSpeed's ``SendActivation``; a hand-over when the next part is this stage's own chunk."""
    if rt.chunks.local(rt.ds.next_stage):
        rt.chunks.hand_over("activation", rt.ds.pipe_buffers["outputs"][buffer_id])
    else:
        rt.ds.send_activations(buffer_id)


def isend_activations_chunked(rt, buffer_id):
    """Roughly: :func:`isend_activations`; a hand-over when the next part is this stage's own chunk."""
    if rt.chunks.local(rt.ds.next_stage):
        rt.chunks.hand_over("activation", rt.ds.pipe_buffers["outputs"][buffer_id])
    else:
        isend_activations(rt, buffer_id)


def recv_activations_chunked(rt, buffer_id):
    """Roughly: DeepSpeed's ``RecvActivation``; from the queue when the previous part is this stage's own chunk."""
    if not rt.chunks.local(rt.ds.prev_stage):
        return rt.ds.recv_activations(buffer_id)

    def received(t):  # as DeepSpeed receives: a fresh contiguous leaf, requiring grad when floating point
        out = torch.Tensor.clone(torch.Tensor.detach(t), memory_format=torch.contiguous_format)
        out.requires_grad_(out.is_floating_point())
        return out

    sent = rt.chunks.take("activation")
    rt.ds.pipe_buffers["inputs"][buffer_id] = (
        received(sent) if torch.is_tensor(sent) else tuple(received(t) for t in sent)
    )


# ------------------------------------------------------------------ gradients, chunk by chunk
def _local_input_grads(rt, buffer_id):
    inputs = rt.ds.pipe_buffers["inputs"][buffer_id]

    def received(grad):  # as DeepSpeed receives into grad_layer: contiguous
        return not_receive_buffer(rt, grad).contiguous()

    grads = (
        received(inputs.grad)
        if torch.is_tensor(inputs)
        else [received(t.grad) for t in inputs if torch.Tensor.is_floating_point(t)]
    )
    rt.chunks.hand_over("gradient", grads)
    rt.ds.pipe_buffers["inputs"][buffer_id] = None


def send_grads_chunked(rt, buffer_id):
    """Roughly: DeepSpeed's ``SendGrad``, tagged under virtual stages; a hand-over to this stage's own chunk."""
    if rt.chunks.local(rt.ds.prev_stage):
        return _local_input_grads(rt, buffer_id)
    if not rt.chunks.chunked:
        return rt.ds.send_grads(buffer_id)
    with rt.ds.timed_p2p("send_grad"):  # DeepSpeed's _exec_send_grads, tagged
        for grad in input_grads(rt, buffer_id):
            chunk_p2p.send(rt.ds.grid, grad, rt.ds.prev_stage, rt.chunks.gradient_tag)
        rt.ds.pipe_buffers["inputs"][buffer_id] = None


def isend_grads_chunked(rt, buffer_id):
    """Roughly: :func:`isend_grads`; a hand-over to this stage's own chunk."""
    if rt.chunks.local(rt.ds.prev_stage):
        return _local_input_grads(rt, buffer_id)
    isend_grads(rt, buffer_id)


def recv_grads_chunked(rt, buffer_id):
    """Roughly: DeepSpeed's ``RecvGrad``, tagged under virtual stages; from the queue of this stage's own chunk."""
    if rt.chunks.local(rt.ds.next_stage):
        rt.ds.set_received_gradient(rt.chunks.take("gradient"))
        return
    if not rt.chunks.chunked:
        return rt.ds.recv_grads(buffer_id)
    with rt.ds.timed_p2p("recv_grad"):  # DeepSpeed's _exec_recv_grads (not partitioned), tagged
        grad_layer = rt.ds.receive_buffers(rt.ds.pipe_buffers["outputs"][buffer_id])
        for buffer in (grad_layer,) if torch.is_tensor(grad_layer) else grad_layer:
            chunk_p2p.recv(rt.ds.grid, buffer, rt.ds.next_stage, rt.chunks.gradient_tag)
