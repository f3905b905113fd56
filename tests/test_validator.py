"""The schedule validator: every built-in schedule passes; broken streams are caught with the
right stage, step and reason. Pure Python, no torch."""
from dataclasses import replace

import pytest

from hippie_ds import schedules
from hippie_ds.schedules import OpKind, ScheduleError
from hippie_ds.schedules.ir import Op
from hippie_ds.schedules.validator import Problem, ScheduleValidationError, check, validate

BUILTINS = ["1f1b", "gpipe", "hippie", "hippie-1f1b"]


def _compile(name, stages, micro_batches, **params):
    """A compiled schedule whose streams the test may edit in place."""
    c = schedules.compile(name, stages, micro_batches, validate=False, **params)
    return replace(c, streams=[[list(step) for step in stream] for stream in c.streams])


def _find(c, stage, kind, mb=None, target=None):
    """(step, index) of the stage's only op of that kind (and micro-batch / target)."""
    hits = [(t, i) for t, step in enumerate(c.streams[stage]) for i, op in enumerate(step)
            if op.kind == kind and (mb is None or op.micro_batch == mb) and (target is None or op.target == target)]
    assert len(hits) == 1, hits
    return hits[0]


def _op(c, stage, pos):
    return c.streams[stage][pos[0]][pos[1]]


def _put(c, stage, pos, op):
    """Place op at pos (step, index), keeping its step field consistent with where it is."""
    c.streams[stage][pos[0]][pos[1]] = replace(op, step=pos[0])


def _swap(c, stage, a, b):
    op_a, op_b = _op(c, stage, a), _op(c, stage, b)
    _put(c, stage, a, op_b)
    _put(c, stage, b, op_a)


def _remove(c, stage, pos):
    return c.streams[stage][pos[0]].pop(pos[1])


def _with(problems, stage, step, *words):
    """The problems at (stage, step) whose reason contains every word."""
    return [p for p in problems if p.stage == stage and p.step == step and all(w in p.reason for w in words)]


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


# ---------------------------------------------------------------------------------------------
# Deadlock and p2p matching

def _blocking_last_stage_sends(c):
    """The issue's trap: hippie (GPipe order next to the fused last stage) with every send
    blocking, as DeepSpeed's p2p is."""
    for stream in c.streams:
        for step in stream:
            step[:] = [replace(op, blocking=True) if op.kind in (OpKind.SEND_GRAD, OpKind.SEND_ACTIVATION) else op
                       for op in step if op.kind != OpKind.WAIT_SENDS]


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (3, 4), (4, 4), (4, 8), (8, 2)])
def test_blocking_grad_sends_from_last_stage_deadlock(stages, micro_batches):
    c = _compile("hippie", stages, micro_batches)
    _blocking_last_stage_sends(c)
    problems = check(c)
    K = stages
    # The last stage blocks on its first gradient while stage K-2 is still sending forwards.
    stuck = _with(problems, K - 1, K - 1, "deadlock", "blocking send_grad(mb=0) to stage", str(K - 2))
    assert stuck and stuck[0].op == "send_grad(mb=0, buf=0)"
    assert f"stage {K - 2} is blocked at step" in stuck[0].reason and "send_activation(mb=1)" in stuck[0].reason
    assert _with(problems, K - 2, K - 1, "deadlock", "send_activation(mb=1)", f"stage {K - 1} is blocked at step {K - 1}")
    assert all(p.reason.startswith("deadlock") for p in problems)


def test_1f1b_needs_deepspeeds_send_recv_order():
    # In a backward step, 1F1B receives the gradient before sending the previous activation;
    # sending first makes both neighbours wait in a blocking send.
    c = _compile("1f1b", 3, 3)
    recv, send = _find(c, 0, OpKind.RECV_GRAD, mb=0), _find(c, 0, OpKind.SEND_ACTIVATION, mb=2)
    assert recv[0] == send[0] and recv[1] < send[1]
    _swap(c, 0, recv, send)
    problems = check(c)
    assert _with(problems, 0, recv[0], "deadlock: blocking send_activation(mb=2) to stage 1",
                 "stage 1 is blocked at step 5 on send_grad(mb=0) to stage 0")


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_blocking_grad_sends_are_fine_with_one_micro_batch(stages):
    c = _compile("hippie", stages, 1)
    _blocking_last_stage_sends(c)
    assert check(c) == []


