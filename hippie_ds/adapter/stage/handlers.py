"""What each op kind runs on a stage: :data:`HANDLERS` (and :data:`NONBLOCKING_HANDLERS` for sends
declared ``blocking: false``), one callable per kind of the op table (:data:`hippie_ds.schedules.ir.OP_INFO`).
A handler takes the stage's :class:`~hippie_ds.adapter.stage.runtime.StageRuntime` and its
instruction's keyword arguments (``OpInfo.args``, as DeepSpeed's handlers take them), and calls the
component that owns the state it touches: DeepSpeed's side of the stage
(:class:`~hippie_ds.adapter.ds.stage.DeepSpeedStage`: loads, forwards, backwards, DeepSpeed's own
reductions and step), ``StageGradients`` (all-reduces and the gradient buffer), ``StageStep`` (per-stage
updates), the continuous schedules' updates, ``WeightVersions`` and ``SplitBackward``. The p2p handlers
are in :mod:`~hippie_ds.adapter.stage.p2p`. ``tests/schedules/test_op_table.py`` checks that every kind has one
whose signature takes its arguments."""

from __future__ import annotations

from typing import Callable

from ...schedules.ir import Op, OpKind
from . import p2p


# ------------------------------------------------------------------ data and compute
def load_micro_batch(rt, buffer_id):
    rt.ds.load_micro_batch(buffer_id)


def forward(rt, buffer_id):
    """DeepSpeed's forward; the loss kept in its buffer's slot (DeepSpeed keeps one: any order but
    strict F(m)->B(m) on the last stage would differentiate the wrong loss, DeepSpeed issue #3900)."""
    rt.ds.forward_pass(buffer_id)
    if rt.ds.is_last_stage():
        rt.losses[buffer_id] = rt.ds.take_loss()


def backward(rt, buffer_id):
    """DeepSpeed's backward of the buffer's loss, inside partial deferral's early all-reduce window.
    On the loss stage the buffer's output is then dropped: DeepSpeed's ``_exec_backward_pass`` returns
    there before it frees it, so the logits of every buffer would stay until the buffer is reused (and
    after the step)."""
    last = rt.ds.is_last_stage()
    if last:
        rt.ds.set_loss(rt.losses.pop(buffer_id))
    with rt.gradients.early_allreduce_window():  # partial deferral (gradients/stage.py)
        rt.ds.backward_pass(buffer_id)
    if last:
        rt.ds.pipe_buffers["outputs"][buffer_id] = None


def forward_backward(rt, buffer_id):
    """The loss stage's forward and backward back to back (its output dropped by the backward)."""
    forward(rt, buffer_id)
    backward(rt, buffer_id)


def backward_input(rt, buffer_id):
    """Roughly: ``buffers['inputs'][buf].grad = d out / d inputs`` (no parameter gradients)."""
    if rt.split.whole_backward_in_input:  # DeepSpeed's activation checkpoint: its own backward
        backward(rt, buffer_id)
        return
    loss = rt.losses.pop(buffer_id) if rt.ds.is_last_stage() else None
    rt.split.backward_input(buffer_id, loss, rt.chunks.chunk)


def backward_weight(rt, buffer_id):
    """Roughly: ``grads += d out / d params`` of the buffer's micro-batch; frees what I kept."""
    if not rt.split.whole_backward_in_input:
        rt.split.backward_weight(buffer_id)


# ------------------------------------------------------------------ gradients and updates
def reduce_tied_grads(rt):
    rt.ds.reduce_tied_grads()


def reduce_grads(rt):
    rt.ds.reduce_grads()


def optimizer_step(rt):
    rt.ds.optimizer_step()


def start_allreduce(rt, target, chunk):
    if target == "chunk":  # virtual stages: one chunk's gradients, its backwards done
        rt.gradients.start_chunk_allreduce(rt.chunk_parameters(chunk))
    else:
        rt.gradients.start_allreduce(target)


def wait_allreduce(rt, target):
    rt.gradients.wait_allreduce(target)


def copy_grads_to_buffer(rt):
    rt.gradients.copy_to_buffer()


def apply_buffered_update(rt):
    with rt.gradients.buffered_update() as updates:  # the buffered gradient in place
        rt.stage_step.step() if updates else rt.stage_step.count_only()


def stage_optimizer_step(rt, batch: int = 0):
    if not rt.continuous:
        rt.stage_step.step()
        return
    # a per-stage update of a continuous schedule: on the current version, per-stage
    # clipping, no step counters (the call advances them), at its batch's learning rates
    # (an update may run in the next call: every stage, and every holder of a tied module,
    # applies a batch's gradient at the same rate wherever the call boundary falls)
    rt.updates.update(rt.cursor.lrs(batch))  # on the current version (fp16: once the overflow vote decides)


# ------------------------------------------------------------------ weight versions
def stash_weights(rt, batch: int, version: int):
    rt.updates.before_use(rt.abs_version(batch, version))  # fp16: the held update making it, decided
    rt.versions.stash(rt.abs_version(batch, version))


def free_weights(rt, batch: int, version: int):
    rt.versions.free(rt.abs_version(batch, version, clamp=False))


_K = OpKind
HANDLERS: dict[OpKind, Callable] = {
    _K.LOAD: load_micro_batch,
    _K.FORWARD: forward,
    _K.BACKWARD: backward,
    _K.FORWARD_BACKWARD: forward_backward,
    _K.BACKWARD_INPUT: backward_input,
    _K.BACKWARD_WEIGHT: backward_weight,
    _K.SEND_ACTIVATION: p2p.send_activations_chunked,
    _K.RECV_ACTIVATION: p2p.recv_activations_chunked,
    _K.SEND_GRAD: p2p.send_grads_chunked,
    _K.RECV_GRAD: p2p.recv_grads_chunked,
    _K.WAIT_SENDS: p2p.wait_sends,
    _K.REDUCE_TIED_GRADS: reduce_tied_grads,
    _K.REDUCE_GRADS: reduce_grads,
    _K.START_ALLREDUCE: start_allreduce,
    _K.WAIT_ALLREDUCE: wait_allreduce,
    _K.COPY_GRADS_TO_BUFFER: copy_grads_to_buffer,
    _K.APPLY_BUFFERED_UPDATE: apply_buffered_update,
    _K.OPTIMIZER_STEP: optimizer_step,
    _K.STAGE_OPTIMIZER_STEP: stage_optimizer_step,
    _K.STASH_WEIGHTS: stash_weights,
    _K.FREE_WEIGHTS: free_weights,
}
# sends declared ``blocking: false`` (OpInfo.nonblocking_instruction), completed by ``wait_sends``
NONBLOCKING_HANDLERS: dict[OpKind, Callable] = {
    _K.SEND_ACTIVATION: p2p.isend_activations_chunked,
    _K.SEND_GRAD: p2p.isend_grads_chunked,
}
del _K


def handler_of(op: Op) -> Callable:
    """The handler that runs ``op``: its kind's, the non-blocking one for a send declared ``blocking: false``."""
    if not op.blocking and op.kind in NONBLOCKING_HANDLERS:
        return NONBLOCKING_HANDLERS[op.kind]
    return HANDLERS[op.kind]
