"""What each analysis runs for each op kind: one row per kind, beside ``OP_INFO`` (what the kind
means). Every entry is the analysis's function itself, referenced here, so the behaviour of a kind
is read from its row and nothing joins names: a row's every analysis has an explicit entry, even
"nothing to do" (``()``, ``LOCAL``), and ``tests/schedules/test_op_table.py`` checks that each is a function
of its analysis. The analyses do not import this table (it refers to them): their entry points
(``validator.check``, ``simulator.simulate``) hand it to them. Pure Python."""

from __future__ import annotations

from typing import Callable, NamedTuple

from .continuous_checks import ContinuousStageChecker as Steady
from .deadlock import _Simulation as Comm
from .ir import OpKind
from .sim_stages import _Sim as Sim
from .stage_checks import _StageChecker as Flush


class Communication(NamedTuple):
    """How an op takes part in the pipeline's communication (``deadlock._Simulation`` functions).
    ``advance(sim, stage, iteration, op)`` runs the stage's op if it can and says whether anything
    changed; an op that can wait pairs it with ``stuck(sim, stage, op)``, why a stage blocked at it
    cannot move, and ``waiting_on(sim, stage, op)``, what it waits on as a peer's report names it
    (None: the op's own short form). An op that never waits has neither."""

    advance: Callable[..., bool]
    stuck: Callable[..., str] | None = None
    waiting_on: Callable[..., str] | None = None


class Rules(NamedTuple):
    simulate: Callable  # sim_stages._Sim, (sim, stage, call, op, state, acc): a generator of the op's time and waits
    stage: tuple[Callable, ...]  # stage_checks._StageChecker, (checker, op), in order: flush schedules' checks
    continuous: tuple[Callable, ...]  # continuous_checks.ContinuousStageChecker, (checker, op, batch): steady state
    communicate: Communication  # deadlock._Simulation: how the op takes part in the pipeline's communication


# The ways an op takes part in the communication, each with its reports
LOCAL = Communication(Comm._local)  # never waits for another stage
SEND = Communication(Comm._send, Comm._send_stuck, Comm._send_waiting_on)
RECV = Communication(Comm._recv, Comm._recv_stuck, Comm._recv_waiting_on)
AWAIT_SENDS = Communication(Comm._wait_sends, Comm._wait_sends_stuck)
COLLECTIVE = Communication(Comm._collective, Comm._collective_stuck, Comm._collective_waiting_on)  # matched by count

_K = OpKind
# One function per kind and analysis (several kinds share one only where it reads what differs from
# OP_INFO: the compute ops' cost terms and gradient flags, the p2p ops' peer, cargo and direction, a
# pipeline collective's cost terms).
# Loads, the gradient buffer's copy and weight versions take no simulated time; steady-state
# schedules refuse split backwards and flush-style updates (continuous.py), so their continuous
# entries check what little applies; wait_sends and reduce_tied_grads are communication only
# (deadlock.py); weight versions exist in steady-state schedules alone.
RULES: dict[OpKind, Rules] = {
    _K.LOAD: Rules(Sim._no_time, (Flush._load,), (Steady._load,), LOCAL),
    _K.FORWARD: Rules(
        Sim._compute, (Flush._forward, Flush._forward_before_update), (Steady._version, Steady._forward), LOCAL
    ),
    _K.BACKWARD: Rules(
        Sim._compute, (Flush._input_grad, Flush._weight_grad), (Steady._version, Steady._backward), LOCAL
    ),
    _K.FORWARD_BACKWARD: Rules(
        Sim._compute,
        (Flush._forward, Flush._input_grad, Flush._weight_grad),
        (Steady._version, Steady._forward, Steady._backward),
        LOCAL,
    ),
    _K.BACKWARD_INPUT: Rules(Sim._compute, (Flush._input_grad,), (Steady._version,), LOCAL),
    _K.BACKWARD_WEIGHT: Rules(Sim._compute, (Flush._backward_weight, Flush._weight_grad), (Steady._version,), LOCAL),
    _K.SEND_ACTIVATION: Rules(Sim._p2p, (Flush._send_activation,), (Steady._send_activation,), SEND),
    _K.RECV_ACTIVATION: Rules(Sim._p2p, (Flush._recv_activation,), (Steady._recv_activation,), RECV),
    _K.SEND_GRAD: Rules(Sim._p2p, (Flush._send_grad,), (Steady._send_grad,), SEND),
    _K.RECV_GRAD: Rules(Sim._p2p, (Flush._recv_grad,), (Steady._recv_grad,), RECV),
    _K.WAIT_SENDS: Rules(Sim._wait_sends, (), (), AWAIT_SENDS),
    _K.REDUCE_TIED_GRADS: Rules(Sim._reduce_tied_grads, (), (), COLLECTIVE),
    _K.REDUCE_GRADS: Rules(Sim._reduce_grads, (Flush._reduce_grads,), (), LOCAL),
    _K.START_ALLREDUCE: Rules(Sim._start_allreduce, (Flush._start_allreduce,), (Steady._start_allreduce,), LOCAL),
    _K.WAIT_ALLREDUCE: Rules(Sim._wait_allreduce, (Flush._wait_allreduce,), (Steady._wait_allreduce,), LOCAL),
    _K.COPY_GRADS_TO_BUFFER: Rules(Sim._copy_grads_to_buffer, (Flush._copy_to_buffer,), (), LOCAL),
    _K.APPLY_BUFFERED_UPDATE: Rules(
        Sim._apply_buffered_update, (Flush._apply_buffered_update,), (Steady._update,), LOCAL
    ),
    _K.OPTIMIZER_STEP: Rules(Sim._pipeline_collective, (Flush._update,), (Steady._update,), COLLECTIVE),
    _K.STAGE_OPTIMIZER_STEP: Rules(Sim._stage_optimizer_step, (Flush._update,), (Steady._update,), LOCAL),
    _K.STASH_WEIGHTS: Rules(Sim._stash_weights, (), (Steady._stash_weights,), LOCAL),
    _K.FREE_WEIGHTS: Rules(Sim._free_weights, (), (Steady._free_weights,), LOCAL),
}
del _K
