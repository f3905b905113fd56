"""Measure, then choose: ``python -m tools.bench cut-sweep`` trains a plan's top
candidates on the GPT example in rotated rounds, reports measured against predicted ranking, and
writes the measured best as a plan file when it is not the plan. The figures are checked on given
measurements (pure); the tiny job checks the whole path (profile in place, plan, candidates' plan
files, one round, the report and the plan output) without asserting any timing."""

import json
import os

import pytest

from hippie_ds.planner import load_plan, load_profile
from tools.bench.studies import cut_sweep
from tools.bench.studies.cut_sweep_report import ranks, report, summarize

CANDIDATES = [
    dict(label="plan", schedule="1f1b", boundaries=[0, 5, 10], predicted_step=0.10),
    dict(label="cut 1", schedule="1f1b", boundaries=[0, 6, 10], predicted_step=0.11),
    dict(label="cut 2", schedule="1f1b", boundaries=[0, 4, 10], predicted_step=0.12),
]


def test_measured_against_predicted_ranking():
    assert ranks([0.3, 0.1, 0.2]) == [3, 1, 2]
    s = summarize(CANDIDATES, [[0.100, 0.120, 0.090], [0.090, 0.100, 0.080], [0.095, 0.130, 0.100]])
    assert s["rounds"] == 3 and s["best"] == 1 and s["best_holds_every_round"]
    assert [r["measured_rank"] for r in s["candidates"]] == [2, 1, 3]
    assert [r["predicted_rank"] for r in s["candidates"]] == [1, 2, 3] and not s["same_ranking"]
    assert s["candidates"][1]["vs_plan"] == pytest.approx(0.08 / 0.09) and s["candidates"][1][
        "vs_plan_range"
    ] == pytest.approx([100 / 120, 0.9])
    assert s["plan_over_best"] == pytest.approx(0.1 / 0.09 - 1) and not s["target_met"]
    text = report(s, ["head"])
    assert (
        text.startswith("head\n")
        and "| **cut 1** | 1f1b | `[0, 6, 10]` | 110.0 | 2 | 90.0 (90.0, 100.0, 80.0) |" in text
        and "the 5% target is missed" in text
    )
    quiet = summarize(CANDIDATES, [[0.1], [0.1], [0.1]], [[0.1, 0.2, 0.3, 0.4, 0.5], [0.3, 0.3, 0.3], [0.05, 0.5]])
    assert [r["lower_quartile"] for r in quiet["candidates"]] == pytest.approx([0.2, 0.3, 0.1625])
    assert [r["lower_quartile_rank"] for r in quiet["candidates"]] == [2, 3, 1]
    assert "| 200.0 (2) |" in report(quiet) and "lower quartile ms (rank)" in report(quiet)
    assert "lower quartile" not in report(s)
    mine = summarize(CANDIDATES, [[0.09, 0.1], [0.1, 0.09], [0.2, 0.2]])  # the plan ties the best: no new plan
    assert mine["best"] == 0 and mine["target_met"] and not mine["best_holds_every_round"]
    with pytest.raises(ValueError, match="every candidate needs a measured step in every round"):
        summarize(CANDIDATES, [[0.1], [0.1], []])


def test_cli_help_and_bad_options(capsys):
    with pytest.raises(SystemExit) as info:
        cut_sweep.parse_args(["--help"])
    assert info.value.code == 0 and "cut-sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cut_sweep.parse_args(["--out", "x", "--plan", "p.json"])
    assert info.value.code == 2 and "--plan and --profile come together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cut_sweep.parse_args(["--out", "x", "--steps", "3", "--skip", "3"])


def test_every_single_boundary_cut():
    assert cut_sweep.every_cut([0, 3, 6]) == [[0, 1, 6], [0, 2, 6], [0, 4, 6], [0, 5, 6]]
    assert cut_sweep.every_cut([0, 1, 3, 4]) == [[0, 2, 3, 4], [0, 1, 2, 4]]
    args = cut_sweep.parse_args(["--out", "x", "--vocab", "32000", "--schedules", "zb-h1", "--only", "every-cut"])
    assert args.model_args == "--layers 8 --vocab 32000" and args.schedules == "zb-h1"


