"""Engine helpers that need DeepSpeed importable but no processes."""
from dataclasses import replace

import pytest

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
    for bad in ("0.18.9", "0.20.0", "1.0.0"):
        with pytest.raises(ImportError, match=f"found DeepSpeed {bad}"):
            check_deepspeed_version(bad)


def test_builtins_receive_each_gradient_in_its_backward_step():
    # The engine keeps DeepSpeed's single received-gradient slot; every compiled built-in fits it.
    from hippie_ds.engine import check_single_grad_slot
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