def test_swapped_recvs_are_mis_ordered():
    c = _compile("gpipe", 3, 3)
    _swap(c, 1, _find(c, 1, OpKind.RECV_ACTIVATION, mb=0), _find(c, 1, OpKind.RECV_ACTIVATION, mb=1))
    problems = check(c)
    (p,) = _with(problems, 1, 1, "mis-ordered")
    assert p.reason == "mis-ordered: stage 1 recv_activation(mb=1) received mb=0 from stage 0"
    assert _with(problems, 1, 2, "mis-ordered: stage 1 recv_activation(mb=0) received mb=1 from stage 0")
    # forward(mb=0) now runs before its activation arrives
    assert _with(problems, 1, 1, "forward of micro-batch 0 before its activation is received")


def test_removed_send_is_unmatched_or_deadlocks():
    c = _compile("gpipe", 2, 3)
    pos = _find(c, 1, OpKind.SEND_GRAD, mb=2)
    _remove(c, 1, pos)
    problems = check(c)
    # stage 0 waits for the gradient forever; stage 1 went on to the pipeline-wide optimizer step
    recv_step = _find(c, 0, OpKind.RECV_GRAD, mb=2)[0]
    (p,) = _with(problems, 0, recv_step, "deadlock", "recv_grad(mb=2)", "send_grad from stage 1")
    assert "stage 1 is blocked at step" in p.reason and "reduce_tied_grads (pipeline collective #1)" in p.reason
    (q,) = _with(problems, 1, c.num_steps - 1, "deadlock", "pipeline collective")
    assert "stage 0 is blocked at step" in q.reason


def test_removed_send_in_hippie_last_stage():
    c = _compile("hippie", 4, 4)
    _remove(c, 3, _find(c, 3, OpKind.SEND_GRAD, mb=3))
    problems = check(c)
    recv_step = _find(c, 2, OpKind.RECV_GRAD, mb=3)[0]
    assert _with(problems, 2, recv_step, "recv_grad(mb=3)", "send_grad from stage 3")


def test_send_never_received():
    c = _compile("hippie", 2, 2)
    _remove(c, 1, _find(c, 1, OpKind.WAIT_SENDS))  # else wait_sends itself is reported stuck
    _remove(c, 0, _find(c, 0, OpKind.RECV_GRAD, mb=1))
    problems = check(c, iterations=1)
    (p,) = _with(problems, 1, 2, "unmatched")
    assert p.reason == "unmatched: send_grad(mb=1) to stage 0 is never received"
    assert _with(problems, 0, c.num_steps - 1, "backward of micro-batch 1 before its output gradient is received")


def test_wait_sends_for_a_send_never_received():
    c = _compile("hippie", 2, 2)
    _remove(c, 0, _find(c, 0, OpKind.RECV_GRAD, mb=1))
    problems = check(c, iterations=1)
    (p,) = _with(problems, 1, 2, "unmatched: wait_sends")
    assert "send_grad(mb=1) to stage 0 (stage 0 has finished its stream)" in p.reason


def test_send_to_missing_stage():
    c = _compile("gpipe", 2, 2)
    step, i = _find(c, 0, OpKind.BACKWARD, mb=1)
    c.streams[0][step].insert(i + 1, Op(OpKind.SEND_GRAD, 0, step, 1, buffer=1))
    assert _with(check(c), 0, step, "unmatched: send_grad(mb=1) to stage -1, which does not exist")


def test_pipeline_collectives_must_match():
    c = _compile("1f1b", 3, 2)
    _remove(c, 1, _find(c, 1, OpKind.REDUCE_TIED_GRADS))
    problems = check(c)
    last = c.num_steps - 1
    (p,) = _with(problems, 1, last, "pipeline collective #1 mismatched")
    assert "stage 1 runs optimizer_step while stage 0 runs reduce_tied_grads" in p.reason
    # the others then wait for a second collective stage 1 never joins
    assert _with(problems, 0, last, "deadlock", "pipeline collective #2")


# ---------------------------------------------------------------------------------------------
# Data flow and buffer slots

def test_backward_before_forward():
    c = _compile("gpipe", 2, 2)
    b = _remove(c, 1, _find(c, 1, OpKind.BACKWARD, mb=0))
    step, i = _find(c, 1, OpKind.FORWARD, mb=0)
    c.streams[1][step].insert(i, replace(b, step=step))
    assert _with(check(c), 1, step, "backward of micro-batch 0 before its forward")


