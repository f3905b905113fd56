"""What each analysis runs for each op kind: one row per kind, beside ``OP_INFO`` (what the kind
means and which engine method runs it). Every kind has a row, and every analysis an explicit entry
in it, even "nothing to do" (``()``, ``"_local"``): ``tests/test_op_table.py`` checks that each
names a method of its analysis. Pure Python."""
from __future__ import annotations

from typing import NamedTuple

from .ir import OpKind


class Rules(NamedTuple):
    simulate: str  # simulator._Sim method: the op's time (and its waits)
    stage: tuple[str, ...]  # stage_checks._StageChecker methods, in order: flush schedules' data flow and gradients
    continuous: tuple[str, ...]  # continuous_checks.ContinuousStageChecker methods: steady-state schedules
    communicate: str  # deadlock._Simulation method: how the op takes part in the pipeline's communication


_K = OpKind
# Loads and the gradient buffer's copy take no simulated time (_exec_stage_op's "not modelled");
# steady-state schedules refuse split backwards and flush-style updates (continuous.py), so their
# continuous entries check what little applies; wait_sends and reduce_tied_grads are communication
# only (deadlock.py); weight versions exist in steady-state schedules alone.
RULES: dict[OpKind, Rules] = {
    _K.LOAD: Rules("_exec_stage_op", ("_load",), ("_data_flow",), "_local"),
    _K.FORWARD: Rules("_exec_compute", ("_forward",), ("_compute",), "_local"),
    _K.BACKWARD: Rules("_exec_compute", ("_input_grad", "_weight_grad"), ("_compute",), "_local"),
    _K.FORWARD_BACKWARD: Rules("_exec_compute", ("_forward", "_input_grad", "_weight_grad"), ("_compute",), "_local"),
    _K.BACKWARD_INPUT: Rules("_exec_compute", ("_input_grad",), ("_compute",), "_local"),
    _K.BACKWARD_WEIGHT: Rules("_exec_compute", ("_weight_grad",), ("_compute",), "_local"),
    _K.SEND_ACTIVATION: Rules("_exec_p2p", ("_send_activation",), ("_data_flow",), "_send"),
    _K.RECV_ACTIVATION: Rules("_exec_p2p", ("_recv_activation",), ("_data_flow",), "_recv"),
    _K.SEND_GRAD: Rules("_exec_p2p", ("_send_grad",), ("_data_flow",), "_send"),
    _K.RECV_GRAD: Rules("_exec_p2p", ("_recv_grad",), ("_data_flow",), "_recv"),
    _K.WAIT_SENDS: Rules("_exec_p2p", (), (), "_wait_sends"),
    _K.REDUCE_TIED_GRADS: Rules("_exec_collective", (), (), "_collective"),
    _K.REDUCE_GRADS: Rules("_exec_stage_op", ("_reduce_grads",), (), "_local"),
    _K.START_ALLREDUCE: Rules("_exec_stage_op", ("_start_allreduce",), ("_gradients",), "_local"),
    _K.WAIT_ALLREDUCE: Rules("_exec_stage_op", ("_wait_allreduce",), ("_gradients",), "_local"),
    _K.COPY_GRADS_TO_BUFFER: Rules("_exec_stage_op", ("_copy_to_buffer",), (), "_local"),
    _K.APPLY_BUFFERED_UPDATE: Rules("_exec_stage_op", ("_apply_buffered_update",), ("_gradients",), "_local"),
    _K.OPTIMIZER_STEP: Rules("_exec_collective", ("_update",), ("_gradients",), "_collective"),
    _K.STAGE_OPTIMIZER_STEP: Rules("_exec_stage_op", ("_update",), ("_gradients",), "_local"),
    _K.STASH_WEIGHTS: Rules("_exec_stage_op", (), ("_weights",), "_local"),
    _K.FREE_WEIGHTS: Rules("_exec_stage_op", (), ("_weights",), "_local"),
}
del _K
