"""python -m tools.bench scaling, its pure parts (run plan, labels, figures, report, the optimizer-step
barrier in the measured costs) and the star network of N emulated nodes (root only: namespaces)."""

import json
import subprocess
import sys

import pytest

from tools.bench import REPO
from tools.bench.analysis import stage_timings, tied_groups
from tools.bench.cluster import StarNetwork, preflight
from tools.bench.studies import link_calibration, scaling
from tools.bench.studies.scaling_report import report


def _args(*extra):
    return scaling.parse_args(["--out", "/tmp/unused", *extra])


def test_defaults_and_run_plan():
    a = _args("--nodes", "4,1,2", "--rounds", "3")
    assert a.model == "emulated:vgg16" and a.stages == 4 and a.rate == "10mbit" and a.node_counts == [1, 2, 4]
    plan = scaling.run_plan(a)
    columns = ["", "_dp", "_planned", "_planned-throughput"]  # the planned columns in jobs of their own
    assert [j["dir"] for j in plan] == [f"{n}{c}" for n in ("one_node", "two_nodes", "four_nodes") for c in columns] + [
        "one_device"
    ]
    plan = [j for j in plan if "planned" not in j["dir"]]
    assert plan[0]["labels"] == "stock,gpipe,hippie-1f1b"  # every pipeline in one job, as engine labels
    pipelines = scaling.job_args(a, plan[0], scaling.Path("/tmp/x"))
    assert pipelines[pipelines.index("--costs") + 1] == "measured"  # deferred_stages: auto from stock's costs
    assert plan[5]["labels"] == "dp" and plan[5]["config"] == "four_nodes"  # DP alone in its processes
    args = scaling.job_args(a, plan[5], scaling.Path("/tmp/x"))
    assert args[args.index("--rounds") + 1] == "3"  # the rounds run inside the worker
    assert args[args.index("--global-batch") + 1] == str(32 * 8 * 4)  # DP: the 4 pipelines' batch
    single = scaling.job_args(a, plan[6], scaling.Path("/tmp/x"))
    assert single[single.index("--global-batch") + 1] == str(32 * 8) and "dp" in single


def test_dilated_options_and_host_cores():
    a = _args(
        "--nodes", "1,2,4", "--dilate", "8", "--timeout", "100", "--emulate-scale", "0.002", "--emulate-speedup", "2"
    )
    d = scaling.dilated(a)
    # times x 8, the link at the rate / 8 with 8 x the queue (the same bytes), the tensors' size kept
    assert (d.emulate_scale, d.emulate_speedup, d.timeout) == (0.002, 0.25, 800)
    assert d.rate == "1250000bit" and a.rate == "10mbit" and d.queue_s == pytest.approx(0.8)
    assert (a.emulate_scale, a.emulate_speedup) == (0.002, 2)  # the undilated cluster, what the planner sees
    args = scaling.job_args(a, scaling.run_plan(a)[0], scaling.Path("/tmp/x"))
    assert args[args.index("--emulate-scale") + 1] == "0.002" and args[args.index("--emulate-speedup") + 1] == "0.25"
    # 4 ranks a node, nodes round-robin on 2 cores: 4, 4 and 8 ranks on the busiest core
    assert [scaling.host_cores(a, n) for n in (1, 2, 4)] == [2.0, 2.0, 1.0]
    with pytest.raises(SystemExit):
        _args("--nodes", "1,2", "--dilate", "0.5")


@pytest.mark.parametrize("nodes", ["2,4", "1", "1,x"])
def test_nodes_must_include_one_and_a_larger_count(nodes, capsys):
    with pytest.raises(SystemExit):
        _args("--nodes", nodes)
    assert "--nodes" in capsys.readouterr().err