def test_forwarded_twice():
    c = _compile("gpipe", 2, 3)
    pos = _find(c, 0, OpKind.FORWARD, mb=1)
    _put(c, 0, pos, replace(_op(c, 0, pos), micro_batch=0))
    problems = check(c)
    assert _with(problems, 0, pos[0], "micro-batch 0 forwarded twice")
    assert Problem(0, None, None, "micro-batch 1 is never forwarded") in problems


def test_micro_batch_out_of_range():
    c = _compile("gpipe", 2, 2)
    pos = _find(c, 0, OpKind.LOAD, mb=1)
    _put(c, 0, pos, replace(_op(c, 0, pos), micro_batch=5))
    assert _with(check(c), 0, pos[0], "micro-batch 5 outside 0..1")


def test_forward_needs_load():
    c = _compile("1f1b", 2, 2)
    _remove(c, 1, _find(c, 1, OpKind.LOAD, mb=1))
    step = _find(c, 1, OpKind.FORWARD, mb=1)[0]
    assert _with(check(c), 1, step, "forward of micro-batch 1 before its labels are loaded")


def test_send_before_compute():
    c = _compile("gpipe", 2, 2)
    send = _find(c, 0, OpKind.SEND_ACTIVATION, mb=0)
    fwd = _find(c, 0, OpKind.FORWARD, mb=0)
    _swap(c, 0, send, fwd)
    assert _with(check(c), 0, fwd[0], "sends micro-batch 0's activation before its forward")


def test_shared_slot_overwritten_while_live():
    c = _compile("1f1b", 3, 3)  # stage 0 holds micro-batches 0..2 at once, in slots 0..2
    for stream_step in c.streams[0]:
        stream_step[:] = [replace(op, buffer=0) if op.micro_batch == 1 else op for op in stream_step]
    load_step = _find(c, 0, OpKind.LOAD, mb=1)[0]
    (p,) = _with(check(c), 0, load_step, "buffer overwritten while live")
    assert "slot 0 still holds micro-batch 0" in p.reason


def test_slot_out_of_range_and_inconsistent():
    c = _compile("gpipe", 2, 2)
    pos = _find(c, 0, OpKind.FORWARD, mb=1)
    _put(c, 0, pos, replace(_op(c, 0, pos), buffer=0))
    problems = check(c)
    assert _with(problems, 0, pos[0], "micro-batch 1 in slot 0, but its first op put it in slot 1")
    pos = _find(c, 1, OpKind.FORWARD, mb=1)
    _put(c, 1, pos, replace(_op(c, 1, pos), buffer=c.num_buffers[1]))
    assert _with(check(c), 1, pos[0], f"buffer {c.num_buffers[1]} outside")


# ---------------------------------------------------------------------------------------------
# Gradients and updates

def test_optimizer_step_before_reduce_grads():
    c = _compile("1f1b", 2, 2)
    _swap(c, 0, _find(c, 0, OpKind.REDUCE_GRADS), _find(c, 0, OpKind.OPTIMIZER_STEP))
    problems = check(c)
    (p,) = problems
    assert (p.stage, p.step, p.op) == (0, c.num_steps - 1, "optimizer_step()")
    assert "optimizer_step before the gradients it applies are reduced" in p.reason


def test_stage_step_between_start_and_wait_allreduce():
    c = _compile("hippie", 4, 4)  # stage 3 is not deferred
    _swap(c, 3, _find(c, 3, OpKind.WAIT_ALLREDUCE, target="grads"), _find(c, 3, OpKind.STAGE_OPTIMIZER_STEP))
    (p,) = check(c)
    assert (p.stage, p.op) == (3, "stage_optimizer_step()")
    assert "before the gradients it applies are reduced" in p.reason and "in flight" in p.reason


def test_apply_before_waiting_for_the_buffer_all_reduce():
    c = _compile("hippie", 4, 4)  # stages 0 and 1 are deferred
    _swap(c, 0, _find(c, 0, OpKind.WAIT_ALLREDUCE, target="buffer"), _find(c, 0, OpKind.APPLY_BUFFERED_UPDATE))
    # The first call has nothing buffered yet: only the second train_batch call shows it.
    assert check(c, iterations=1) == []
    (p,) = check(c)
    assert (p.stage, p.step, p.op) == (0, c.num_steps - 1, "apply_buffered_update()")
    assert "buffered gradient read before its all-reduce was waited for" in p.reason


