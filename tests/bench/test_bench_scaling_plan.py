"""bench scaling's planned columns (tools/bench/studies/scaling_plan.py): the emulated model's profile and
cluster, the planned jobs' worker arguments, the plans beside the measured rows, the CPU figures; and the
plan -> bench path on a tiny emulated cluster (root only: namespaces), one round, asserting that every rank
ran the plan's boundaries, re-computed layers, schedule and batch. Speed stays in the bench."""

import json

import pytest

from tools.bench.analysis import cpu_figures
from tools.bench.studies import scaling
from tools.bench.cluster import parse_rate
from tools.bench.studies.scaling_plan import cluster_record, emulated_profile, global_batch, plan_record, tensor_scale
from tools.bench.studies.scaling_plan_report import cpu_section, planned_section, targets
from tools.bench.workers.bench_worker import wait_between

TINY = [
    "--nodes",
    "1,2",
    "--stages",
    "2",
    "--micro-batches",
    "2",
    "--micro-batch-size",
    "4",
    "--schedules",
    "planned",
    "--rounds",
    "1",
    "--steps",
    "1",
    "--warmup",
    "1",
    "--emulate-speedup",
    "40",
    "--dilate",
    "2",
    "--max-dilate",  # the plan -> bench path at the job's D: no row reruns at a larger D (test_bench_row_dilation's)
    "2",
    "--rate",
    "100mbit",
    "--link-efficiency",
    "0.97",
    "--no-single",
    "--timeout",
    "300",
    "--port",
    "29720",
    "--network",
    "hdsp,10.84.0",
]  # beside test_bench_scaling's end-to-end study (hdss)


def test_the_emulated_profile_is_the_emulated_module_s():
    from hippie_ds.adapter.module.pipeline_module import model_fingerprint
    from tools.bench.emulated import emulated_specs, read_profile

    p = emulated_profile("vgg16", 1e-3, speedup=2.0)
    assert p.fingerprint() == model_fingerprint(emulated_specs("vgg16", 8, 1e-3))  # a plan for it fits the module
    real = read_profile("vgg16")
    assert p.layers[3].forward == pytest.approx(real.layers[3].forward / 2)
    assert p.cuts()[3] == pytest.approx(real.cuts()[3] * 1e-3) and p.batch_size == real.batch_size


