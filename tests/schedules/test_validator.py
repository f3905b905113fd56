"""The schedule validator, across stages: every built-in schedule passes (zb-h1 and hippie-zb with
fewer micro-batches than stages too); broken streams between stages (deadlocks, mis-ordered or
unmatched p2p, mismatched pipeline collectives) are caught with the right stage, step and reason;
validate() raises them as a ScheduleError. What a stage does with its own micro-batches, buffers
and gradients is test_validator_dataflow.py's. Pure Python, no torch."""

from dataclasses import replace

import pytest

from hippie_ds import schedules
from hippie_ds.schedules import OpKind, ScheduleError
from hippie_ds.schedules.ir import Op
from hippie_ds.schedules.validator import Problem, ScheduleValidationError, check, validate

from validator_cases import editable, locate, problems_with, remove, swap

BUILTINS = ["1f1b", "gpipe", "hippie", "hippie-1f1b"]


# ---------------------------------------------------------------------------------------------
# The built-in schedules are valid


def _variants(name, stages):
    yield {}
    if name.startswith("hippie"):
        yield {"deferred_stages": []}
        yield {"deferred_stages": list(range(stages))}


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_are_valid(name):
    for stages in range(1, 9):
        for micro_batches in range(1, 17):
            for params in _variants(name, stages):
                c = schedules.compile(name, stages, micro_batches, validate=False, **params)
                problems = check(c)
                assert problems == [], (name, stages, micro_batches, params, [str(p) for p in problems])


def test_compile_validates_by_default():
    c = schedules.compile("hippie", 4, 8)
    assert validate(c) is c


# The zero-bubble schedules (split backward: backward_input, then backward_weight)


def test_zb_h1_is_valid():
    for stages in range(1, 9):
        for micro_batches in range(1, 17):
            assert check(schedules.compile("zb-h1", stages, micro_batches, validate=False)) == [], (
                stages,
                micro_batches,
            )


def test_zero_bubble_schedules_run_fewer_micro_batches_than_stages():
    """M < K (e.g. 4 stages x 2 micro-batches, 2 x 1), as stock 1F1B runs it: zb-h1 and hippie-zb
    (every deferred set) compile, validate, keep W in micro-batch order (zb-h1 stays bit-identical
    to 1f1b) and hold at most the M micro-batches on every stage."""
    from hippie_ds.planner.traits import _compiled_traits

    for stages in range(2, 9):
        for micro_batches in range(1, stages):
            shape = (stages, micro_batches)
            for name, deferred in (
                ("zb-h1", None),
                ("hippie-zb", []),
                ("hippie-zb", "auto"),
                ("hippie-zb", list(range(stages))),
            ):
                params = {} if deferred is None else {"deferred_stages": deferred}
                compiled = schedules.compile(name, stages, micro_batches, validate=False, **params)
                assert check(compiled) == [], (name, shape, deferred)
                for s in range(stages):
                    ws = [op.micro_batch for op in compiled.ops(s) if op.kind == OpKind.BACKWARD_WEIGHT]
                    assert ws == list(range(micro_batches)), (name, shape, s)
            assert _compiled_traits("zb-h1", stages, micro_batches).in_flight == (micro_batches,) * stages


# ---------------------------------------------------------------------------------------------
# Deadlock and p2p matching


def _blocking_last_stage_sends(c):
    """The issue's trap: hippie (GPipe order next to the fused last stage) with every send
    blocking, as DeepSpeed's p2p is."""
    for stream in c.streams:
        for step in stream:
            step[:] = [
                replace(op, blocking=True) if op.kind in (OpKind.SEND_GRAD, OpKind.SEND_ACTIVATION) else op
                for op in step
                if op.kind != OpKind.WAIT_SENDS
            ]


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (3, 4), (4, 4), (4, 8), (8, 2)])
def test_blocking_grad_sends_from_last_stage_deadlock(stages, micro_batches):
    c = editable("hippie", stages, micro_batches)
    _blocking_last_stage_sends(c)
    problems = check(c)
    K = stages
    # The last stage blocks on its first gradient while stage K-2 is still sending forwards.
    stuck = problems_with(problems, K - 1, K - 1, "deadlock", "blocking send_grad(mb=0) to stage", str(K - 2))
    assert stuck and stuck[0].op == "send_grad(mb=0, buf=0)"
    assert f"stage {K - 2} is blocked at step" in stuck[0].reason and "send_activation(mb=1)" in stuck[0].reason
    assert problems_with(
        problems, K - 2, K - 1, "deadlock", "send_activation(mb=1)", f"stage {K - 1} is blocked at step {K - 1}"
    )
    assert all(p.reason.startswith("deadlock") for p in problems)


def test_1f1b_needs_deepspeeds_send_recv_order():
    # In a backward step, 1F1B receives the gradient before sending the previous activation;
    # sending first makes both neighbours wait in a blocking send.
    c = editable("1f1b", 3, 3)
    recv, send = locate(c, 0, OpKind.RECV_GRAD, mb=0), locate(c, 0, OpKind.SEND_ACTIVATION, mb=2)
    assert recv[0] == send[0] and recv[1] < send[1]
    swap(c, 0, recv, send)
    problems = check(c)
    assert problems_with(
        problems,
        0,
        recv[0],
        "deadlock: blocking send_activation(mb=2) to stage 1",
        "stage 1 is blocked at step 5 on send_grad(mb=0) to stage 0",
    )


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_blocking_grad_sends_are_fine_with_one_micro_batch(stages):
    c = editable("hippie", stages, 1)
    _blocking_last_stage_sends(c)
    assert check(c) == []


