"""Engine helpers that need DeepSpeed importable but no processes."""

import pickle
from dataclasses import replace

import pytest
import torch

from hippie_ds import schedules
from hippie_ds.schedules.ir import OpKind

BUILTINS = ("1f1b", "gpipe", "hippie", "hippie-1f1b")


def _find(c, stage, kind, mb):
    [(t, i)] = [
        (t, i)
        for t, step in enumerate(c.streams[stage])
        for i, op in enumerate(step)
        if op.kind == kind and op.micro_batch == mb
    ]
    return t, i


def _remove(c, stage, pos):
    return c.streams[stage][pos[0]].pop(pos[1])


def test_deepspeed_version_pin():
    from hippie_ds._compat import check_deepspeed_version

    check_deepspeed_version("0.19.8")
    check_deepspeed_version("0.19.10rc1")
    for bad in ("0.18.9", "0.19.0", "0.19.7", "0.20.0", "1.0.0"):
        with pytest.raises(ImportError, match=f"found DeepSpeed {bad}"):
            check_deepspeed_version(bad)


def test_builtins_receive_each_gradient_in_its_backward_step():
    # The engine keeps DeepSpeed's single received-gradient slot; every compiled built-in fits it.
    from hippie_ds.schedules.stage_checks import check_single_grad_slot

    for name in BUILTINS:
        for stages in range(1, 6):
            for micro_batches in (1, 3, 8):
                c = schedules.compile(name, stages, micro_batches, validate=False)
                for s in range(stages):
                    check_single_grad_slot(c, s)
    c = schedules.compile("gpipe", 3, 3, validate=False)
    rg = _remove(c, 0, _find(c, 0, OpKind.RECV_GRAD, mb=1))
    c.streams[0][rg.step - 1].insert(1, replace(rg, step=rg.step - 1))  # received one step early
    with pytest.raises(ValueError, match="receives the gradient of micro-batch 1 before the backward of micro-batch 0"):
        check_single_grad_slot(c, 0)


def test_in_flight_state_pickled_under_the_old_module_path_still_loads():
    # pickle.dumps(InFlightState({"step": 3}), protocol=2) (torch.save's protocol) as saved when the
    # module was hippie_ds.checkpoint_state, before the move to hippie_ds.adapter.
    from hippie_ds.adapter.checkpoint import state as ckpt

    old = b"\x80\x02chippie_ds.checkpoint_state\n_unwrap\nq\x00}q\x01X\x04\x00\x00\x00stepq\x02K\x03s\x85q\x03Rq\x04."
    with pytest.raises(ckpt.InFlightCheckpointError):
        pickle.loads(old)  # outside hippie-ds's load_checkpoint: refused, as before the move
    with ckpt.loading():
        state = pickle.loads(old)
    assert isinstance(state, ckpt.InFlightState) and state.payload == {"step": 3}


def test_a_gradient_aliasing_the_receive_buffer_is_copied_before_it_leaves():
    """An input gradient that is DeepSpeed's reused received-gradient buffer (a stage whose input
    reaches its output through views and identities) is copied before a non-blocking send or a
    local hand-over; any other is sent as it is."""
    from types import SimpleNamespace
    from hippie_ds.adapter.ds.stage import DeepSpeedStage
    from hippie_ds.adapter.stage.p2p import not_receive_buffer

    buf = torch.arange(12.0)
    received = buf[:6].view(2, 3)  # what _allocate_or_extend_buffers hands out
    engine = SimpleNamespace(_grad_layer_buf=[buf], grad_layer=received, grid=None, stage_id=0, global_rank=0)
    rt = SimpleNamespace(ds=DeepSpeedStage(engine))
    out = not_receive_buffer(rt, received)
    assert torch.equal(out, received) and out.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    fresh = torch.ones(2, 3)
    assert not_receive_buffer(rt, fresh) is fresh


def _fake_engine():
    from types import SimpleNamespace
    from hippie_ds.adapter.stage.chunk_selector import P2P_STATE

    chosen = []
    engine = SimpleNamespace(
        stage_id=0,
        prev_stage=-1,
        next_stage=1,
        is_pipe_partitioned=False,
        is_grad_partitioned=False,
        module=SimpleNamespace(set_chunk=chosen.append),
        **P2P_STATE,
    )
    return engine, chosen


def _selector(engine, layout, virtual_stages):
    """A ChunkSelector given what the engine's ``_init_chunks`` gives it."""
    from hippie_ds.adapter.ds.engine import Boundary
    from hippie_ds.adapter.stage.chunk_selector import ChunkSelector

    return ChunkSelector(
        layout,
        virtual_stages,
        engine.stage_id,
        Boundary(engine),
        engine.module.set_chunk,
        engine.is_pipe_partitioned or engine.is_grad_partitioned,
    )