def test_copy_grads_to_buffer_twice():
    c = _compile("hippie", 4, 4)
    step, i = _find(c, 1, OpKind.COPY_GRADS_TO_BUFFER)
    c.streams[1][step].insert(i + 1, c.streams[1][step][i])
    problems = check(c)
    assert _with(problems, 1, step, "gradient buffer overwritten while live (state filled)")
    assert _with(problems, 1, step, "second update in one iteration")


def test_stage_without_update():
    c = _compile("hippie", 4, 4)
    _remove(c, 3, _find(c, 3, OpKind.STAGE_OPTIMIZER_STEP))
    (p,) = check(c)
    assert (p.stage, p.step, p.op) == (3, None, None)
    assert p.reason.startswith("stage 3 never applies or buffers its gradients")


def test_deferred_stage_never_applying_its_buffer():
    c = _compile("hippie", 2, 2)
    _remove(c, 0, _find(c, 0, OpKind.APPLY_BUFFERED_UPDATE))
    problems = check(c)
    step = _find(c, 0, OpKind.COPY_GRADS_TO_BUFFER)[0]
    assert len(problems) == 1  # the next call's copy lands on the reduced, unapplied buffer
    assert _with(problems, 0, step, "gradient buffer overwritten while live (state reduced)")


def test_buffer_reduced_but_not_applied_at_iteration_end():
    c = _compile("hippie", 2, 2)
    _remove(c, 0, _find(c, 0, OpKind.APPLY_BUFFERED_UPDATE))
    wait = _remove(c, 0, _find(c, 0, OpKind.WAIT_ALLREDUCE, target="buffer"))
    start = _find(c, 0, OpKind.START_ALLREDUCE, target="buffer")
    start_op = c.streams[0][start[0]][start[1]]
    c.streams[0][wait.step] += [replace(start_op, step=wait.step), wait]  # copy, start, wait: reduced, left so
    assert Problem(0, None, None, "gradient buffer all-reduced but never applied "
                                  "(apply_buffered_update missing)") in check(c, iterations=1)


def test_backward_after_update():
    c = _compile("gpipe", 2, 3)
    last = c.num_steps - 1
    b = _remove(c, 0, _find(c, 0, OpKind.BACKWARD, mb=2))
    rg = _remove(c, 0, _find(c, 0, OpKind.RECV_GRAD, mb=2))
    c.streams[0][last] += [rg, b]  # after reduce_grads and optimizer_step
    problems = check(c)
    assert _with(problems, 0, last, "backward after this iteration's optimizer_step")
    assert _with(problems, 0, last, "reduce_grads before all 3 backwards")


def test_grads_all_reduce_never_waited():
    c = _compile("hippie-1f1b", 2, 2)  # stage 1 is not deferred
    _remove(c, 1, _find(c, 1, OpKind.WAIT_ALLREDUCE, target="grads"))
    problems = check(c)
    assert _with(problems, 1, c.num_steps - 1, "stage_optimizer_step before the gradients it applies are reduced")
    assert Problem(1, None, None, "all-reduce of the gradients still in flight at the end of the iteration "
                                  "(no wait_allreduce(grads))") in problems


# ---------------------------------------------------------------------------------------------
# validate() and the error

def test_validate_raises_naming_stage_and_step():
    c = _compile("hippie", 4, 4)
    _blocking_last_stage_sends(c)
    with pytest.raises(ScheduleValidationError) as info:
        validate(c)
    err = info.value
    assert isinstance(err, ScheduleError)
    assert len(err.problems) == 4
    msg = str(err)
    assert msg.startswith("schedule hippie (4 stages x 4 micro-batches, params {'deferred_stages': [0, 1]}): "
                          "4 problem(s):\n  ")
    assert "stage 3 step 3 send_grad(mb=0, buf=0): deadlock: blocking send_grad(mb=0) to stage 2" in msg


def test_error_lists_at_most_twenty():
    c = _compile("gpipe", 1, 30)
    for step in c.streams[0]:  # drop every load: 30 forwards without inputs
        step[:] = [op for op in step if op.kind != OpKind.LOAD]
    with pytest.raises(ScheduleValidationError) as info:
        validate(c)
    assert len(info.value.problems) == 30
    assert str(info.value).count("\n  ") == 21 and "... and 10 more" in str(info.value)


def test_problem_str():
    assert str(Problem(2, 5, "recv_grad(mb=1, buf=1)", "why")) == "stage 2 step 5 recv_grad(mb=1, buf=1): why"
    assert str(Problem(1, None, None, "why")) == "stage 1: why"