def test_the_emulated_cluster_and_the_planned_jobs(tmp_path):
    a = scaling.parse_args(["--out", "/tmp/unused", "--nodes", "1,4"])
    assert a.schedule_list[-2:] == ["planned", "planned-throughput"]  # in the defaults
    a.dilate = 1.0
    c = cluster_record(a, 4)
    assert c["devices_per_node"] == 4 and c["device_memory"] == pytest.approx(16e6)  # 16 GB x 1e-3
    assert c["inter_node_bandwidth"] == pytest.approx(1.25e6 * 0.97)  # 10mbit: 10 Gbit/s x 1e-3
    a.dilate = (
        16.0  # the ranks' link at the rate / 16, their tensors unscaled: the planner's cluster is the undilated one
    )
    d = cluster_record(a, 4)
    assert (
        d["device_memory"] == pytest.approx(16e6)
        and d["inter_node_bandwidth"] == pytest.approx(1.25e6 * 0.97)
        and d["intra_node_bandwidth"] == pytest.approx(16 * c["intra_node_bandwidth"])
        and d["latency"] == pytest.approx(c["latency"] / 16)
        and "host" not in d
    )
    # a transfer between nodes takes the planner's time x D on the ranks' link (scaling.dilated)
    ranks = scaling.dilated(a)
    nbytes = 1e5 * tensor_scale(ranks)
    on_the_ranks_link = nbytes / (parse_rate(ranks.rate) * a.link_efficiency)
    assert on_the_ranks_link == pytest.approx(16 * nbytes / d["inter_node_bandwidth"], rel=1e-6)
    assert ranks.emulate_scale == a.emulate_scale and ranks.emulate_speedup == pytest.approx(a.emulate_speedup / 16)
    assert ranks.queue_s == pytest.approx(16 * 0.1)  # tbf's queue: the undilated link's bytes
    from hippie_ds.planner.host import HostCost, KindCost

    a.host_cost = str(tmp_path / "host.json")
    (tmp_path / "host.json").write_text(HostCost(backward=KindCost(fixed=4e-3, per_layer=1e-3)).model_dump_json())
    h = cluster_record(a, 4)["host"]  # 16 ranks on 2 cores at D = 16: a rank has 2 cores of host, half the time
    assert h["backward"] == {"fixed": pytest.approx(2e-3), "per_layer": pytest.approx(5e-4)}
    h = cluster_record(a, 1)["host"]  # 4 ranks on 1 core at D = 16: 4 cores of host, a quarter of the time
    assert h["backward"] == {"fixed": pytest.approx(1e-3), "per_layer": pytest.approx(2.5e-4)}
    assert global_batch(a, 4) == 32 * 8 * 4  # the pipelines' and DP's
    a.planned = {
        (4, "planned"): {
            "schedule": "hippie",
            "pipeline_depth": 2,
            "micro_batch_size": 16,
            "micro_batches": 32,
            "file": "/p.json",
        }
    }
    job = next(j for j in scaling.run_plan(a) if j["dir"] == "four_nodes_planned")
    assert job["labels"] == "hippie" and job["rpn"] == 4 and job["schedules"] == ["planned"]
    args = scaling.job_args(a, job, scaling.Path("/tmp/x"))
    got = {k: args[args.index(k) + 1] for k in ("--stages", "--micro-batch-size", "--micro-batches", "--plan-config")}
    assert got == {"--stages": "2", "--micro-batch-size": "16", "--micro-batches": "32", "--plan-config": "/p.json"}
    assert "--costs" not in args  # the plan carries its deferral


def _run(thr, world=8, stages=4, parts=None, ckpt=None, waits=(0.01,)):
    return {
        "throughput_samples_s": thr,
        "round_throughput_samples_s": [thr],
        "median_step_s": 256 / thr,
        "world": world,
        "stages": stages,
        "mean_state_bytes": 1e3,
        "mean_peak_saved_bytes": 1e3,
        "schedule_params": {},
        "prediction": {},
        "parts": parts,
        "checkpointed_layers": ckpt,
        "cpu_s_per_step_all_ranks": 2.0,
        "cpu_share_median": 0.1,
        "round_runqueue_wait_share_max": list(waits),
    }