def test_the_chunk_selector_keeps_each_chunks_p2p_state_and_neighbours():
    from hippie_ds.adapter.stage.chunk_selector import GRADIENT_TAG
    from hippie_ds.schedules.layout import Layout

    engine, chosen = _fake_engine()
    chunks = _selector(engine, Layout("v", 2, 2), 2)  # stage 0 holds parts 0 and 3
    assert chunks.both_ends and chunks.gradient_tag == GRADIENT_TAG and chunks.local(0) and not chunks.local(1)
    assert (chunks.is_first(), chunks.is_last()) == (True, True)  # outside ops: holds both ends
    chunks.select(0)
    assert (engine.prev_stage, engine.next_stage, chunks.is_first(), chunks.is_last()) == (-1, 1, True, False)
    engine.pipe_recv_buf, engine.first_output_send = "chunk 0's buffer", False
    chunks.select(1)  # part 3: after part 2 on stage 1, the last part
    assert (engine.prev_stage, engine.next_stage, chunks.is_first(), chunks.is_last()) == (1, 1, False, True)
    assert (engine.pipe_recv_buf, engine.first_output_send) == (None, True)  # its own boundary, fresh
    engine.pipe_recv_buf = "chunk 1's buffer"
    chunks.select(0)
    assert (engine.pipe_recv_buf, engine.first_output_send) == ("chunk 0's buffer", False)
    chunks.select(None)
    assert (engine.prev_stage, engine.next_stage, chunks.chunk) == (-1, 1, None)
    chunks.forget_shapes()  # reset_activation_shape: every chunk's boundary starts over
    chunks.select(1)
    assert engine.pipe_recv_buf is None and chosen == [0, 1, 0, None, 1]
    one, chosen = _fake_engine()
    plain = _selector(one, Layout("interleaved", 2, 1), 1)
    plain.select(0)
    assert (plain.chunk, chosen, plain.gradient_tag, plain.is_first(), plain.local(0)) == (None, [], 0, None, False)
    one.is_grad_partitioned = True  # tensor-slice parallelism: refused with chunks only
    _selector(one, Layout("interleaved", 2, 1), 1)
    with pytest.raises(ValueError, match="2 virtual stages do not support partitioned pipeline activations"):
        _selector(one, Layout("interleaved", 2, 2), 2)


def test_chunked_gradients_go_with_an_explicit_tag(monkeypatch):
    """The chunked gradient transfers pass tag= to deepspeed.comm themselves (DeepSpeed's p2p
    module is not rebound) and keep p2p's neighbour check."""
    from types import SimpleNamespace
    from deepspeed.runtime.pipe import p2p
    from hippie_ds.adapter.stage import chunk_selector

    calls = []
    monkeypatch.setattr(
        chunk_selector,
        "dist",
        SimpleNamespace(
            send=lambda t, dst, tag: calls.append(("send", dst, tag)),
            recv=lambda t, src, tag: calls.append(("recv", src, tag)),
            isend=lambda t, dst, tag: calls.append(("isend", dst, tag)),
        ),
    )
    stock = p2p.dist
    grid = SimpleNamespace(pipe_parallel_size=4, get_stage_id=lambda: 0, stage_to_global=lambda stage_id: 10 + stage_id)
    t = torch.zeros(1)
    chunk_selector.send(grid, t, 1, chunk_selector.GRADIENT_TAG)
    chunk_selector.recv(grid, t, 3, chunk_selector.GRADIENT_TAG)  # the wrap-around link
    chunk_selector.isend(grid, t, 1, chunk_selector.ACTIVATION_TAG)
    assert calls == [("send", 11, 1), ("recv", 13, 1), ("isend", 11, 0)] and p2p.dist is stock
    with pytest.raises(RuntimeError, match="p2p between stages 0 and 2"):
        chunk_selector.send(grid, t, 2, chunk_selector.GRADIENT_TAG)


def _stage_step(engine, **kwargs):
    """A StageStep given what build.py gives it from ``engine`` (no gradient store)."""
    from hippie_ds.adapter.ds.engine import ModelStep
    from hippie_ds.adapter.precision.step import StageStep

    return StageStep(
        engine.optimizer,
        getattr(engine, "mpu", None),
        getattr(engine, "grid", None),
        ModelStep(engine),
        store=None,
        fp16=engine.fp16_enabled(),
        **kwargs,
    )