# ---------------------------------------------------------------------------------------------
# Split backward (zero-bubble): backward_input, then backward_weight, buffer alive until W

def test_zb_h1_is_valid():
    for stages in range(1, 9):
        for micro_batches in range(1, 17):
            assert check(schedules.compile("zb-h1", stages, micro_batches, validate=False)) == [], (stages, micro_batches)


def test_zero_bubble_schedules_run_fewer_micro_batches_than_stages():
    """M < K (e.g. 4 stages x 2 micro-batches, 2 x 1), as stock 1F1B runs it: zb-h1 and hippie-zb
    (every deferred set) compile, validate, keep W in micro-batch order (zb-h1 stays bit-identical
    to 1f1b) and hold at most the M micro-batches on every stage."""
    from hippie_ds.planner.traits import _compiled_traits
    for stages in range(2, 9):
        for micro_batches in range(1, stages):
            shape = (stages, micro_batches)
            for name, deferred in (("zb-h1", None), ("hippie-zb", []), ("hippie-zb", "auto"),
                                   ("hippie-zb", list(range(stages)))):
                params = {} if deferred is None else {"deferred_stages": deferred}
                compiled = schedules.compile(name, stages, micro_batches, validate=False, **params)
                assert check(compiled) == [], (name, shape, deferred)
                for s in range(stages):
                    ws = [op.micro_batch for op in compiled.ops(s) if op.kind == OpKind.BACKWARD_WEIGHT]
                    assert ws == list(range(micro_batches)), (name, shape, s)
            assert _compiled_traits("zb-h1", stages, micro_batches).in_flight == (micro_batches,) * stages


def test_weight_pass_before_its_input_pass_is_caught():
    c = _compile("zb-h1", 2, 2)
    i0, w0 = _find(c, 1, OpKind.BACKWARD_INPUT, mb=0), _find(c, 1, OpKind.BACKWARD_WEIGHT, mb=0)
    _swap(c, 1, i0, w0)
    assert _with(check(c), 1, i0[0], "backward_weight of micro-batch 0 before its backward_input")


def test_missing_weight_pass_is_caught():
    c = _compile("zb-h1", 2, 3)
    _remove(c, 0, _find(c, 0, OpKind.BACKWARD_WEIGHT, mb=1))
    assert any(p.stage == 0 and "micro-batch 1's backward_weight is missing" in p.reason for p in check(c))


def test_buffer_reused_before_its_weight_pass_is_caught():
    # stage 1 of zb-h1 (K=2) runs F0 I0 F1 I1 W0 ...: micro-batch 0 holds its slot until W0
    c = _compile("zb-h1", 2, 4)
    c.streams[1] = [[replace(op, buffer=0) if op.micro_batch == 1 else op for op in step] for step in c.streams[1]]
    assert _with(check(c), 1, 3, "buffer overwritten while live: slot 0 still holds micro-batch 0",
                 "used again at step 5 by backward_weight(mb=0)")


def test_update_between_input_and_weight_pass_is_caught():
    c = _compile("zb-h1", 2, 2)
    w1 = _find(c, 0, OpKind.BACKWARD_WEIGHT, mb=1)
    step = _find(c, 0, OpKind.OPTIMIZER_STEP)
    c.streams[0][w1[0]].insert(w1[1], replace(_remove(c, 0, step), step=w1[0]))
    assert any("backward_weight after this iteration's optimizer_step" in p.reason for p in check(c))


def test_gradient_buffer_state_machine_is_shared():
    """The one state machine the validator, simulator and engine use: the first step's start /
    wait / apply do nothing, one replica goes straight to reduced, and the illegal orders say why."""
    from hippie_ds.schedules.grad_buffer import GradBuffer
    b = GradBuffer()
    assert b.start() == (False, None) and b.wait() == (False, None) and b.apply() == (False, None)
    assert b.copy() is None and b.pending
    assert b.start() == (True, None) and b.state == "reducing"
    assert b.start()[1] == "start_allreduce(buffer) while the previous one is still in flight"
    assert b.wait() == (True, None) and b.apply() == (True, None) and not b.pending
    b.copy()
    assert b.start(reduce=False) == (False, None) and b.state == "reduced"
    assert b.copy() == "gradient buffer overwritten while live (state reduced)"
    assert "before its all-reduce was waited for (buffer filled)" in b.apply()[1]
