"""Engine helpers that need DeepSpeed importable but no processes."""
import pickle
from dataclasses import replace

import pytest
import torch

from hippie_ds import schedules
from hippie_ds.schedules.ir import OpKind

BUILTINS = ("1f1b", "gpipe", "hippie", "hippie-1f1b")


def _find(c, stage, kind, mb):
    [(t, i)] = [(t, i) for t, step in enumerate(c.streams[stage]) for i, op in enumerate(step)
                if op.kind == kind and op.micro_batch == mb]
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
    from hippie_ds.adapter.engine import check_single_grad_slot
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
    from hippie_ds.adapter import checkpoint_state as ckpt
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
    from hippie_ds.adapter.engine import HippiePipelineEngine
    buf = torch.arange(12.0)
    received = buf[:6].view(2, 3)  # what _allocate_or_extend_buffers hands out
    engine = SimpleNamespace(_grad_layer_buf=[buf], grad_layer=received)
    out = HippiePipelineEngine._not_receive_buffer(engine, received)
    assert torch.equal(out, received) and out.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    fresh = torch.ones(2, 3)
    assert HippiePipelineEngine._not_receive_buffer(engine, fresh) is fresh
