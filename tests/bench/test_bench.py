"""python -m tools.bench, its pure parts: figures (ratios, ME, scaling efficiency), the report, the
simulator prediction from measured costs, the projection on a vendored profile, and the polite
refusal where `ip` is missing. No network namespaces, no DeepSpeed processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench_records import rounds_runs, run_record
from tools.bench import cli as bench

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "tests" / "data" / "pipedream"


def test_summarize_ratios_me_and_scaling():
    runs = {
        "two_nodes": {
            "dp": run_record(20.0, 400e6),
            "1f1b": run_record(16.0, 200e6),
            "hippie": run_record(24.0, 200e6),
        },
        "one_node": {"dp": run_record(12.0, 400e6), "1f1b": run_record(10.0, 200e6), "hippie": run_record(12.0, 200e6)},
        "one_device": {"dp": run_record(12.5, 400e6)},
    }
    s = bench.summarize(runs)
    assert s["single_device_throughput"] == 12.5
    h, dp = s["schedules"]["hippie"], s["schedules"]["dp"]
    assert h["ratio_to_1f1b"] == pytest.approx(24 / 16) and h["ratio_to_dp"] == pytest.approx(24 / 20)
    # scalability = throughput / (2 cores x single-device throughput); ME = scalability x throughput / GB
    assert h["scalability"] == pytest.approx(24 / 25)
    assert h["me"] == pytest.approx(24 / 25 * 24 / 0.2)
    assert dp["me_vs_dp"] == pytest.approx(1.0)
    # ME ratio to DP = (thr / thr_dp)^2 x mem_dp / mem, whatever a device is
    assert h["me_vs_dp"] == pytest.approx((24 / 20) ** 2 * 400 / 200)
    assert h["me_tensors_vs_dp"] == pytest.approx((24 / 20) ** 2 * 1.0)
    assert h["scaling_efficiency"] == pytest.approx(24 / (2 * 12)) and dp["scaling_efficiency"] == pytest.approx(
        20 / 24
    )
    assert s["schedules"]["1f1b"]["ratio_to_1f1b"] == pytest.approx(1.0)


def test_summarize_without_reference_runs():
    s = bench.summarize({"two_nodes": {"hippie": run_record(24.0, 200e6)}})
    h = s["schedules"]["hippie"]
    assert h["ratio_to_1f1b"] is None and h["me_vs_dp"] is None and h["scaling_efficiency"] is None


def _fake_results():
    runs = {"two_nodes": {}, "one_node": {}, "one_device": {}}
    for name, thr in (("dp", 20.0), ("1f1b", 16.0), ("hippie", 24.0)):
        r = {
            "world": 4,
            "stages": 1 if name == "dp" else 2,
            "schedule_params": {"deferred_stages": [0]} if name == "hippie" else {},
            "median_step_s": 32 / thr,
            "throughput_samples_s": thr,
            "mean_peak_saved_bytes": 5e6,
            "mean_peak_rss_bytes": 5e8,
            "mean_peak_training_rss_bytes": 2e8,
            "memory_per_rank": {
                "0": {
                    "stage": 0,
                    "peak_saved_bytes": 5e6,
                    "state_bytes": 1e8,
                    "peak_rss_bytes": 5e8,
                    "rss_baseline_bytes": 3e8,
                    "peak_training_rss_bytes": 2e8,
                }
            },
            "exposed_allreduce_s_per_step": {"0": 0.1},
            "prediction": {
                "step_time": 32 / thr * 1.1,
                "error": 0.1,
                "costs": {"stages": [{"forward": 0.01, "backward": 0.02, "optimizer_time": 0.005}]},
            },
        }
        runs["two_nodes"][name] = r
        runs["one_node"][name] = {**r, "throughput_samples_s": thr / 1.5}
    runs["one_device"]["dp"] = {**runs["two_nodes"]["dp"], "throughput_samples_s": 12.0}
    results = {
        "config": {"stages": 2, "link": "tbf 1gbit", "link_efficiency": 0.91},
        "runs": runs,
        "plots": [],
        "summary": bench.summarize(runs),
    }
    return results


def test_report_tables():
    results = _fake_results()
    md = bench.report_markdown(results)
    assert "## Side by side (two emulated nodes)" in md
    row = next(line for line in md.splitlines() if line.startswith("| hippie |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2 stages x 2, deferred [0]"
    assert cells[3] == "24.00" and cells[4] == "1.50x" and cells[5] == "1.20x"
    assert cells[9] == f"{(24 / 20) ** 2:.2f}x"  # same memory as DP: ME ratio = throughput ratio squared
    assert cells[12] == f"{24 / (2 * 16):.2f}"  # scaling efficiency 1 -> 2 nodes
    assert cells[14] == "+10.0%"
    assert "## Predicted vs measured step time" in md and "## Memory per rank (two nodes)" in md
    assert "| 1F1B (stock DeepSpeed) |" in md and "| DP |" in md


def test_measured_costs_and_prediction():
    class A:
        micro_batch_size, seq, d_model, allreduce_cpu_per_mb = 2, 8, 16, 0.002

    timings = {
        0: {"params": 1000, "median": {"ForwardPass": 0.01, "BackwardPass": 0.02, "OptimizerStep": 0.004}},
        1: {"params": 2000, "median": {"ForwardBackwardPass": 0.03, "StageOptimizerStep": 0.006}},
    }
    costs = bench.measured_costs(timings, A, 2, 1.25e8, float("inf"), 0.0)
    s0, s1 = costs["stages"]
    assert (s0["forward"], s0["backward"], s0["optimizer_time"], s0["param_bytes"]) == (0.01, 0.02, 0.004, 4000.0)
    # the fused last stage is split with the other stages' forward share (1/3)
    assert s1["forward"] == pytest.approx(0.01) and s1["backward"] == pytest.approx(0.02)
    assert s0["activation_bytes"] == 4 * 2 * 8 * 16
    assert s1["allreduce_cpu_time"] == pytest.approx(0.002 * 8000 / 1e6)  # per MB of the stage's gradient
    # 1F1B, 2 stages x 4 micro-batches, no all-reduce: (M + K - 1)(F + B) + the optimizer step
    free = {**costs, "comm": {**costs["comm"], "data_parallel": 1}}
    pred = bench.predict("1f1b", {}, 2, 4, free)
    assert pred["step_time"] == pytest.approx(5 * 0.03 + 0.006, rel=1e-6)
    assert bench.predict("no-such-schedule", {}, 2, 4, costs)["step_time"] is None


class _A:
    micro_batch_size, seq, d_model, link_efficiency, allreduce_cpu_per_mb = 2, 8, 16, 0.9, 0.0
    intra_allreduce_bandwidth, p2p_bandwidth, p2p_latency = 1e9, 4e9, 0.0
    no_shape, rate = True, "1gbit"


def _write_raw(run_dir, durations=((0, [1.0, 1.2, 1.1]), (1, [1.05, 1.0, 1.3])), label="stock"):
    """Two ranks' step records and timelines under run_dir/raw/<label>/, as the worker writes them."""
    raw = run_dir / "raw" / label / "timeline"
    raw.mkdir(parents=True)
    for rank, dur in durations:
        t, steps, events = 10.0, [], []
        for i, d in enumerate(dur):
            steps.append(
                {
                    "round": 0 if i else -1,
                    "index": max(0, i - 1),
                    "warmup": i == 0,
                    "start": t,
                    "end": t + d,
                    "loss": 1.0,
                    "saved_peak_bytes": 1000 * (rank + 1) * (i + 1),
                    "core_busy": 0.5 + 0.1 * rank + 0.01 * i,
                }
            )
            events += [
                {"kind": "ForwardPass", "name": "F", "start": t - 10.0, "end": t - 10.0 + 0.1, "step": i},
                {"kind": "BackwardPass", "name": "B", "start": t - 9.8, "end": t - 9.6, "step": i},
            ]
            t += d
        (raw.parent / f"rank{rank}.steps.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "stage": rank,
                    "data_parallel_id": 0,
                    "world": 2,
                    "stages": 2,
                    "schedule": "stock",
                    "label": "stock",
                    "params": 100,
                    "schedule_params": {},
                    "parts": [0, 1, 2],
                    "micro_batches": 4,
                    "micro_batch_size": 2,
                    "t0": 10.0,
                    "steps": steps,
                    "memory": {"rss_baseline_bytes": 300, "peak_rss_bytes": 800, "state_bytes": 50},
                }
            )
        )
        (raw / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "events": events}))