def test_plans_beside_the_measured_rows_and_the_cpu_flag():
    plan = {
        "objective": "me",
        "schedule": "hippie",
        "pipeline_depth": 4,
        "data_parallel": 2,
        "micro_batch_size": 8,
        "micro_batches": 32,
        "boundaries": [0, 2, 4, 6, 8],
        "checkpointed_layers": [0, 1, 3],
        "schedule_params": {"deferred_stages": [0]},
        "deferred_layers": {},
        "command": "hippie-ds plan",
        "file": "p",
        "predicted": {"step_s": 1.1, "memory_bytes": 1.2e6, "me": None, "me_vs_dp": 5.0, "predicted_by": "simulator"},
    }
    runs = {
        "one_node": {"dp": _run(100, 4, 1), "planned": _run(200, 4, 4, [0, 2, 4, 6, 8], [0, 1, 3])},
        "two_nodes": {
            "dp": _run(100, 8, 1),
            "planned": _run(256, 8, 4, [0, 2, 4, 6, 8], [0, 1, 3], (0.01, 0.2)),
            "1f1b": _run(128),
        },
        "one_device": {"dp": _run(50, 1, 1)},
    }
    s = scaling.summarize(runs, [1, 2], 1e-3, {(2, "planned"): plan}, cores=2)
    row = s["by_nodes"]["2"]["planned"]
    assert row["used_plan"] and row["plan_predicted_step_s"] == 1.1 and row["plan_step_error"] == pytest.approx(0.1)
    assert row["plan_memory_error"] == pytest.approx(1.2e6 / 2e6 - 1) and row["plan_me_vs_dp_error"] is not None
    assert row["waited_for_core"] and row["runqueue_wait_share_max"] == 0.2  # the worst round decides
    assert row["cpu_load_vs_cores"] == pytest.approx(2.0 / (1.0 * 2))
    assert not s["by_nodes"]["2"]["dp"]["waited_for_core"]
    assert "used_plan" not in s["by_nodes"]["1"]["planned"]  # no plan given for one node
    vgg = {t["key"]: t for t in targets(s, "vgg16")}
    assert vgg["me_vs_dp"]["waited_for_core"] == ["planned"] and vgg["me_vs_dp"]["best"] == "planned"
    assert vgg["throughput_vs_1f1b"]["met"] is None  # no planned (throughput) column here: not judged
    assert "scaling" not in vgg  # GNMT-16's target
    md = "\n".join(planned_section(s) + cpu_section(s, 0.05))
    assert "re-computed 0-1,3" in md and "**waited for a core**" in md and "+10.0%" in md


def test_cpu_figures_and_run_queue_waits():
    steps = [
        {"warmup": True, "start": 0, "end": 1, "cpu_s": 9, "runqueue_wait_s": 9},
        {"warmup": False, "start": 1, "end": 2, "cpu_s": 0.2, "runqueue_wait_s": 0.05},
        {"warmup": False, "start": 2, "end": 4, "cpu_s": 0.4, "runqueue_wait_s": 0.3},
    ]
    got = cpu_figures({0: ({"steps": steps}, {}), 1: ({"steps": steps[:2]}, {})})
    assert got["cpu_s_per_step"] == {"0": pytest.approx(0.3), "1": 0.2} and got["cpu_s_per_step_all_ranks"] == 0.5
    assert got["runqueue_wait_share_max"] == pytest.approx((0.05 + 0.15) / 2)
    assert cpu_figures({0: ({"steps": [{"warmup": False, "start": 0, "end": 1}]}, {})}) == {}  # older records
    assert wait_between({1: 1.0, 2: 0.5}, {1: 1.5, 2: 0.75, 3: 0.25}) == pytest.approx(1.0)
    assert wait_between({1: 1.0}, {1: 1.5, 3: 0.25}, tid=1) == pytest.approx(0.5)
    assert wait_between(None, {1: 1.0}) is None