def test_a_stage_step_swaps_everything_in_one_place_and_puts_it_back_on_failure():
    from types import SimpleNamespace

    optimizer = SimpleNamespace(param_groups=[{"lr": 0.1}, {"lr": 0.2}], mpu="stock mpu", clip_grad=1.0)
    engine = SimpleNamespace(
        optimizer=optimizer,
        mpu="stock mpu",
        grid=SimpleNamespace(),
        lr_scheduler="schedule",
        global_steps=7,
        global_samples=70,
        skipped_steps=1,
        fp16_enabled=lambda: False,
        _config=SimpleNamespace(gradient_clipping=1.0),
        _force_grad_boundary=False,
    )
    before = {**vars(engine), "lrs": [0.1, 0.2], "optimizer_mpu": "stock mpu", "clip_grad": 1.0, "config": 1.0}

    def state():
        return {
            **vars(engine),
            "lrs": [g["lr"] for g in optimizer.param_groups],
            "optimizer_mpu": optimizer.mpu,
            "clip_grad": optimizer.clip_grad,
            "config": engine._config.gradient_clipping,
        }

    stage = _stage_step(engine, clip_group="tie group", clips_itself=True)
    with pytest.raises(RuntimeError, match="the step failed"):
        with stage.swapped(counters=False, lrs=[0.5, 0.6]) as local:
            assert engine.mpu is local and optimizer.mpu is local and local.get_model_parallel_group() == "tie group"
            assert ([g["lr"] for g in optimizer.param_groups], engine.lr_scheduler) == ([0.5, 0.6], None)
            clipping = (engine._config.gradient_clipping, optimizer.clip_grad, engine._force_grad_boundary)
            assert clipping == (0.0, 0.0, True)
            # what _take_model_step advances
            engine.global_steps, engine.global_samples, engine.skipped_steps = 8, 80, 2
            raise RuntimeError("the step failed")
    assert state() == before
    with stage.swapped(tie_norm=False) as local:  # an update with counters: they advance, the LRs stay the schedule's
        assert local._clip_group is None
        engine.global_steps, optimizer.param_groups[0]["lr"] = 8, 0.3
    assert (engine.global_steps, optimizer.param_groups[0]["lr"], engine.mpu) == (8, 0.3, "stock mpu")


def test_the_call_cursor_skips_fill_and_drained_batches_and_restores_from_a_checkpoint():
    from hippie_ds.adapter.stage.call_cursor import CallCursor

    cursor = CallCursor()
    cursor.start()
    cursor.keep_lrs([0.1])
    assert cursor.skips(-1) and not cursor.skips(0) and cursor.lrs(0) == [0.1] and cursor.lrs(-1) is None
    cursor.advance()
    cursor.start()
    cursor.keep_lrs([0.2])  # call 1: an op of batch -1 is call 0's, at call 0's rates
    assert (cursor.batch(-1), cursor.lrs(-1), cursor.in_flight, cursor.skips(-1)) == (0, [0.1], True, False)
    cursor.advance()
    cursor.start()  # a drain: relative to the call that would come next
    cursor.drained()
    assert (cursor.first_batch, cursor.in_flight, cursor.skips(-1), cursor.skips(0)) == (2, False, True, False)
    for _ in range(3):
        cursor.start()
        cursor.keep_lrs([0.3])
        cursor.advance()
    assert cursor.lrs(-3) is None and cursor.lrs(-2) == [0.3]  # rates kept for two calls back only (batch 1 dropped)
    resumed = CallCursor()
    resumed.load_state_dict(cursor.state_dict())
    assert (resumed.call, resumed.op_call, resumed.first_batch, resumed.in_flight) == (5, 5, 5, False)


def test_an_fp16_wrapper_that_cannot_step_per_stage_is_refused_when_the_engine_is_built():
    """An fp16 wrapper other than FP16_UnfusedOptimizer, FP16_Optimizer (DeepSpeed's fused Adam, which
    steps per stage: tests/adapter/precision/test_fp16_gpt.py) and ZeRO-1's: a schedule with per-stage
    updates refuses it as the engine is built, on every rank."""
    from types import SimpleNamespace
    from hippie_ds import schedules

    class OnebitWrapper:  # a wrapper hippie-ds does not know
        param_groups = []

    engine = SimpleNamespace(optimizer=OnebitWrapper(), fp16_enabled=lambda: True)
    with pytest.raises(
        ValueError,
        match="schedule 'hippie' in fp16 needs DeepSpeed's FP16_UnfusedOptimizer.*FP16_Optimizer.*not OnebitWrapper",
    ):
        _stage_step(engine, schedule=schedules.compile("hippie", 2, 4))
    _stage_step(engine, schedule=schedules.compile("zb-h1", 2, 4))  # DeepSpeed's own step: stock's path