def test_analyse_job_from_raw_files(tmp_path):
    _write_raw(tmp_path)
    job = {"config": "one_node", "schedule": "1f1b", "label": "stock"}
    r = bench.analyse_job(tmp_path, job, _A, 1.25e8)
    # a step: from the last rank entering the call to the last leaving it (starts 11.0/11.05,
    # 12.2/12.05; ends 12.2/12.05, 13.3/13.35): not the slowest rank's own 1.2 and 1.3
    assert r["step_times_s"] == pytest.approx([1.15, 1.15])
    assert r["median_step_s"] == pytest.approx(1.15)
    assert r["samples_per_step"] == 2 * 4 * 1 and r["throughput_samples_s"] == pytest.approx(8 / 1.15)
    assert r["memory_per_rank"]["1"]["peak_saved_bytes"] == 6000  # max over steps
    assert r["mean_peak_training_rss_bytes"] == 500
    assert r["core_busy"] == pytest.approx(0.565)  # median of the timed steps over ranks: .51 .52 .61 .62
    assert r["stage_timings_s"]["0"]["ForwardPass"] == pytest.approx(0.1)
    assert r["prediction"]["step_time"] == pytest.approx(5 * 0.3, rel=1e-4)  # (M+K-1)(F+B) + tiny p2p, dp = 1
    assert r["prediction"]["error"] == pytest.approx((1.5 - 1.15) / 1.15, rel=1e-4)


