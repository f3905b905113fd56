"""The schedule validator, within a stage: broken data flow (a micro-batch used before its load,
forward or received input; forwarded twice; out of range), buffer slots overwritten while live,
gradients applied before they are reduced or never, the split backward's backward_weight before its
backward_input or missing, and the gradient buffer state machine the validator, simulator and
engine share, each caught with the right stage, step and reason. Pure Python, no torch."""

from dataclasses import replace

from hippie_ds.schedules import OpKind
from hippie_ds.schedules.validator import Problem, check

from validator_cases import editable, locate, op_at, problems_with, put, remove, swap


# ---------------------------------------------------------------------------------------------
# Data flow and buffer slots


def test_backward_before_forward():
    c = editable("gpipe", 2, 2)
    b = remove(c, 1, locate(c, 1, OpKind.BACKWARD, mb=0))
    step, i = locate(c, 1, OpKind.FORWARD, mb=0)
    c.streams[1][step].insert(i, replace(b, step=step))
    assert problems_with(check(c), 1, step, "backward of micro-batch 0 before its forward")


def test_forwarded_twice():
    c = editable("gpipe", 2, 3)
    pos = locate(c, 0, OpKind.FORWARD, mb=1)
    put(c, 0, pos, replace(op_at(c, 0, pos), micro_batch=0))
    problems = check(c)
    assert problems_with(problems, 0, pos[0], "micro-batch 0 forwarded twice")
    assert Problem(0, None, None, "micro-batch 1 is never forwarded") in problems


def test_micro_batch_out_of_range():
    c = editable("gpipe", 2, 2)
    pos = locate(c, 0, OpKind.LOAD, mb=1)
    put(c, 0, pos, replace(op_at(c, 0, pos), micro_batch=5))
    assert problems_with(check(c), 0, pos[0], "micro-batch 5 outside 0..1")


def test_forward_needs_load():
    c = editable("1f1b", 2, 2)
    remove(c, 1, locate(c, 1, OpKind.LOAD, mb=1))
    step = locate(c, 1, OpKind.FORWARD, mb=1)[0]
    assert problems_with(check(c), 1, step, "forward of micro-batch 1 before its labels are loaded")


def test_send_before_compute():
    c = editable("gpipe", 2, 2)
    send = locate(c, 0, OpKind.SEND_ACTIVATION, mb=0)
    fwd = locate(c, 0, OpKind.FORWARD, mb=0)
    swap(c, 0, send, fwd)
    assert problems_with(check(c), 0, fwd[0], "sends micro-batch 0's activation before its forward")


def test_shared_slot_overwritten_while_live():
    c = editable("1f1b", 3, 3)  # stage 0 holds micro-batches 0..2 at once, in slots 0..2
    for stream_step in c.streams[0]:
        stream_step[:] = [replace(op, buffer=0) if op.micro_batch == 1 else op for op in stream_step]
    load_step = locate(c, 0, OpKind.LOAD, mb=1)[0]
    (p,) = problems_with(check(c), 0, load_step, "buffer overwritten while live")
    assert "slot 0 still holds micro-batch 0" in p.reason


def test_slot_out_of_range_and_inconsistent():
    c = editable("gpipe", 2, 2)
    pos = locate(c, 0, OpKind.FORWARD, mb=1)
    put(c, 0, pos, replace(op_at(c, 0, pos), buffer=0))
    problems = check(c)
    assert problems_with(problems, 0, pos[0], "micro-batch 1 in slot 0, but its first op put it in slot 1")
    pos = locate(c, 1, OpKind.FORWARD, mb=1)
    put(c, 1, pos, replace(op_at(c, 1, pos), buffer=c.num_buffers[1]))
    assert problems_with(check(c), 1, pos[0], f"buffer {c.num_buffers[1]} outside")


# ---------------------------------------------------------------------------------------------
# Gradients and updates


def test_optimizer_step_before_reduce_grads():
    c = editable("1f1b", 2, 2)
    swap(c, 0, locate(c, 0, OpKind.REDUCE_GRADS), locate(c, 0, OpKind.OPTIMIZER_STEP))
    problems = check(c)
    (p,) = problems
    assert (p.stage, p.step, p.op) == (0, c.num_steps - 1, "optimizer_step()")
    assert "optimizer_step before the gradients it applies are reduced" in p.reason


def test_stage_step_between_start_and_wait_allreduce():
    c = editable("hippie", 4, 4)  # stage 3 is not deferred
    swap(c, 3, locate(c, 3, OpKind.WAIT_ALLREDUCE, target="grads"), locate(c, 3, OpKind.STAGE_OPTIMIZER_STEP))
    (p,) = check(c)
    assert (p.stage, p.op) == (3, "stage_optimizer_step()")
    assert "before the gradients it applies are reduced" in p.reason and "in flight" in p.reason


def test_apply_before_waiting_for_the_buffer_all_reduce():
    c = editable("hippie", 4, 4)  # stages 0 and 1 are deferred
    swap(c, 0, locate(c, 0, OpKind.WAIT_ALLREDUCE, target="buffer"), locate(c, 0, OpKind.APPLY_BUFFERED_UPDATE))
    # The first call has nothing buffered yet: only the second train_batch call shows it.
    assert check(c, iterations=1) == []
    (p,) = check(c)
    assert (p.stage, p.step, p.op) == (0, c.num_steps - 1, "apply_buffered_update()")
    assert "buffered gradient read before its all-reduce was waited for" in p.reason


