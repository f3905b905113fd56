"""The bench's memory count (tools.bench.engines.state_bytes) against an independent count on real
ranks: every live tensor storage of the rank process after ``train_batch`` (gc, each storage once).
A deferred stage's in-flight state (its gradient buffer, the staleness correction's deltas) is
counted: what the independent count finds beyond the bench's is the same few bytes with the
deferral as without it."""

import json
from pathlib import Path

import pytest
import torch

from launch import launch
from tools.bench.cluster import LocalJob

BENCH_WORKER = Path(__file__).parents[2] / "tools" / "bench" / "workers" / "bench_worker.py"

pytestmark = pytest.mark.distributed


def _memory(out, name):
    return {d["stage"]: d["memory"] for d in (torch.load(f) for f in sorted((out / name).glob("rank*.pt")))}


def test_the_bench_counts_a_deferred_stages_in_flight_state(tmp_path):
    common = (
        "--stages",
        2,
        "--micro-batches",
        4,
        "--steps",
        2,
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--memory-count",
        "--engines",
        "hippie",
    )
    for name, deferred in (("deferred", "0"), ("none", "")):  # apart: one engine per process, no leftovers
        rc, log, _ = launch(2, tmp_path / name, *common, "--deferred", deferred)
        assert rc == 0, log[-4000:]
    deferred, none = _memory(tmp_path / "deferred", "hippie"), _memory(tmp_path / "none", "hippie")
    for stage in (0, 1):
        uncounted = {
            run: m[stage]["live"] - m[stage]["bench_alive"] for run, m in (("deferred", deferred), ("none", none))
        }
        # the bench misses nothing the deferral adds; what it leaves out (losses, labels) is small
        assert uncounted["deferred"] == uncounted["none"], (stage, uncounted)
        assert 0 <= uncounted["none"] < 1024, (stage, uncounted)
    # stage 0 (deferred) holds a gradient buffer and the prediction's delta: fp32, one value per delayed element
    added = deferred[0]["bench"] - none[0]["bench"]
    assert added > 0 and added % 8 == 0, added
    assert deferred[1]["bench"] == none[1]["bench"]


def test_the_loss_stage_keeps_no_output_after_its_backward(tmp_path):
    """DeepSpeed's ``_exec_backward_pass`` returns on the last stage before it frees the buffer's output,
    so its stock engine keeps, after the step, every pipe buffer's output and, through its autograd
    graph, the stage input (an LM head: the logits and the hidden state); hippie-ds's backward drops
    them. The independent count finds exactly those bytes more on stock's loss stage, and the same
    on the first stage."""
    from model import MICRO_BATCH_SIZE, OUT, WIDTH

    uncounted = {}
    for engine in ("stock", "1f1b"):
        rc, log, _ = launch(
            2,
            tmp_path / engine,
            "--stages",
            2,
            "--micro-batches",
            4,
            "--steps",
            2,
            "--memory-count",
            "--engines",
            engine,
        )
        assert rc == 0, log[-4000:]
        uncounted[engine] = {s: m["live"] - m["bench_alive"] for s, m in _memory(tmp_path / engine, engine).items()}
    assert uncounted["stock"][0] == uncounted["1f1b"][0], uncounted  # the first stage: the same either way
    buffers = 2  # DeepSpeed's TrainSchedule on the last stage: max(2, min(stages - stage, micro-batches))
    kept = buffers * MICRO_BATCH_SIZE * (OUT + WIDTH) * 4  # fp32 output and input per buffer
    assert uncounted["stock"][1] - uncounted["1f1b"][1] == kept, uncounted


def test_each_engine_in_a_bench_process_counts_only_what_it_holds(tmp_path):
    """The bench builds every pipeline engine of a row in one process; what one still holds (stock's
    loss stage: its buffers' outputs) is not another's saved memory. Each engine has its own meter."""
    args = ["--out", tmp_path, "--schedules", "stock,1f1b", "--stages", 2, "--micro-batches", 4]
    args += ["--micro-batch-size", 2, "--memory", "--warmup", 1, "--steps", 1, "--rounds", 2]
    args += ["--d-model", 32, "--heads", 2, "--layers", 2, "--vocab", 128, "--seq", 8]
    run = LocalJob(BENCH_WORKER, 2, [str(a) for a in args]).run(240)
    assert run.returncode == 0, run.output[-4000:]

    def steps(label, rank):
        return json.loads((tmp_path / "raw" / label / f"rank{rank}.steps.json").read_text())["steps"]

    stock, ours = steps("stock", 1), steps("1f1b", 1)  # the loss stage
    assert all(s["saved_after_bytes"] > 0 for s in stock), stock  # DeepSpeed keeps the outputs
    assert all(s["saved_after_bytes"] == 0 for s in ours), ours  # hippie-ds's backward dropped them
    # the same schedule, the same saved tensors: stock's peak is hippie-ds's plus what it kept
    assert ours[-1]["saved_peak_bytes"] + stock[-1]["saved_after_bytes"] >= stock[-1]["saved_peak_bytes"]
    assert ours[-1]["saved_peak_bytes"] < stock[-1]["saved_peak_bytes"]