@pytest.mark.distributed
@pytest.mark.skipif(
    not __import__("test_bench_scaling")._netns_available(), reason="needs root, `ip netns` and `tc` (emulated nodes)"
)
def test_a_plan_runs_on_the_emulated_cluster_as_planned(tmp_path):
    """The plan -> bench path: hippie-ds plan for a 2-node x 2-device emulated cluster, the run through
    hippie.plan (one job, one round of one step), and what every rank recorded is the plan."""
    from hippie_ds.planner import load_plan
    from hippie_ds.planner.host import HostCost, KindCost

    host = tmp_path / "host_cost.json"  # a host the tiny plan must price: 1 ms + 0.5 ms a layer per forward
    host.write_text(HostCost(forward=KindCost(fixed=1e-3, per_layer=5e-4), source="test").model_dump_json())
    # micro-batches of 32: activations enough that the ME plan re-computes (2 layers of 8 x 8)
    a = scaling.parse_args([*TINY, "--micro-batch-size", "32", "--out", str(tmp_path), "--host-cost", str(host)])
    a.node_counts = [2]  # the study's scaling needs one node too; this test needs one job only
    scaling.measure(a, tmp_path)
    plan = load_plan(tmp_path / "plans" / "2_nodes_planned.json")
    # the planner saw that host, scaled to a rank's share at D = 2: 2 ranks on each core -> x 2 / 2
    assert plan.cluster.host.forward.fixed == pytest.approx(1e-3) and "D = 2" in plan.cluster.host.source
    assert plan.checkpointed_layers, "the tiny plan re-computes nothing: pick a shape whose plan does"
    ranks = [
        json.loads(f.read_text())
        for f in (tmp_path / "runs" / "two_nodes_planned" / "raw" / plan.schedule).glob("rank*.steps.json")
    ]
    assert len(ranks) == 4
    for rec in ranks:
        assert rec["parts"] == plan.boundaries and rec["checkpointed_layers"] == plan.checkpointed_layers
        assert (rec["schedule"], rec["stages"], rec["micro_batches"], rec["micro_batch_size"]) == (
            plan.schedule,
            plan.pipeline_depth,
            plan.micro_batches,
            plan.micro_batch_size,
        )
        assert {k: v for k, v in rec["schedule_params"].items() if k in plan.schedule_params} == plan.schedule_params
        assert all(s["cpu_s"] >= 0 and "runqueue_wait_s" in s for s in rec["steps"])
    run = scaling.analyse(a, tmp_path, None)["two_nodes"]["planned"]
    # every step's CPU is recorded by instruction (a last stage runs its forwards fused with the backward)
    forwards = ("ForwardPass", "ForwardBackwardPass")
    assert all(
        sum(s["cpu_by_instruction"].get(k, [0])[0] for k in forwards) >= 1 for rec in ranks for s in rec["steps"]
    )
    row = scaling.summarize(
        {"two_nodes": {"planned": run}},
        [2],
        2e-3,
        {(2, "planned"): plan_record(tmp_path / "plans" / "2_nodes_planned.json", 2e-3, None)},
        dilation=2.0,
    )
    assert row["by_nodes"]["2"]["planned"]["used_plan"]
    assert row["by_nodes"]["2"]["planned"]["step_s"] == pytest.approx(run["median_step_s"] / 2)
    assert "hdsp-" not in __import__("subprocess").run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_never_below_the_job_as_it_is_counts_only_spreads_apart():
    """planned (throughput) misses 'never below the job as it is' only when its best round is below
    the job's worst (the spreads apart); overlapping spreads are no difference."""

    def summary(high):
        top = {
            "hippie-1f1b": {"vs_1f1b": 1.70, "vs_1f1b_min": 1.68, "vs_1f1b_max": 1.72},
            "planned-throughput": {"vs_1f1b": 1.65, "vs_1f1b_min": 1.60, "vs_1f1b_max": high},
        }
        return {"by_nodes": {"1": {}, "4": top}}

    judged = {t["key"]: t for t in targets(summary(1.69), "gnmt16")}
    assert judged["never_below_job"]["met"] is True and judged["never_below_job"]["least"] == 1.68
    assert {t["key"]: t for t in targets(summary(1.66), "gnmt16")}["never_below_job"]["met"] is False
    assert "throughput_vs_1f1b" not in judged  # VGG-16's target