def test_swapped_recvs_are_mis_ordered():
    c = editable("gpipe", 3, 3)
    swap(c, 1, locate(c, 1, OpKind.RECV_ACTIVATION, mb=0), locate(c, 1, OpKind.RECV_ACTIVATION, mb=1))
    problems = check(c)
    (p,) = problems_with(problems, 1, 1, "mis-ordered")
    assert p.reason == "mis-ordered: stage 1 recv_activation(mb=1) received mb=0 from stage 0"
    assert problems_with(problems, 1, 2, "mis-ordered: stage 1 recv_activation(mb=0) received mb=1 from stage 0")
    # forward(mb=0) now runs before its activation arrives
    assert problems_with(problems, 1, 1, "forward of micro-batch 0 before its activation is received")


def test_removed_send_is_unmatched_or_deadlocks():
    c = editable("gpipe", 2, 3)
    pos = locate(c, 1, OpKind.SEND_GRAD, mb=2)
    remove(c, 1, pos)
    problems = check(c)
    # stage 0 waits for the gradient forever; stage 1 went on to the pipeline-wide optimizer step
    recv_step = locate(c, 0, OpKind.RECV_GRAD, mb=2)[0]
    (p,) = problems_with(problems, 0, recv_step, "deadlock", "recv_grad(mb=2)", "send_grad from stage 1")
    assert "stage 1 is blocked at step" in p.reason and "reduce_tied_grads (pipeline collective #1)" in p.reason
    (q,) = problems_with(problems, 1, c.num_steps - 1, "deadlock", "pipeline collective")
    assert "stage 0 is blocked at step" in q.reason


def test_removed_send_in_hippie_last_stage():
    c = editable("hippie", 4, 4)
    remove(c, 3, locate(c, 3, OpKind.SEND_GRAD, mb=3))
    problems = check(c)
    recv_step = locate(c, 2, OpKind.RECV_GRAD, mb=3)[0]
    assert problems_with(problems, 2, recv_step, "recv_grad(mb=3)", "send_grad from stage 3")


def test_send_never_received():
    c = editable("hippie", 2, 2)
    remove(c, 1, locate(c, 1, OpKind.WAIT_SENDS))  # else wait_sends itself is reported stuck
    remove(c, 0, locate(c, 0, OpKind.RECV_GRAD, mb=1))
    problems = check(c, iterations=1)
    (p,) = problems_with(problems, 1, 2, "unmatched")
    assert p.reason == "unmatched: send_grad(mb=1) to stage 0 is never received"
    assert problems_with(
        problems, 0, c.num_steps - 1, "backward of micro-batch 1 before its output gradient is received"
    )


def test_wait_sends_for_a_send_never_received():
    c = editable("hippie", 2, 2)
    remove(c, 0, locate(c, 0, OpKind.RECV_GRAD, mb=1))
    problems = check(c, iterations=1)
    (p,) = problems_with(problems, 1, 2, "unmatched: wait_sends")
    assert "send_grad(mb=1) to stage 0 (stage 0 has finished its stream)" in p.reason


def test_send_to_missing_stage():
    c = editable("gpipe", 2, 2)
    step, i = locate(c, 0, OpKind.BACKWARD, mb=1)
    c.streams[0][step].insert(i + 1, Op(OpKind.SEND_GRAD, 0, step, 1, buffer=1))
    assert problems_with(check(c), 0, step, "unmatched: send_grad(mb=1) to stage -1, which does not exist")


def test_pipeline_collectives_must_match():
    c = editable("1f1b", 3, 2)
    remove(c, 1, locate(c, 1, OpKind.REDUCE_TIED_GRADS))
    problems = check(c)
    last = c.num_steps - 1
    (p,) = problems_with(problems, 1, last, "pipeline collective #1 mismatched")
    assert "stage 1 runs optimizer_step while stage 0 runs reduce_tied_grads" in p.reason
    # the others then wait for a second collective stage 1 never joins
    assert problems_with(problems, 0, last, "deadlock", "pipeline collective #2")


# ---------------------------------------------------------------------------------------------
# validate() and the error


def test_validate_raises_naming_stage_and_step():
    c = editable("hippie", 4, 4)
    _blocking_last_stage_sends(c)
    with pytest.raises(ScheduleValidationError) as info:
        validate(c)
    err = info.value
    assert isinstance(err, ScheduleError)
    assert len(err.problems) == 4
    msg = str(err)
    assert msg.startswith(
        "schedule hippie (4 stages x 4 micro-batches, params {'deferred_stages': [0, 1]}): 4 problem(s):\n  "
    )
    assert "stage 3 step 3 send_grad(mb=0, buf=0): deadlock: blocking send_grad(mb=0) to stage 2" in msg


def test_error_lists_at_most_twenty():
    c = editable("gpipe", 1, 30)
    for step in c.streams[0]:  # drop every load: 30 forwards without inputs
        step[:] = [op for op in step if op.kind != OpKind.LOAD]
    with pytest.raises(ScheduleValidationError) as info:
        validate(c)
    assert len(info.value.problems) == 30
    assert str(info.value).count("\n  ") == 21 and "... and 10 more" in str(info.value)


def test_problem_str():
    assert str(Problem(2, 5, "recv_grad(mb=1, buf=1)", "why")) == "stage 2 step 5 recv_grad(mb=1, buf=1): why"
    assert str(Problem(1, None, None, "why")) == "stage 1: why"
