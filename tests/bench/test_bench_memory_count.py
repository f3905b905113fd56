"""The bench's memory count (tools.bench.engines.state_bytes) against an independent count on real
ranks: every live tensor storage of the rank process after ``train_batch`` (gc, each storage once).
A deferred stage's in-flight state (its gradient buffer, the staleness correction's deltas) is
counted: what the independent count finds beyond the bench's is the same few bytes with the
deferral as without it."""

import pytest
import torch

from launch import launch

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