def test_copy_grads_to_buffer_twice():
    c = editable("hippie", 4, 4)
    step, i = locate(c, 1, OpKind.COPY_GRADS_TO_BUFFER)
    c.streams[1][step].insert(i + 1, c.streams[1][step][i])
    problems = check(c)
    assert problems_with(problems, 1, step, "gradient buffer overwritten while live (state filled)")
    assert problems_with(problems, 1, step, "second update in one iteration")


def test_stage_without_update():
    c = editable("hippie", 4, 4)
    remove(c, 3, locate(c, 3, OpKind.STAGE_OPTIMIZER_STEP))
    (p,) = check(c)
    assert (p.stage, p.step, p.op) == (3, None, None)
    assert p.reason.startswith("stage 3 never applies or buffers its gradients")


def test_deferred_stage_never_applying_its_buffer():
    c = editable("hippie", 2, 2)
    remove(c, 0, locate(c, 0, OpKind.APPLY_BUFFERED_UPDATE))
    problems = check(c)
    step = locate(c, 0, OpKind.COPY_GRADS_TO_BUFFER)[0]
    assert len(problems) == 1  # the next call's copy lands on the reduced, unapplied buffer
    assert problems_with(problems, 0, step, "gradient buffer overwritten while live (state reduced)")


def test_buffer_reduced_but_not_applied_at_iteration_end():
    c = editable("hippie", 2, 2)
    remove(c, 0, locate(c, 0, OpKind.APPLY_BUFFERED_UPDATE))
    wait = remove(c, 0, locate(c, 0, OpKind.WAIT_ALLREDUCE, target="buffer"))
    start = locate(c, 0, OpKind.START_ALLREDUCE, target="buffer")
    start_op = c.streams[0][start[0]][start[1]]
    c.streams[0][wait.step] += [replace(start_op, step=wait.step), wait]  # copy, start, wait: reduced, left so
    assert Problem(
        0, None, None, "gradient buffer all-reduced but never applied (apply_buffered_update missing)"
    ) in check(c, iterations=1)


def test_backward_after_update():
    c = editable("gpipe", 2, 3)
    last = c.num_steps - 1
    b = remove(c, 0, locate(c, 0, OpKind.BACKWARD, mb=2))
    rg = remove(c, 0, locate(c, 0, OpKind.RECV_GRAD, mb=2))
    c.streams[0][last] += [rg, b]  # after reduce_grads and optimizer_step
    problems = check(c)
    assert problems_with(problems, 0, last, "backward after this iteration's optimizer_step")
    assert problems_with(problems, 0, last, "reduce_grads before all 3 backwards")


def test_grads_all_reduce_never_waited():
    c = editable("hippie-1f1b", 2, 2)  # stage 1 is not deferred
    remove(c, 1, locate(c, 1, OpKind.WAIT_ALLREDUCE, target="grads"))
    problems = check(c)
    assert problems_with(
        problems, 1, c.num_steps - 1, "stage_optimizer_step before the gradients it applies are reduced"
    )
    assert (
        Problem(
            1,
            None,
            None,
            "all-reduce of the gradients still in flight at the end of the iteration (no wait_allreduce(grads))",
        )
        in problems
    )


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


# ---------------------------------------------------------------------------------------------
# Split backward (zero-bubble): backward_input, then backward_weight, buffer alive until W


def test_weight_pass_before_its_input_pass_is_caught():
    c = editable("zb-h1", 2, 2)
    i0, w0 = locate(c, 1, OpKind.BACKWARD_INPUT, mb=0), locate(c, 1, OpKind.BACKWARD_WEIGHT, mb=0)
    swap(c, 1, i0, w0)
    assert problems_with(check(c), 1, i0[0], "backward_weight of micro-batch 0 before its backward_input")


def test_missing_weight_pass_is_caught():
    c = editable("zb-h1", 2, 3)
    remove(c, 0, locate(c, 0, OpKind.BACKWARD_WEIGHT, mb=1))
    assert any(p.stage == 0 and "micro-batch 1's backward_weight is missing" in p.reason for p in check(c))


def test_buffer_reused_before_its_weight_pass_is_caught():
    # stage 1 of zb-h1 (K=2) runs F0 I0 F1 I1 W0 ...: micro-batch 0 holds its slot until W0
    c = editable("zb-h1", 2, 4)
    c.streams[1] = [[replace(op, buffer=0) if op.micro_batch == 1 else op for op in step] for step in c.streams[1]]
    assert problems_with(
        check(c),
        1,
        3,
        "buffer overwritten while live: slot 0 still holds micro-batch 0",
        "used again at step 5 by backward_weight(mb=0)",
    )


def test_update_between_input_and_weight_pass_is_caught():
    c = editable("zb-h1", 2, 2)
    w1 = locate(c, 0, OpKind.BACKWARD_WEIGHT, mb=1)
    step = locate(c, 0, OpKind.OPTIMIZER_STEP)
    c.streams[0][w1[0]].insert(w1[1], replace(remove(c, 0, step), step=w1[0]))
    assert any("backward_weight after this iteration's optimizer_step" in p.reason for p in check(c))
