"""Every row of python -m tools.bench scaling at its own time dilation (tools/bench/studies/row_dilation.py):
which rows are rerun at which D (up to 64), --resume skipping the reruns that finished, the D read back
for the analysis, and every figure divided by the row's own D. The job runner is a fake that writes the
records a worker writes (rank*.steps.json, raw/done.json); nothing runs on a cluster."""

import json

import pytest

from tools.bench.cluster import parse_rate
from tools.bench.studies import row_dilation, scaling
from tools.bench.studies.scaling_report import dilation_cell, nodes_table

# a worker's records as analysis.load_run / analyse_job read them
STAGES, MICRO_BATCHES, MICRO_BATCH_SIZE = 4, 8, 32


def _args(out, *extra):
    return scaling.parse_args(
        ["--out", str(out), "--nodes", "1,2", "--rounds", "2", "--dilate", "16", "--no-single", *extra]
    )


def write_row(run_dir, label, d, wait, step=1.0, nodes=2, state=1e3, rounds=2, steps=2):
    """One label's records at dilation ``d``: every timed step ``step`` x ``d`` long (``step``: the
    undilated step), every rank's main thread waiting ``wait`` of it, the tensors' bytes the same at
    every D (scaling.dilated slows the link instead); raw/done.json as a finished worker leaves it."""
    world = nodes * STAGES if label != "dp" else nodes * STAGES
    raw = run_dir / "raw" / label
    raw.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        t, records = 100.0, []
        for r in range(rounds):
            for i in range(steps + 1):
                records.append(
                    {
                        "round": r,
                        "index": i,
                        "warmup": i == 0,
                        "start": t,
                        "end": t + step * d,
                        "loss": 1.0,
                        "cpu_s": 0.1 * step * d,
                        "runqueue_wait_s": wait * step * d,
                        "saved_peak_bytes": 500.0,
                    }
                )
                t += step * d
        (raw / f"rank{rank}.steps.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "stage": rank % STAGES if label != "dp" else 0,
                    "stages": STAGES if label != "dp" else 1,
                    "world": world,
                    "schedule": label,
                    "params": 10,
                    "t0": 100.0,
                    "micro_batch_size": MICRO_BATCH_SIZE,
                    "micro_batches": MICRO_BATCHES,
                    "parts": None,
                    "memory": {"state_bytes": state},
                    "steps": records,
                }
            )
        )
    (run_dir / "raw" / "done.json").write_text("{}")


class FakeRunner:
    """run(options at D, the row's job, its run directory): records the call, writes the records of
    that row at that D with the wait ``waits[(schedule, D)]``."""

    def __init__(self, waits, steps=None):
        self.waits, self.steps, self.calls = waits, steps or {}, []

    def __call__(self, a_d, job, run_dir):
        (s,) = job["schedules"]
        self.calls.append((s, a_d.dilate, run_dir))
        write_row(
            run_dir, job["labels"], a_d.dilate, self.waits[(s, a_d.dilate)], self.steps.get(s, 1.0), nodes=job["nodes"]
        )


def test_dilations_double_up_to_64():
    assert row_dilation.dilations(16) == [16, 32, 64]
    assert row_dilation.dilations(4) == [4, 8, 16, 32, 64]
    assert row_dilation.dilations(48) == [48] and row_dilation.dilations(64) == [64]
    assert row_dilation.dilations(16, d_max=16) == [16]  # --max-dilate = --dilate: no reruns


def test_only_rows_that_waited_rerun_alone_at_2d_until_host_free_stopping_at_64(tmp_path):
    a = _args(tmp_path, "--schedules", "1f1b,hippie-1f1b,gpipe")
    job = next(j for j in scaling.run_plan(a) if j["dir"] == "two_nodes")
    base = tmp_path / "runs" / "two_nodes"
    for label, wait in (("stock", 0.01), ("hippie-1f1b", 0.09), ("gpipe", 0.20)):  # the job at D = 16
        write_row(base, label, 16, wait)
    run = FakeRunner({("hippie-1f1b", 32): 0.03, ("gpipe", 32): 0.12, ("gpipe", 64): 0.08})
    tried = row_dilation.rerun_rows(a, tmp_path, job, run, log=lambda *x, **k: None)
    runs = tmp_path / "runs"
    assert run.calls == [
        ("hippie-1f1b", 32, runs / "D32" / "two_nodes_hippie-1f1b"),
        ("gpipe", 32, runs / "D32" / "two_nodes_gpipe"),
        ("gpipe", 64, runs / "D64" / "two_nodes_gpipe"),
    ]  # 64: the last, though it waited
    assert tried["1f1b"] == [(16, pytest.approx(0.01))]  # host-free at the job's D: not rerun
    assert [d for d, _ in tried["gpipe"]] == [16, 32, 64]
    # the analysis reads the same D back from the records: the first host-free one, else the last
    for s, d, where in (
        ("1f1b", 16, base),
        ("hippie-1f1b", 32, runs / "D32" / "two_nodes_hippie-1f1b"),
        ("gpipe", 64, runs / "D64" / "two_nodes_gpipe"),
    ):
        got_d, got_dir, one, got_tried = row_dilation.chosen_run(a, tmp_path, job, s)
        assert (got_d, got_dir) == (d, where) and got_tried == tried[s]
        assert one["schedules"] == [s] if d != 16 else one is job
    # the rerun's job runs that one schedule at its D: its times x D, its tensors' size kept, the link's
    # bandwidth the rate / D (scaling.job_args)
    one = row_dilation.row_job(job, "hippie-1f1b", None)
    args = scaling.job_args(row_dilation.at_dilation(a, 32), one, runs / "D32" / "two_nodes_hippie-1f1b")
    assert args[args.index("--schedules") + 1] == "hippie-1f1b"
    assert float(args[args.index("--emulate-scale") + 1]) == pytest.approx(a.emulate_scale)
    assert float(args[args.index("--emulate-speedup") + 1]) == pytest.approx(a.emulate_speedup / 32)
    assert float(args[args.index("--allreduce-bandwidth") + 1]) == pytest.approx(
        parse_rate(a.rate) * a.link_efficiency / 32
    )
    assert args[args.index("--rounds") + 1] == "2" and args[args.index("--steps") + 1] == str(a.steps)