def test_a_step_runs_from_the_last_rank_entering_to_the_last_leaving():
    from tools.bench.analysis import step_periods

    # rank 1 enters call (0, 1) early and waits in it: the step is 1.1, not its own 1.1 + 0.1 wait;
    # the gap between rounds (other labels ran) is in no step
    r0 = [
        {"round": 0, "index": 0, "warmup": False, "start": 0.0, "end": 1.0},
        {"round": 0, "index": 1, "warmup": False, "start": 1.0, "end": 2.1},
        {"round": 1, "index": 0, "warmup": False, "start": 5.0, "end": 6.2},
    ]
    r1 = [
        {"round": 0, "index": 0, "warmup": False, "start": 0.0, "end": 0.9},
        {"round": 0, "index": 1, "warmup": False, "start": 0.8, "end": 2.0},  # started early, waited
        {"round": 1, "index": 0, "warmup": False, "start": 5.0, "end": 6.0},
    ]
    assert step_periods({0: r0, 1: r1}) == pytest.approx([1.0, 1.1, 1.2])


def test_exposed_allreduce_sums_a_steps_waits_before_the_median(tmp_path):
    """hippie waits twice a step (its in-step part, then its buffer, which is usually done): the
    exposed all-reduce is the median of each step's sum, not the median of the pooled waits
    (which is about halfway between the two)."""
    _write_raw(tmp_path, durations=((0, [1.0, 1.2, 1.1, 1.3]),))
    tl = tmp_path / "raw" / "stock" / "timeline" / "rank0.json"
    record = json.loads(tl.read_text())
    starts = [0.0, 1.0, 2.2, 3.3]  # each step's start, relative to t0
    for i, (grads, buffer) in enumerate([(0.5, 0.0), (0.03, 0.001), (0.04, 0.0), (0.05, 0.002)]):
        record["events"] += [
            {
                "kind": "WaitAllReduce",
                "name": "wait_allreduce(grads)",
                "start": starts[i] + 0.5,
                "end": starts[i] + 0.5 + grads,
                "step": i,
            },
            {
                "kind": "WaitAllReduce",
                "name": "wait_allreduce(buffer)",
                "start": starts[i] + 0.9,
                "end": starts[i] + 0.9 + buffer,
                "step": i,
            },
        ]
    tl.write_text(json.dumps(record))
    r = bench.analyse_job(tmp_path, {"config": "one_node", "schedule": "hippie", "label": "stock"}, _A, 1.25e8)
    # timed steps 1-3 (step 0 is warm-up): sums 0.031, 0.04, 0.052 -> median 0.04
    assert r["exposed_allreduce_s_per_step"]["0"] == pytest.approx(0.04)


