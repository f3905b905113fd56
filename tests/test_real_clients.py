"""Every schedule on a client in Megatron-DeepSpeed's shape (tests/distributed/megatron_shaped.py:
a parameterless first layer, a tied embedding whose last-stage copy leaves a parameter unused,
two parameter groups, a scheduler whose ``step`` needs an argument, clipping, a loop that never
calls ``drain()``), 2 stages x 2 replicas, in fp32, bf16 + ZeRO-1 (BF16_Optimizer) and bf16 + ZeRO-1
without ``data_types`` (DeepSpeedZeroOptimizer). Each trait crashed some
schedule at its first step once. One launch per precision runs every engine in turn.

Synchronous schedules must be bit-identical to stock DeepSpeed; the others must train with every
copy of the tied embedding equal, and step the client's scheduler as stock does.
"""
import math
from pathlib import Path

import pytest
import torch

from launch import launch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "distributed" / "megatron_shaped.py"
SYNCHRONOUS = ["1f1b", "gpipe", "zb-h1"]
# +all: hippie.deferred_layers "all" (clipping + tie group + whole-stage deferral);
# +drain: drain() after the last step (bf16 + clipping + tie: the tied copy's step alone)
OTHERS = {"fp32": ["hippie", "hippie-1f1b", "hippie-zb", "pipedream", "2bw+drain", "hippie+all+drain"],
          "bf16-zero1": ["hippie+drain", "hippie-1f1b", "2bw+drain", "pipedream+drain", "hippie+all+drain"],
          # bf16 + ZeRO-1 as users write it (no data_types): DeepSpeedZeroOptimizer, synchronous ones only
          "bf16-plain-zero1": []}
STEPS = 4


def _load(out, name):
    return [torch.load(f) for f in sorted(Path(out, name).glob("rank*.pt"))]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch, every precision's engines in turn (each launch costs ~15 s of start-up)."""
    out = tmp_path_factory.mktemp("clients")
    engines = [f"{p}:{name}" for p in sorted(OTHERS) for name in ["stock", *SYNCHRONOUS, *OTHERS[p]]]
    rc, log, _ = launch(4, out, "--steps", STEPS, "--engines", ",".join(engines), worker=WORKER, timeout=600)
    assert rc == 0, log[-5000:]
    assert "terminate called" not in log, log[-3000:]
    return out, log


@pytest.fixture(params=sorted(OTHERS))
def matrix(request, launched):
    out, log = launched
    precision = request.param
    names = ["stock", *SYNCHRONOUS, *OTHERS[precision]]
    return precision, {name: _load(out, f"{precision}:{name}") for name in names}, log


def _ranks_by_stage(ranks):
    return {(r["stage"], r["replica"]): r for r in ranks}


def test_synchronous_schedules_are_bit_identical_to_stock(matrix):
    _, runs, _ = matrix
    stock = _ranks_by_stage(runs["stock"])
    for name in SYNCHRONOUS:
        got = _ranks_by_stage(runs[name])
        assert got.keys() == stock.keys()
        for key, ref in stock.items():
            assert got[key]["losses"] == ref["losses"], (name, key)
            for layer, state in ref["layers"].items():
                for k, v in state.items():
                    assert torch.equal(got[key]["layers"][layer][k], v), (name, key, layer, k)


def test_every_schedule_trains_with_tied_copies_equal_and_the_clients_scheduler(matrix):
    """Tied copies: every holder and replica ends with the same word embedding (2bw, whose tie
    sum lags, after drain()). The scheduler is stepped as stock steps it: with the samples of
    the step when ``step()`` needs an argument."""
    _, runs, _ = matrix
    stock = runs["stock"][0]
    for name, ranks in runs.items():
        first = ranks[0]["losses"]
        assert all(math.isfinite(x) for x in first), name
        assert first[-1] < first[0], (name, first)
        copies = [r["tied"]["embed"] for r in ranks]
        assert all(torch.equal(c, copies[0]) for c in copies), (name, [float((c - copies[0]).abs().max())
                                                                       for c in copies])
        assert [r["lr"] for r in ranks] == [stock["lr"]] * len(ranks), name
        assert all(r["global_steps"] == STEPS for r in ranks), name


def test_a_loop_that_never_drains_is_told_at_exit(launched):
    """Nothing requires drain() (Megatron never calls it); a process that exits with updates in
    flight says so once per stage, and one that drained says nothing."""
    _, log = launched
    warned = {line.split("schedule ")[1].split()[0].strip("'") for line in log.splitlines()
              if "not applied to the weights in memory" in line}
    undrained = {name for names in OTHERS.values() for name in names if "drain" not in name}
    assert warned == undrained, (warned, undrained)