def test_resume_runs_again_only_the_reruns_that_did_not_finish(tmp_path):
    a = _args(tmp_path, "--schedules", "1f1b,gpipe", "--resume")
    job = next(j for j in scaling.run_plan(a) if j["dir"] == "two_nodes")
    write_row(tmp_path / "runs" / "two_nodes", "stock", 16, 0.2)
    write_row(tmp_path / "runs" / "two_nodes", "gpipe", 16, 0.01)
    waits = {("1f1b", 32): 0.07, ("1f1b", 64): 0.02}
    quiet = {"log": lambda *x, **k: None}
    first = FakeRunner(waits)
    row_dilation.rerun_rows(a, tmp_path, job, first, **quiet)
    assert [(s, d) for s, d, _ in first.calls] == [("1f1b", 32), ("1f1b", 64)]
    again = FakeRunner(waits)
    assert row_dilation.rerun_rows(a, tmp_path, job, again, **quiet)["1f1b"] == [
        (16, pytest.approx(0.2)),
        (32, pytest.approx(0.07)),
        (64, pytest.approx(0.02)),
    ]
    assert again.calls == []  # every rerun finished: none runs again
    (tmp_path / "runs" / "D64" / "two_nodes_1f1b" / "raw" / "done.json").unlink()  # stopped before its end
    again = FakeRunner(waits)
    row_dilation.rerun_rows(a, tmp_path, job, again, **quiet)
    assert [(s, d) for s, d, _ in again.calls] == [("1f1b", 64)]


def test_max_dilate_at_the_job_s_d_reruns_nothing(tmp_path):
    a = _args(tmp_path, "--schedules", "1f1b", "--max-dilate", "16")
    job = next(j for j in scaling.run_plan(a) if j["dir"] == "two_nodes")
    write_row(tmp_path / "runs" / "two_nodes", "stock", 16, 0.3)
    run = FakeRunner({})
    assert (
        row_dilation.rerun_rows(a, tmp_path, job, run, log=lambda *x, **k: None) == {"1f1b": [(16, pytest.approx(0.3))]}
        and run.calls == []
    )


def test_a_planned_row_is_rerun_at_its_new_d_with_the_plan_made_at_the_job_s(tmp_path):
    """The row is its plan: rerun at 2D, it runs the same plan file (planned afresh, the planner would
    spend the host 2D frees and the new plan wait as much)."""
    a = _args(tmp_path, "--schedules", "planned")
    plan16 = {"schedule": "hippie", "file": "p16.json", "pipeline_depth": 4, "micro_batch_size": 8, "micro_batches": 32}
    a.planned = {(2, "planned"): plan16}
    job = next(j for j in scaling.run_plan(a) if j["dir"] == "two_nodes_planned")
    assert job["labels"] == "hippie" and job["plan"] is plan16
    write_row(tmp_path / "runs" / "two_nodes_planned", "hippie", 16, 0.097)
    jobs = []

    def run(a_d, one, run_dir):
        jobs.append(one)
        write_row(run_dir, one["labels"], a_d.dilate, 0.045)

    tried = row_dilation.rerun_rows(a, tmp_path, job, run, log=lambda *x, **k: None)
    assert tried["planned"] == [(16, pytest.approx(0.097)), (32, pytest.approx(0.045))]
    assert jobs[0]["labels"] == "hippie" and jobs[0]["plan"] is plan16
    assert (tmp_path / "runs" / "D32" / "two_nodes_planned" / "raw" / "hippie").is_dir()
    args = scaling.job_args(row_dilation.at_dilation(a, 32), jobs[0], tmp_path / "x")
    assert args[args.index("--plan-config") + 1] == "p16.json"