@pytest.mark.distributed
def test_every_cut_of_a_large_vocabulary_planned_with_one_schedule(tmp_path):
    """--only every-cut trains the plan and every other single-boundary cut; --vocab reaches the model;
    --schedules reaches the planner."""
    out = tmp_path / "every"
    code = cut_sweep.main(
        [
            "--out",
            str(out),
            "--rounds",
            "1",
            "--steps",
            "2",
            "--skip",
            "1",
            "--only",
            "every-cut",
            "--schedules",
            "1f1b",
            "--vocab",
            "512",
            "--profile-steps",
            "1",
            "--model-args",
            "--dim 16 --layers 2 --seq-len 8",
            "--launcher",
            os.environ.get("HIPPIE_TEST_LAUNCHER", "fork"),
        ]
    )
    assert code == 0
    plan = load_plan(out / "plan.json")
    assert plan.schedule == "1f1b"
    rows = json.loads((out / "sweep.json").read_text())["candidates"]
    assert sorted(r["boundaries"][1] for r in rows) == [1, 2, 3]  # embedding, 2 blocks, head: 3 cuts
    assert max(layer.param_bytes for layer in load_profile(out / "profile.yaml").layers) >= 512 * 16 * 4


@pytest.mark.distributed
def test_a_tiny_sweep_writes_its_report_and_the_measured_best_plan(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = cut_sweep.main(
        [
            "--out",
            str(out),
            "--rounds",
            "1",
            "--steps",
            "2",
            "--skip",
            "1",
            "--top",
            "3",
            "--only",
            "cut",
            "--profile-steps",
            "1",
            "--model-args",
            "--dim 16 --layers 3 --seq-len 8",
            "--launcher",
            os.environ.get("HIPPIE_TEST_LAUNCHER", "fork"),
        ]
    )
    assert code == 0
    plan = load_plan(out / "plan.json")
    assert (plan.pipeline_depth, plan.data_parallel, plan.micro_batch_size, plan.global_batch) == (2, 1, 4, 16)
    sweep = json.loads((out / "sweep.json").read_text())
    rows = sweep["candidates"]
    assert len(rows) == 3 and rows[0]["boundaries"] == plan.boundaries
    assert all(len(r["measured_steps"]) == 1 and r["measured_step"] > 0 and r["lower_quartile"] > 0 for r in rows)
    assert all(r["schedule"] == plan.schedule and r["boundaries"] != plan.boundaries for r in rows[1:])
    assert sorted(r["measured_rank"] for r in rows) == [1, 2, 3]
    best = out / "measured_best_plan.json"
    if sweep["best"] == 0:
        assert not best.exists()
    else:  # the measured best's own plan file, which a job trains with
        assert load_plan(best).boundaries == rows[sweep["best"]]["boundaries"]
        assert sweep["measured_best_plan"] == str(best)
    assert "Measured best:" in (out / "report.md").read_text()


@pytest.mark.distributed
def test_the_plan_against_the_job_as_it_is(tmp_path):
    """--only job trains the plan and the profiled job's own config (no plan: its stages, micro-batch,
    schedule and the example's uniform cut), with the plan's prediction of that job beside it."""
    out = tmp_path / "job"
    code = cut_sweep.main(
        [
            "--out",
            str(out),
            "--rounds",
            "2",
            "--steps",
            "2",
            "--skip",
            "1",
            "--only",
            "job",
            "--profile-steps",
            "1",
            "--model-args",
            "--dim 16 --layers 3 --seq-len 8",
            "--launcher",
            os.environ.get("HIPPIE_TEST_LAUNCHER", "fork"),
        ]
    )
    assert code == 0
    plan = load_plan(out / "plan.json")
    rows = json.loads((out / "sweep.json").read_text())["candidates"]
    assert [r["label"] for r in rows] == ["plan", "job as it is"]
    job = next(b for b in plan.baselines if (b.name, b.schedule) == ("job:uniform", "1f1b"))
    assert rows[1]["predicted_step"] == job.prediction.step_time and rows[1]["boundaries"] == job.boundaries
    assert all(len(r["measured_steps"]) == 2 and r["measured_step"] > 0 for r in rows)
    config = json.loads((out / "job_config.json").read_text())
    assert config["pipeline"] == {"schedule": "1f1b"} and config["train_micro_batch_size_per_gpu"] == 4
    assert "hippie" not in config