def test_the_planners_baseline_of_the_runs_shape_beside_it():
    """A measured baseline column gets the planner's baseline of its own name, schedule and shape (DP:
    1 stage x the devices; a pipeline: its cut too), with both errors; none of another shape."""
    from tools.bench.studies.scaling_summary import planner_baseline_fields

    def base(name, schedule, K, r, b, M, parts, step):
        return dict(
            name=name,
            schedule=schedule,
            pipeline_depth=K,
            data_parallel=r,
            micro_batch_size=b,
            micro_batches=M,
            boundaries=parts,
            step_s=step,
            memory_bytes=1.1e9,
            fits=True,
        )

    baselines = [
        base("job:uniform", "1f1b", 4, 4, 32, 16, [0, 2, 4, 6, 8], 9.0),  # another micro-batch count
        base("job:uniform", "1f1b", 4, 4, 32, 8, [0, 1, 4, 6, 8], 9.0),  # another cut
        base("job:uniform:searched", "1f1b", 4, 4, 32, 8, [0, 2, 4, 6, 8], 9.0),
        base("job:uniform", "1f1b", 4, 4, 32, 8, [0, 2, 4, 6, 8], 1.1),
        base("dp", "1f1b", 1, 16, 32, 2, [0, 8], 0.9),
    ]
    row = {"devices": 16, "parts": [0, 2, 4, 6, 8], "micro_batch_size": 32, "micro_batches": 8, "step_s": 1.0}
    got = planner_baseline_fields("1f1b", {**row, "memory_bytes": 1e9}, baselines)
    assert got["planner_predicted_step_s"] == 1.1 and got["planner_step_error"] == pytest.approx(0.1)
    assert got["planner_memory_error"] == pytest.approx(0.1)
    dp = {"devices": 16, "parts": None, "micro_batch_size": 32, "micro_batches": 2, "step_s": 1.0}
    assert planner_baseline_fields("dp", dp, baselines)["planner_step_error"] == pytest.approx(-0.1)
    assert planner_baseline_fields("gpipe", row, baselines) == {}
    assert planner_baseline_fields("planned", row, baselines) == {}


def test_the_planners_memory_is_held_against_the_bench_on_the_terms_the_bench_counts(tmp_path):
    """The plan file gives each stage's working memory (one layer's temporaries, which no count of
    live state and saved tensors sees); the bench compares its measured memory with the rest, and
    prints all of it beside. On the emulated VGG-16 the rest is each stage's state plus its kept
    activations, as the module keeps them."""
    from hippie_ds.cli import main as hippie_ds_main
    from hippie_ds.planner import load_plan, save_profile
    from tools.bench.studies.scaling_plan import baseline_record, counted_memory
    from tools.bench.studies.scaling_summary import planner_baseline_fields

    save_profile(emulated_profile("vgg16", 1e-3), tmp_path / "p.yaml")
    argv = ["plan", "--profile", str(tmp_path / "p.yaml"), "--cluster", "1x4,16MB,10Gbit", "--global-batch", "256"]
    argv += ["--job", "4,32,1f1b", "--schedules", "1f1b", "--simulate-top", "1"]
    assert hippie_ds_main([*argv, "--out", str(tmp_path / "plan.json")]) == 0
    plan = load_plan(tmp_path / "plan.json")
    job = next(b for b in plan.baselines if b.name == "job:uniform" and b.schedule == "1f1b")
    pred = job.prediction
    assert len(pred.memory_working_per_stage) == 4 and all(w > 0 for w in pred.memory_working_per_stage)
    counted = counted_memory(pred, 1e-3)
    assert counted == pytest.approx(
        sum(m - w for m, w in zip(pred.memory_per_stage, pred.memory_working_per_stage)) / 4 / 1e-3
    )
    assert counted < pred.memory / 1e-3
    # stage 3 of the uniform cut: its fp32 Adam state (16 bytes a parameter) and what it keeps
    profile = emulated_profile("vgg16", 1e-3).scaled(32)
    last = job.boundaries[3]
    state = 4 * sum(x.param_bytes for x in profile.layers[last:])
    assert pred.memory_per_stage[3] - pred.memory_working_per_stage[3] > state
    row = {"devices": 4, "parts": job.boundaries, "micro_batch_size": 32, "micro_batches": 8, "step_s": 1.0}
    got = planner_baseline_fields("1f1b", {**row, "memory_bytes": counted / 1.25}, [baseline_record(job, 1e-3)])
    assert got["planner_memory_error"] == pytest.approx(0.25)  # against the counted terms, not all of it
    assert got["planner_predicted_memory_bytes"] == pytest.approx(pred.memory / 1e-3)