def test_analyse_all_reads_both_layouts(tmp_path):
    """--analyze-only: round<R>/ directories when the runs came in rounds, the plain directory
    otherwise, whatever --rounds says now."""
    base = tmp_path / "runs" / "two_nodes" / "1f1b"
    _write_raw(base / "round0")  # medians 1.15
    _write_raw(base / "round1", ((0, [1.0, 2.0, 2.2]), (1, [1.0, 2.1, 2.0])))  # 2.1
    _write_raw(base / "round2", ((0, [1.0, 1.5, 1.5]), (1, [1.0, 1.5, 1.5])))  # 1.5
    _write_raw(tmp_path / "runs" / "one_node" / "1f1b")
    a = bench.parse_args(["--schedules", "1f1b", "--no-single", "--rounds", "1", "--no-shape"])
    runs = bench.analyse_all(tmp_path, a, bench.run_plan(a))
    two, one = runs["two_nodes"]["1f1b"], runs["one_node"]["1f1b"]
    assert two["rounds"] == 3 and two["round_median_step_s"] == pytest.approx([1.15, 2.1, 1.5])
    assert two["median_step_s"] == pytest.approx(1.5) and two["detail_round"] == 2
    assert two["timed_steps"] == 6
    assert one["rounds"] == 1 and one["median_step_s"] == pytest.approx(1.15)
    s = bench.summarize(runs)["schedules"]["1f1b"]
    assert s["ratio_to_1f1b_rounds"] == pytest.approx([1.0, 1.0, 1.0]) and s["real_vs_1f1b"] is None


def test_projection_on_vendored_profile():
    proj = bench.projection(
        models=(("vgg16", "VGG-16"),), sizes=(16,), schedules=("dp", "1f1b", "hippie"), profile_dir=PROFILES
    )
    rows = {r["schedule"]: r for r in proj["rows"]}
    assert set(rows) == {"dp", "1f1b", "hippie", "planner"}
    for name, r in rows.items():
        assert 0 < r["scaling_efficiency"] <= 1 + 1e-9, name
        assert r["devices"] == 16 and r["global_batch"] == 128 * 16
    assert rows["1f1b"]["pipeline_depth"] == 4 and rows["1f1b"]["data_parallel"] == 4  # a pipeline per node
    assert rows["dp"]["pipeline_depth"] == 1 and rows["dp"]["me_vs_dp"] == pytest.approx(1.0)
    md = "\n".join(bench.projection_pivot(proj))
    assert "| VGG-16 | hippie |" in md and "16 GPUs" in md


