"""A long run keeps its timeline bounded and its handles flat: python -m tools.bench soak on 4 real ranks
(short here; `make soak` runs 1,000 steps and also checks resident memory, which is a
measurement and not asserted in tests)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def test_timeline_window_and_handles_stay_flat(tmp_path):
    out = tmp_path / "soak"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench",
            "soak",
            "--out",
            str(out),
            "--steps",
            "90",
            "--warmup",
            "30",
            "--sample-every",
            "15",
            "--timeline-steps",
            "12",
            "--max-rss-growth",
            "1.0",
            "--timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for rank in report["ranks"]:
        assert rank["timeline_steps_kept"] == 12  # the window, not the 90 steps run
        assert rank["fds_growth"] <= 0 and rank["threads_growth"] <= 0 and rank["shm_growth"] <= 0
    for path in (out / "timeline").glob("rank*.json"):
        written = json.loads(path.read_text())
        assert sorted({e["step"] for e in written["events"]}) == list(range(78, 90))
        assert written["steps_kept"] == 12
