"""What each analysis runs for each op kind: one row per kind, beside ``OP_INFO`` (what the kind
means and which engine method runs it). Every kind has a row, and every analysis an explicit entry
in it, even "nothing to do" (``()``, ``"_local"``): ``tests/schedules/test_op_table.py`` checks that each
names a method of its analysis. Pure Python."""
from __future__ import annotations

from typing import NamedTuple

from .ir import OpKind


class Rules(NamedTuple):
    simulate: str  # simulator._Sim method: the op's time (and its waits)
    stage: tuple[str, ...]  # stage_checks._StageChecker methods, in order: flush schedules' data flow and gradients
    continuous: tuple[str, ...]  # continuous_checks.ContinuousStageChecker methods: steady-state schedules
    communicate: str  # deadlock._Simulation method: how the op takes part in the pipeline's communication
    # (one that can wait, i.e. not "_local", has a NAME_stuck too: why a stuck stage cannot move)


_K = OpKind
# One function per kind and analysis (several kinds share one only where it reads what differs from
# OP_INFO: the compute ops' cost terms and gradient flags, the p2p ops' peer, cargo and direction, a
# pipeline collective's cost terms).
# Loads, the gradient buffer's copy and weight versions take no simulated time; steady-state
# schedules refuse split backwards and flush-style updates (continuous.py), so their continuous
# entries check what little applies; wait_sends and reduce_tied_grads are communication only
# (deadlock.py); weight versions exist in steady-state schedules alone.
RULES: dict[OpKind, Rules] = {
    _K.LOAD: Rules("_load", ("_load",), ("_load",), "_local"),
    _K.FORWARD: Rules("_compute", ("_forward", "_forward_before_update"), ("_version", "_forward"), "_local"),
    _K.BACKWARD: Rules("_compute", ("_input_grad", "_weight_grad"), ("_version", "_backward"), "_local"),
    _K.FORWARD_BACKWARD: Rules("_compute", ("_forward", "_input_grad", "_weight_grad"),
                               ("_version", "_forward", "_backward"), "_local"),
    _K.BACKWARD_INPUT: Rules("_compute", ("_input_grad",), ("_version",), "_local"),
    _K.BACKWARD_WEIGHT: Rules("_compute", ("_backward_weight", "_weight_grad"), ("_version",), "_local"),
    _K.SEND_ACTIVATION: Rules("_p2p", ("_send_activation",), ("_send_activation",), "_send"),
    _K.RECV_ACTIVATION: Rules("_p2p", ("_recv_activation",), ("_recv_activation",), "_recv"),
    _K.SEND_GRAD: Rules("_p2p", ("_send_grad",), ("_send_grad",), "_send"),
    _K.RECV_GRAD: Rules("_p2p", ("_recv_grad",), ("_recv_grad",), "_recv"),
    _K.WAIT_SENDS: Rules("_wait_sends", (), (), "_wait_sends"),
    _K.REDUCE_TIED_GRADS: Rules("_reduce_tied_grads", (), (), "_collective"),
    _K.REDUCE_GRADS: Rules("_reduce_grads", ("_reduce_grads",), (), "_local"),
    _K.START_ALLREDUCE: Rules("_start_allreduce", ("_start_allreduce",), ("_start_allreduce",), "_local"),
    _K.WAIT_ALLREDUCE: Rules("_wait_allreduce", ("_wait_allreduce",), ("_wait_allreduce",), "_local"),
    _K.COPY_GRADS_TO_BUFFER: Rules("_copy_grads_to_buffer", ("_copy_to_buffer",), (), "_local"),
    _K.APPLY_BUFFERED_UPDATE: Rules("_apply_buffered_update", ("_apply_buffered_update",), ("_update",), "_local"),
    _K.OPTIMIZER_STEP: Rules("_pipeline_collective", ("_update",), ("_update",), "_collective"),
    _K.STAGE_OPTIMIZER_STEP: Rules("_stage_optimizer_step", ("_update",), ("_update",), "_local"),
    _K.STASH_WEIGHTS: Rules("_stash_weights", (), ("_stash_weights",), "_local"),
    _K.FREE_WEIGHTS: Rules("_free_weights", (), ("_free_weights",), "_local"),
}
del _K