def test_refuses_without_ip(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `ip`, `tc` or `taskset` here
    rc = bench.main(["--out", str(tmp_path / "out"), "--no-projection"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "`ip` is not installed" in err and "--projection-only" in err
    assert not (tmp_path / "out" / "runs").exists()


def test_cli_help_and_argument_errors():
    res = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert res.returncode == 0 and "--schedules" in res.stdout and "--plan" in res.stdout
    with pytest.raises(SystemExit):
        bench.parse_args(["--plan", "hippie"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--schedules", "hippie,hippie"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    a = bench.parse_args(["--schedules", "dp,2bw", "--plan", "2bw=plan.json", "--rounds", "1"])
    assert a.schedule_list == ["dp", "2bw"] and a.plans["2bw"].endswith("plan.json")
    jobs = bench.run_plan(a)
    assert [(j["config"], j["label"]) for j in jobs] == [
        ("two_nodes", "dp"),
        ("two_nodes", "2bw"),
        ("one_node", "dp"),
        ("one_node", "2bw"),
        ("one_device", "dp"),
    ]
    # --rounds 1: today's layout, one directory per config and schedule
    assert [j["dir"] for j in jobs] == ["two_nodes/dp", "two_nodes/2bw", "one_node/dp", "one_node/2bw", "one_device/dp"]
    # stock DeepSpeed 1F1B runs first: its measured costs resolve 'deferred_stages: auto' for the others
    a = bench.parse_args(["--schedules", "hippie,1f1b", "--no-scaling", "--no-single", "--rounds", "1"])
    assert [(j["schedule"], j["label"]) for j in bench.run_plan(a)] == [("1f1b", "stock"), ("hippie", "hippie")]
    assert bench.parse_args([]).rounds == 3


def test_report_marks_real_differences():
    results = _fake_results()
    results["runs"]["two_nodes"].update(
        rounds_runs({"dp": [20.0, 10.0, 19.0], "1f1b": [16.0, 8.0, 15.0], "hippie": [19.2, 9.6, 18.0]})["two_nodes"]
    )
    for name, r in results["runs"]["two_nodes"].items():
        r.update(
            {
                k: v
                for k, v in _fake_results()["runs"]["two_nodes"][name].items()
                if k not in r or k in ("world", "stages", "schedule_params")
            }
        )
        r["detail_round"] = 2
    results["summary"] = bench.summarize(results["runs"])
    results["config"]["round_orders"] = bench.round_orders(["dp", "1f1b", "hippie"], 3)
    md = bench.report_markdown(results)
    cells = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in md.splitlines()
        if line.startswith("| ") and "x" in line
    }
    assert cells["hippie"][4] == "1.20x (1.20-1.20) **real**"
    assert cells["hippie"][5] == "0.96x (0.95-0.96)"  # ranges overlap DP's: not marked
    assert cells["hippie"][2] == "1.778 (1.667-3.333)"  # median over rounds (min-max)
    assert cells["1F1B (stock DeepSpeed)"][4] == "1.00x"
    # the rule is stated in the report
    assert "min-max spread does not include 1.0" in md and "do not overlap" in md
    assert "Not repeated in rounds: the one-node runs" in md and "ran once" in md
    assert "## Rounds (two nodes)" in md and "round 1: DP, hippie, 1F1B" in md


def test_report_single_round_says_so():
    md = bench.report_markdown(_fake_results())
    assert "one round" in md and "**real**" not in md and "## Rounds" not in md


def test_spread_cell():
    assert bench.spread_cell(1.2, 1.1, 1.3, real=True) == "1.20x (1.10-1.30) **real**"
    assert bench.spread_cell(1.2, None, None) == "1.20x"
    assert bench.spread_cell(None, 1, 2) == "-"


def test_gpu_link_scaling_falls_with_the_link_and_stays_below_one():
    from tools.bench.projection import link_scaling

    rows = link_scaling(models=(("vgg16", "VGG-16"),), rates=("10Gbit", "250Mbit"), schedules=("1f1b",))
    fast, slow = (r["scaling"] for r in rows)
    assert 0 < slow < fast <= 1.0 + 1e-9
    assert rows[0]["step_two_nodes_s"] < rows[1]["step_two_nodes_s"]


def test_allreduce_cpu_cost_option_reads_the_measurement_at_the_rate():
    import json

    from tools.bench.config import ALLREDUCE_MEASURED, parse_args

    measured = {r["rate"]: r["cpu_per_mb"] for r in json.loads(ALLREDUCE_MEASURED.read_text())}
    assert parse_args(["--rate", "250mbit"]).allreduce_cpu_per_mb == measured["250mbit"] > 0
    assert parse_args(["--rate", "3gbit"]).allreduce_cpu_per_mb == 0.0  # not measured there
    assert parse_args(["--no-shape"]).allreduce_cpu_per_mb == 0.0
    assert parse_args(["--allreduce-cpu-per-mb", "0.001"]).allreduce_cpu_per_mb == 0.001
    with pytest.raises(SystemExit):
        parse_args(["--allreduce-cpu-per-mb", "fast"])


def test_core_ticks_count_this_machines_busy_time():
    import os
    import time

    from tools.bench.cluster import core_ticks

    cores = os.sched_getaffinity(0)
    busy0, total0 = core_ticks(cores)
    end = time.process_time() + 0.1
    while time.process_time() < end:  # keep one of them busy for 0.1 s (10 ticks)
        pass
    busy1, total1 = core_ticks(cores)
    assert 0 < busy1 - busy0 <= total1 - total0
    assert core_ticks(set()) == (0, 0)
    every = set(range(os.cpu_count()))  # the machine's line is the sum of its cores' lines
    assert abs(core_ticks()[1] - core_ticks(every)[1]) <= 5 * len(every)


def test_tbf_burst_default_and_min():
    """tbf's token bucket: the default keeps the brief's 1mb where the kernel allows it; "min" is
    just above rate/250 (the least this kernel takes), so an all-reduce after an idle spell gets
    no more than that at veth speed; anything else is refused by name."""
    from tools.bench.cluster import Refuse, burst_for, parse_rate

    assert burst_for(parse_rate("1gbit")) == "1mb" and burst_for(parse_rate("250mbit")) == "1mb"
    assert burst_for(parse_rate("10gbit")) == str(2 * 1_250_000_000 // 250)
    assert int(burst_for(parse_rate("250mbit"), "min")) == 137500  # 31.25 MB/s / 250 x 1.1
    assert int(burst_for(parse_rate("1gbit"), "min")) == 550000
    # a slow link (a time-dilated one: 10mbit / 64) still holds a full frame, or tbf drops every frame
    assert int(burst_for(parse_rate("10mbit") / 64, "min")) >= 1514 and burst_for(parse_rate("10mbit") / 64) == "1mb"
    with pytest.raises(Refuse, match=r"--burst 'small': allowed default"):
        burst_for(parse_rate("1gbit"), "small")
    assert bench.parse_args(["--burst", "min", "--no-shape"]).burst == "min"