def _run(rounds_thr, world, stages=4, state=1e3, saved=1e3, pred=None):
    med = sorted(rounds_thr)[len(rounds_thr) // 2]
    return {
        "throughput_samples_s": med,
        "round_throughput_samples_s": rounds_thr,
        "median_step_s": 256 / med,
        "median_step_s_min": 256 / max(rounds_thr),
        "median_step_s_max": 256 / min(rounds_thr),
        "world": world,
        "stages": 1 if stages == 1 else stages,
        "mean_state_bytes": state,
        "mean_peak_saved_bytes": saved,
        "schedule_params": {},
        "prediction": {"step_time": pred, "error": 0.05},
    }


def test_summarize_scaling_me_and_report():
    runs = {
        "one_node": {
            "dp": _run([100, 110], 4, 1, state=4e3),
            "1f1b": _run([200, 200], 4),
            "hippie-1f1b": _run([220, 230], 4),
        },
        "two_nodes": {
            "dp": _run([100, 100], 8, 1, state=4e3),
            "1f1b": _run([300, 280], 8),
            "hippie-1f1b": _run([440, 450], 8),
        },
        "one_device": {"dp": _run([60], 1, 1, state=16e3)},
    }
    s = scaling.summarize(runs, [1, 2], scale=1e-3)
    two = s["by_nodes"]["2"]
    # scaling 1 -> 2 per round: 440 / (2 x 220), 450 / (2 x 230)
    assert two["hippie-1f1b"]["scaling_rounds"] == pytest.approx([1.0, 450 / 460])
    assert two["1f1b"]["scaling_min"] == pytest.approx(0.7) and two["1f1b"]["scaling_max"] == pytest.approx(0.75)
    assert two["hippie-1f1b"]["vs_1f1b_min"] == pytest.approx(440 / 300) and two["hippie-1f1b"]["real_vs_1f1b"]
    # memory unscaled to the profile's size; ME = scalability x throughput / memory, against DP's
    assert two["1f1b"]["memory_bytes"] == pytest.approx(2e6)
    thr, dev = two["1f1b"]["throughput"], 8
    me = (thr / (dev * 60)) * thr / 2e-3
    me_dp = (100 / (dev * 60)) * 100 / 5e-3
    assert two["1f1b"]["me_vs_dp"] == pytest.approx(me / me_dp)
    md = report(
        {
            "config": {
                "model": "emulated:vgg16",
                "emulate_speedup": 1.0,
                "emulate_scale": 1e-3,
                "params_total": "138K",
                "nodes": [1, 2],
                "stages": 4,
                "link": "tbf 10mbit",
                "cores": "0,1",
                "micro_batches": 8,
                "micro_batch_size": 32,
                "warmup": 2,
                "steps": 4,
                "rounds": 2,
                "command": "python -m tools.bench scaling",
                "link_efficiency": 0.97,
            },
            "summary": s,
            "runs": runs,
        }
    )
    assert "| hippie-1f1b | 0.99 (0.98-1.00) |" in md  # the pivot: scaling 1 -> 2 nodes
    assert "> 90%" in md and "emulated here" in md  # the paper's figure beside ours
    assert "**emulated**" in md


def _rank(rank, stage, opt_start, opt_end, t0=100.0):
    """A rank's step record (absolute times) and timeline (times after its own ``t0``) with one
    timed step and its OptimizerStep at absolute ``opt_start``-``opt_end``."""
    steps = {
        "rank": rank,
        "stage": stage,
        "stages": 2,
        "schedule": "stock",
        "params": 10,
        "t0": t0,
        "steps": [{"round": 0, "index": 0, "warmup": False, "start": 100.0, "end": 102.0}],
    }
    events = [
        {"kind": "ForwardPass", "start": 100.1 - t0, "end": 100.2 - t0},
        {"kind": "OptimizerStep", "start": 100 + opt_start - t0, "end": 100 + opt_end - t0},
    ]
    return steps, {"events": events}


def test_link_calibration_efficiency_is_the_fluid_ring_over_the_slowest_rank():
    # 2 ranks, 1 MB at 1 MB/s: the fluid ring takes 2(r-1)/r x 1 s = 1 s; a repeat lasts its slowest rank
    records = [
        {"stage": [1.0, 1.25, 2.0], "stage_bytes": 1e6, "all": [2.0, 2.0, 2.0], "all_bytes": 1e6},
        {"stage": [1.1, 1.0, 2.5], "stage_bytes": 1e6, "all": [2.0, 2.5, 2.0], "all_bytes": 1e6},
        {"stage": None, "stage_bytes": 1e6, "all": [2.0, 2.0, 2.0], "all_bytes": 1e6},
    ]
    got = link_calibration.summarize(records, rate_bytes=1e6)
    assert got["stage"]["repeats_s"] == [1.1, 1.25, 2.5] and got["stage"]["ranks"] == 2
    assert got["stage"]["efficiency"] == pytest.approx(1.0 / 1.25)
    assert got["all"]["ranks"] == 3 and got["all"]["efficiency"] == pytest.approx((4 / 3) / 2.0)
    link = {"by_nodes": {"2": got}}
    assert link_calibration.efficiency(link, 2, "dp") == got["all"]["efficiency"]
    assert link_calibration.efficiency(link, 2, "hippie-1f1b") == got["stage"]["efficiency"]
    assert link_calibration.efficiency(link, 4, "dp") is None and link_calibration.efficiency(None, 2, "dp") is None


def test_link_calibration_gives_pipelines_every_stage_s_rings_at_once():
    # 2 nodes x 2 stages, 1 MB and 3 MB at 1 MB/s: both rings cross each node's link, so the fluid
    # time is one ring of 4 MB over 2 ranks: 4 s; the repeat lasts its slowest rank
    records = [
        {"stage_ranks": [1, 3], "stages": [5.0, 4.0, 8.0], "stages_bytes": [1e6, 3e6]},
        {"stage_ranks": [1, 3], "stages": [5.0, 6.0, 5.0], "stages_bytes": [1e6, 3e6]},
        {"stage_ranks": [1, 3], "stages": [4.0, 5.0, 5.0], "stages_bytes": [1e6, 3e6]},
        {"stage_ranks": [1, 3], "stages": [4.0, 4.0, 5.0], "stages_bytes": [1e6, 3e6]},
    ]
    got = link_calibration.summarize(records, rate_bytes=1e6)["stages"]
    assert got["repeats_s"] == [5.0, 6.0, 8.0] and got["ranks"] == 2 and got["bytes"] == 4e6
    assert got["efficiency"] == pytest.approx(4.0 / 6.0)
    lone = {"stage": {"efficiency": 0.5}, "all": {"efficiency": 0.9}}
    link = {"by_nodes": {"2": {**lone, "stages": got}, "4": lone}}
    assert link_calibration.efficiency(link, 2, "1f1b") == got["efficiency"]  # concurrent, where measured
    assert link_calibration.efficiency(link, 4, "1f1b") == 0.5  # a calibration made before it: the lone ring
    assert link_calibration.efficiency(link, 2, "dp") == 0.9


def test_link_calibration_plans_the_largest_stage_and_dp_from_the_runs(tmp_path):
    a = _args("--nodes", "1,2")
    for d, label, stage, params in (
        ("two_nodes", "stock", 0, 10),
        ("two_nodes", "stock", 1, 30),
        ("two_nodes", "gpipe", 0, 10),
        ("two_nodes_dp", "dp", 0, 40),
        ("one_node", "stock", 1, 30),
    ):
        raw = tmp_path / "runs" / d / "raw" / label
        raw.mkdir(parents=True, exist_ok=True)
        (raw / f"rank{stage}.steps.json").write_text(json.dumps({"stage": stage, "params": params}))
    plan = link_calibration.plan(tmp_path, scaling.run_plan(a), a)
    assert plan == [
        {
            "nodes": 2,
            "config": "two_nodes",
            "rpn": 4,
            "stage": 1,
            "stage_bytes": 120,
            "stages_bytes": [40, 120],
            "all_bytes": 160,
        }
    ]


def test_tied_groups_come_from_every_rank_s_record():
    ranks = {
        0: ({"tied_stages": {"embed": [0, 3]}}, {}),
        1: ({"tied_stages": {}}, {}),
        3: ({"tied_stages": {"embed": [0, 3], "pos": [3]}}, {}),
        4: ({}, {}),
    }  # 4: recorded before the field
    assert tied_groups(ranks) == [[0, 3], [3]]
    assert tied_groups({0: ({}, {})}) == []


def test_stock_optimizer_step_counts_only_its_work_after_the_pipeline_barrier():
    # stage 0 arrives at 1.0 and waits for stage 1 (arrives at 1.5) before the norm; both end at 1.6
    t = stage_timings({0: _rank(0, 0, 1.0, 1.6, t0=99.0), 1: _rank(1, 1, 1.5, 1.6, t0=99.5)})
    assert t[0]["median"]["OptimizerStep"] == pytest.approx(0.1)  # not 0.6: the simulator waits itself
    assert t[1]["median"]["OptimizerStep"] == pytest.approx(0.1)
    assert t[0]["median"]["ForwardPass"] == pytest.approx(0.1)


def _netns_available() -> bool:
    try:
        preflight("tests/bench/test_bench_scaling.py", ("ip", "tc", "taskset"))  # the bench pins each node to a core
        return True
    except Exception:
        return False


_SERVER = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5901)); s.listen()
c, _ = s.accept(); print(c.recv(16).decode())"""
_CLIENT = """import socket, sys, time
for _ in range(100):
    try:
        socket.create_connection((sys.argv[1], 5901), timeout=5).sendall(b"hello"); break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("no connection")"""


@pytest.mark.skipif(not _netns_available(), reason="needs root, `ip netns` and `tc` (emulated nodes)")
def test_star_network_joins_every_node_through_its_own_shaped_link():
    net = StarNetwork("hdsT", "10.83.0", 3)
    try:
        qdiscs = net.setup("100mbit", "min")
        assert set(qdiscs) == set(net.nodes) and all("tbf" in q and "100Mbit" in q for q in qdiscs.values())
        for src, dst in ((0, 2), (2, 1)):  # a TCP message from one node to another, through the switch
            server = subprocess.Popen(
                net.exec_prefix(dst) + [sys.executable, "-c", _SERVER, net.addrs[dst]],
                stdout=subprocess.PIPE,
                text=True,
            )
            client = subprocess.run(
                net.exec_prefix(src) + [sys.executable, "-c", _CLIENT, net.addrs[dst]],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert client.returncode == 0, client.stderr
            assert server.communicate(timeout=30)[0].strip() == "hello"
        assert net.link_bytes(0)["tx"] > 0
        info = json.loads(__import__("base64").urlsafe_b64decode(net.world_info(2, 2)))
        assert info == {net.nodes[0]: [0, 1], net.nodes[1]: [0, 1]}
    finally:
        net.teardown()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hdsT-" not in listed


@pytest.mark.distributed
@pytest.mark.skipif(not _netns_available(), reason="needs root, `ip netns` and `tc` (emulated nodes)")
def test_scaling_study_end_to_end_on_two_emulated_nodes(tmp_path):
    """The whole study on a tiny shape: the star network, one worker job per node count with every
    schedule as a label ('auto' from stock's costs in the same job), the analysis and the report."""
    out = tmp_path / "scaling"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench",
            "scaling",
            "--nodes",
            "1,2",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--micro-batch-size",
            "4",
            "--schedules",
            "dp,1f1b,hippie-1f1b",
            "--rounds",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--emulate-speedup",
            "40",
            "--dilate",
            "2",
            "--max-dilate",
            "2",
            "--rate",
            "100mbit",
            "--out",
            str(out),
            "--timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    two = results["summary"]["by_nodes"]["2"]
    assert set(two) == {"dp", "1f1b", "hippie-1f1b"}
    assert all(r["step_s"] > 0 and r["scaling"] > 0 and r["predicted_step_s"] > 0 for r in two.values())
    assert two["hippie-1f1b"]["deferred_stages"] is not None  # 'auto' resolved from stock's costs
    costs = json.loads((out / "runs" / "two_nodes" / "raw" / "costs.json").read_text())
    assert all("optimizer_spans" not in st and st["optimizer_time"] >= 0 for st in costs["stages"])
    assert "## 2 nodes" in (out / "report.md").read_text() and "## Link calibration" in (out / "report.md").read_text()
    link = json.loads((out / "link.json").read_text())["by_nodes"]["2"]
    assert link["stage"]["ranks"] == 2 and link["all"]["ranks"] == 4 and link["stage_index"] in (0, 1)
    assert link["stages"]["ranks"] == 2 and link["stages"]["bytes"] > link["stage"]["bytes"]
    for shape, schedule in (("stages", "1f1b"), ("all", "dp")):  # the simulator ran at the measured efficiency
        assert 0 < link[shape]["efficiency"] < 1.5 and len(link[shape]["repeats_s"]) == link_calibration.REPEATS
        comm = results["runs"]["two_nodes"][schedule]["prediction"]["costs"]["comm"]
        # the ranks' link: 100mbit / D = 2, the run's own (dilated) time
        assert comm["allreduce_bandwidth"] == pytest.approx(12.5e6 / 2 * link[shape]["efficiency"])
    assert results["runs"]["two_nodes"]["1f1b"]["prediction"]["costs"]["tied_groups"] == []  # the model is untied
    # --dilate 2: the ranks ran the model's times x 2 on the link at 100mbit / 2; the report divides them back
    assert results["config"]["dilation"] == 2.0 and results["config"]["host_per_rank_cores"] == {
        "1": 1.0,
        "2": 1.0,
    }  # 2 ranks a core, D = 2
    raw = results["runs"]["two_nodes"]["1f1b"]
    assert two["1f1b"]["step_s"] == pytest.approx(raw["median_step_s"] / 2) and two["1f1b"]["dilation"] == 2
    assert two["1f1b"]["throughput"] == pytest.approx(raw["throughput_samples_s"] * 2)
    params = {
        json.loads(f.read_text())["params"]
        for f in (out / "runs" / "one_device" / "raw" / "dp").glob("rank*.steps.json")
    }
    from tools.bench.config import parameter_count

    assert params == {parameter_count(scaling.parse_args(["--out", "/tmp/x", "--dilate", "2"]))}  # the size kept
    shaped = [line for line in res.stdout.splitlines() if line.startswith("links shaped for D = 2:")]
    assert shaped and all("rate 50Mbit" in line for line in shaped), res.stdout[-3000:]
    host = json.loads((out / "host_cost.json").read_text())  # fitted from every rank's instructions
    assert host["forward"]["fixed"] + host["forward"]["per_layer"] > 0 and host["p2p"]["fixed"] > 0
    assert "hdss-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_worker_label_order_and_dp_alone():
    from tools.bench.workers.bench_worker import order_labels

    assert order_labels("hippie-1f1b,gpipe", measured_costs=True) == ["stock", "hippie-1f1b", "gpipe"]
    assert order_labels("gpipe,stock,hippie", measured_costs=True) == ["stock", "gpipe", "hippie"]
    assert order_labels("gpipe,stock") == ["gpipe", "stock"]
    assert order_labels("dp") == ["dp"]
    with pytest.raises(SystemExit, match="dp must run alone"):  # DeepSpeed's groups.mpu would regroup DP
        order_labels("dp,stock")


def test_row_wait_is_the_worst_rank_s_median_share_in_the_worst_round(tmp_path):
    """The rerun rule (row_dilation.row_wait) reads the same wait share as the report's flag
    (analysis.cpu_figures per round, scaling_summary.cpu_fields: the worst round)."""
    from tools.bench.studies.row_dilation import row_wait

    assert row_wait(tmp_path, "stock") is None  # no records
    (tmp_path / "raw" / "stock").mkdir(parents=True)
    for rank, waits in ((0, (0.01, 0.01)), (1, (0.2, 0.03))):
        steps = [
            {"round": r, "warmup": False, "start": 0, "end": 1, "cpu_s": 0.1, "runqueue_wait_s": w}
            for r, w in enumerate(waits)
            for _ in range(3)
        ]
        (tmp_path / "raw" / "stock" / f"rank{rank}.steps.json").write_text(json.dumps({"rank": rank, "steps": steps}))
    assert row_wait(tmp_path, "stock") == pytest.approx(0.2)  # rank 1 in round 0
    assert row_wait(tmp_path, "gpipe") is None  # another label's