def test_a_row_at_d_32_beside_rows_at_16_reports_its_times_over_its_own_d(tmp_path, monkeypatch):
    """End to end from the records: analyse (each row from the run at its D) then summarize. The
    undilated steps: stock 1F1B 1.0 s, hippie-1f1b 0.5 s (rerun at D = 32), GPipe 0.8 s; the same on one
    node. The simulator is not what is checked here: its prediction is stubbed."""
    from tools.bench import analysis

    monkeypatch.setattr(analysis, "job_prediction", lambda *args: ({}, {"step_time": None}))
    a = _args(tmp_path, "--schedules", "1f1b,hippie-1f1b,gpipe")
    undilated = {"1f1b": 1.0, "hippie-1f1b": 0.5, "gpipe": 0.8}
    for job in scaling.run_plan(a):
        for s, label in (("1f1b", "stock"), ("hippie-1f1b", "hippie-1f1b"), ("gpipe", "gpipe")):
            wait = 0.09 if (s, job["nodes"]) == ("hippie-1f1b", 2) else 0.01
            write_row(tmp_path / "runs" / job["dir"], label, 16, wait, undilated[s], nodes=job["nodes"])
        run = FakeRunner({("hippie-1f1b", 32): 0.02}, undilated)
        row_dilation.rerun_rows(a, tmp_path, job, run, log=lambda *x, **k: None)
    runs = scaling.analyse(a, tmp_path, None)
    two = runs["two_nodes"]
    assert two["hippie-1f1b"]["dilation"] == 32 and two["1f1b"]["dilation"] == 16
    assert two["hippie-1f1b"]["median_step_s"] == pytest.approx(0.5 * 32)  # the run's own, dilated
    s = scaling.summarize(runs, a.node_counts, a.emulate_scale, {}, 2, a.dilate)
    rows = s["by_nodes"]["2"]
    assert rows["hippie-1f1b"]["dilation"] == 32 and rows["gpipe"]["dilation"] == 16
    assert rows["hippie-1f1b"]["step_s"] == pytest.approx(0.5) and rows["1f1b"]["step_s"] == pytest.approx(1.0)
    assert rows["hippie-1f1b"]["throughput"] == pytest.approx(MICRO_BATCHES * MICRO_BATCH_SIZE * 2 / 0.5)
    assert rows["hippie-1f1b"]["vs_1f1b"] == pytest.approx(2.0) and rows["gpipe"]["vs_1f1b"] == pytest.approx(1.25)
    # scaling 1 -> 2 nodes: hippie-1f1b at 32 on two nodes against its one-node run at 16
    assert rows["hippie-1f1b"]["scaling"] == pytest.approx(1.0) and rows["1f1b"]["scaling"] == pytest.approx(1.0)
    # memory: the tensors' bytes are the same at D = 32 and 16
    assert rows["hippie-1f1b"]["memory_bytes"] == pytest.approx(rows["1f1b"]["memory_bytes"])
    assert rows["hippie-1f1b"]["waited_for_core"] is False  # its figure: the host-free run
    assert [t["dilation"] for t in rows["hippie-1f1b"]["dilation_tried"]] == [16, 32]
    assert dilation_cell(rows["hippie-1f1b"]) == "32 (16: 9.0%)" and dilation_cell(rows["1f1b"]) == "16"
    assert "| hippie-1f1b | 4 stages x 2" in "\n".join(nodes_table(rows, 2))
    assert "32 (16: 9.0%) | 0.500 |" in "\n".join(nodes_table(rows, 2))


def test_the_planned_row_s_plan_is_the_job_s_with_the_d_of_its_figure(tmp_path):
    """results.json's plans, and the predictions set beside each planned row, are the plan the row
    ran (made at the job's D), with the D its figure was taken at."""
    a = _args(tmp_path, "--schedules", "planned,planned-throughput")
    base = {"schedule": "hippie", "file": "p16.json"}
    a.planned = {(n, name): {**base, "name": name} for n in (1, 2) for name in ("planned", "planned-throughput")}
    for job in scaling.run_plan(a):
        waited = job["nodes"] == 2 and job["schedules"] == ["planned"]
        write_row(tmp_path / "runs" / job["dir"], "hippie", 16, 0.097 if waited else 0.01, nodes=job["nodes"])
        if waited:
            write_row(tmp_path / "runs" / "D32" / job["dir"], "hippie", 32, 0.02, nodes=2)
    plans = row_dilation.row_plans(a, tmp_path, scaling.run_plan(a))
    assert plans[(2, "planned")] == {**base, "name": "planned", "dilation": 32}
    assert plans[(2, "planned-throughput")] == {**base, "name": "planned-throughput", "dilation": 16}
    assert plans[(1, "planned")]["dilation"] == 16
