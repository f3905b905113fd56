"""``python -m tools.bench scaling``: the paper's scaling table on an emulated cluster of 1, 2, 4, ... nodes.

Every node is a network namespace with one shaped link to a switch (:class:`cluster.StarNetwork`),
``--stages`` ranks per node (a pipeline inside the node, data parallelism across nodes, as the
Hippie paper runs it), the nodes pinned round-robin to ``--cores``. The model is normally an
emulated accelerator (``--model emulated:vgg16|gnmt8|gnmt16``, tools/bench/emulated.py): compute a
CPU-free wait of the profiled V100 time, real parameters and activations scaled by
``--emulate-scale``; the link must then be scaled by the same factor (``--rate``: 10 Gbit/s x 1e-3
= ``10mbit``) so that every transfer takes its profiled time.

Rounds: one job per node count (``--nodes``) runs every pipeline schedule, each its own engine in
the same processes (tools/bench/workers/bench_worker.py: built once, then ``--rounds`` rounds of ``--steps``
steps per schedule, the order rotated each round), and DP runs in a job of its own right after it
(``run_plan`` says why); ratios to stock 1F1B and DP and the scaling from one node are
taken per round, between runs of the same round, and reported as median (min-max) over rounds. One
single-device run (the whole model on one rank) gives the paper's scalability and memory
efficiency: ME = scalability x throughput / memory, scalability = throughput / (devices x
single-device throughput); memory here is the emulated device's, the tensors a rank holds
(parameters, gradients, optimizer state, peak bytes saved for backward), unscaled back to the
profile's size. Each run's step is also predicted by hippie-ds's simulator from the run's own
measured per-stage times and the link, at the efficiency a lone all-reduce of the same shape
measured on the same network after the runs (tools/bench/studies/link_calibration.py).

The planned columns (``planned``: hippie-ds plan's ME objective, ``planned-throughput``: its throughput
objective; tools/bench/studies/scaling_plan.py): per node count the planner plans for that emulated
cluster, and the plan runs in a job of its own through the DeepSpeed config key ``hippie.plan`` (its
stages, boundaries, re-computed layers, schedule, deferral and batch); the report sets the plan's
predicted step, memory and ME beside the measured ones (scaling_plan_report.py). Every step records each
rank's CPU time and its run-queue wait; a run whose rank waited for a core more than WAITED_FOR_CORE of
its step is flagged.

Writes OUT/results.json, OUT/report.md (tools/bench/studies/scaling_report.py); ``--publish DIR`` copies them
(and OUT/plans to DIR/plans).
"""
from __future__ import annotations

import argparse
import atexit
import copy
import json
import shutil
import sys
import time
from pathlib import Path

from tools.bench.analysis import analyse_job, combine_rounds
from tools.bench.cluster import Refuse, StarNetwork, WorkerJob, check_cores, cleanup_on_signals, fix_owner, parse_rate
from tools.bench.cluster import preflight as cluster_preflight
from tools.bench.figures import round_ratios, spread_excludes
from tools.bench.labels import engine_label
from tools.bench.publish import publish
from tools.bench.runs import WORKER, worker_args
from tools.bench.studies import link_calibration
from tools.bench.studies.scaling_plan import PLANNED, load_plans, make_plans, planned_names

NAMES = {1: "one_node", 2: "two_nodes", 4: "four_nodes", 8: "eight_nodes"}
# a rank that waited for a core longer than this share of the step measured the machine's contention
WAITED_FOR_CORE = 0.05
DEFAULT_SCHEDULES = "dp,1f1b,gpipe,hippie,hippie-1f1b,planned,planned-throughput"
_net: list[StarNetwork] = []
_jobs: list[WorkerJob] = []


def config_name(nodes: int) -> str:
    """The runs' key of a node count: one_node, two_nodes, four_nodes, ... (``N_nodes`` otherwise)."""
    return NAMES.get(nodes, f"{nodes}_nodes")


def parse_args(argv=None):
    """The study's options, plus the cluster bench's (tools/bench/config.py) for the worker and the analysis."""
    from tools.bench.config import parse_args as bench_args
    p = argparse.ArgumentParser(prog="python -m tools.bench scaling", description=__doc__.split("\n\n")[0] + (
                                    " Defaults (any can be given): --model emulated:vgg16 --stages 4 "
                                    "--micro-batch-size 32 --micro-batches 8 --rate 10mbit --burst min --steps 4 "
                                    f"--warmup 2 --rounds 3 --schedules {DEFAULT_SCHEDULES} "
                                    "--out out/bench/scaling."),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="example: sudo .venv/bin/python -m tools.bench scaling --model emulated:vgg16 "
                                       "--nodes 1,2,4 --rate 10mbit --publish docs/bench/scaling/vgg16. Any other "
                                       "option of the cluster bench (python -m tools.bench --help: --comm-dtype, "
                                       "--link-efficiency, --partition-method, ...) is passed on.")
    p.add_argument("--nodes", default="1,2,4", help="node counts; 1 must be among them (scaling is from one node)")
    p.add_argument("--no-single", action="store_true", help="skip the single-device run (no scalability, ME)")
    p.add_argument("--analyze-only", action="store_true", help="re-analyse OUT/runs of an earlier run (no root)")
    p.add_argument("--calibrate-only", action="store_true", help="time only the link calibration on OUT/runs of an "
                   "earlier run (root), then re-analyse")
    p.add_argument("--network", default="hdss,10.82.0", metavar="PREFIX,SUBNET",
                   help="the namespaces' name prefix and /24 subnet: another pair runs beside a study that uses "
                        "the default (setting a network up first removes one of the same names)")
    p.add_argument("--resume", action="store_true", help="keep OUT/runs and OUT/plans of an earlier run of the "
                   "same command: jobs that finished (raw/done.json) and plans made are not run again")
    p.add_argument("--plan-memory", type=float, default=16e9, help="bytes of one device for the planned columns "
                   "(planned: hippie-ds plan's ME objective; planned-throughput: its throughput objective), x "
                   "--emulate-scale for the emulated cluster (tools/bench/studies/scaling_plan.py)")
    own, rest = p.parse_known_args(argv)
    defaults = ["--model", "emulated:vgg16", "--stages", "4", "--micro-batch-size", "32", "--micro-batches", "8",
                "--rate", "10mbit", "--burst", "min", "--steps", "4", "--warmup", "2", "--schedules",
                DEFAULT_SCHEDULES, "--out", "out/bench/scaling", "--allreduce-cpu-per-mb", "0"]
    a = bench_args(defaults + rest)
    a.no_single, a.analyze_only, a.calibrate_only = own.no_single, own.analyze_only, own.calibrate_only
    a.plan_memory, a.planned, a.network, a.resume = own.plan_memory, {}, own.network, own.resume
    if len(own.network.split(",")) != 2 or len(own.network.split(",")[1].split(".")) != 3:
        p.error(f"--network {own.network!r}: expected PREFIX,A.B.C, e.g. hdss,10.82.0")
    # an explicit --link-efficiency replaces the measured ones (link_calibration)
    a.link_efficiency_given = any(x.split("=")[0] == "--link-efficiency" for x in rest)
    try:
        a.node_counts = sorted({int(x) for x in own.nodes.split(",") if x.strip()})
    except ValueError:
        p.error(f"--nodes {own.nodes!r}: expected integers, e.g. 1,2,4")
    if not a.node_counts or a.node_counts[0] != 1 or len(a.node_counts) < 2:
        p.error(f"--nodes {own.nodes!r}: needs 1 and at least one larger count (scaling is from one node)")
    if planned_names(a.schedule_list) and not str(a.model).startswith("emulated:"):
        p.error(f"--schedules {a.schedules!r}: the planned columns plan an emulated model (--model emulated:NAME)")
    a.core_list = [int(c) for c in a.cores.split(",")]
    return a


def run_plan(a) -> list[dict]:
    """The jobs: per node count, one for the pipeline schedules (labels of one worker that runs
    them in interleaved rounds: the processes start once) and, right after it, one for DP alone
    (DP cannot share processes with a pipeline engine: bench_worker.order_labels says why); then
    the single-device run; each planned column (``PLANNED``) in a job of its own too, the plan's
    stages, micro-batches and schedule (``a.planned``: the plans made, scaling_plan.make_plans). Pure."""
    pipelines = [s for s in a.schedule_list if s != "dp" and s not in PLANNED]
    jobs = []
    for n in a.node_counts:
        if pipelines:
            jobs.append({"config": config_name(n), "nodes": n, "rpn": a.stages, "dir": config_name(n),
                         "schedules": pipelines, "labels": ",".join(engine_label(s) for s in pipelines)})
        if "dp" in a.schedule_list:
            jobs.append({"config": config_name(n), "nodes": n, "rpn": a.stages, "dir": f"{config_name(n)}_dp",
                         "schedules": ["dp"], "labels": "dp"})
        for name in planned_names(a.schedule_list):
            plan = getattr(a, "planned", {}).get((n, name))
            jobs.append({"config": config_name(n), "nodes": n, "rpn": a.stages, "dir": f"{config_name(n)}_{name}",
                         "schedules": [name], "labels": plan["schedule"] if plan else name, "plan": plan})
    if not a.no_single:
        jobs.append({"config": "one_device", "nodes": 1, "rpn": 1, "labels": "dp", "dir": "one_device",
                     "schedules": ["dp"]})
    return jobs


def job_args(a, job: dict, run_dir: Path) -> list[str]:
    """The worker's command line: the cluster bench's (``runs.worker_args``) with every label of the
    job, the rounds inside the worker, and for 'deferred_stages: auto' (the hippie configs) the costs
    the worker measures on the stock engine in the same job at the link's bandwidth."""
    pipelines = job["labels"] != "dp"
    planned = job.get("plan")
    args = worker_args(a, {**job, "schedule": "" if pipelines else "dp", "label": job["labels"]},
                       run_dir, "measured" if pipelines and not planned else None)
    args[args.index("--rounds") + 1] = str(a.rounds)
    if planned:  # the worker runs the plan through hippie.plan, its stages and batch the plan's
        for key, value in (("--stages", planned["pipeline_depth"]), ("--micro-batch-size", planned["micro_batch_size"]),
                           ("--micro-batches", planned["micro_batches"]), ("--global-batch", 0)):
            args[args.index(key) + 1] = str(value)
        return args + ["--plan-config", planned["file"]]
    replicas = job["nodes"] * job["rpn"] // a.stages or 1  # DP: the pipelines' global batch, every rank
    args[args.index("--global-batch") + 1] = str(a.micro_batch_size * a.micro_batches * replicas)
    return args + ["--allreduce-bandwidth", str(parse_rate(a.rate) * a.link_efficiency)]


def _cleanup():
    for j in list(_jobs):
        j.stop()
    _jobs.clear()
    for net in _net:
        if net.up:
            net.teardown()


def measure(a, out: Path) -> float:
    """Run every job on the emulated cluster (set up once for the most nodes), then the link
    calibration (``--calibrate-only``: that alone); wall seconds."""
    cluster_preflight("python -m tools.bench scaling", ("ip", "tc", "taskset"))
    a.load_at_start = list(__import__("os").getloadavg())
    a.source = source_state()
    check_cores(a.cores)
    prefix, subnet = a.network.split(",")
    net = StarNetwork(prefix, subnet, max(a.node_counts))
    _net.append(net)
    atexit.register(_cleanup)
    if not a.calibrate_only and not a.resume:
        shutil.rmtree(out / "runs", ignore_errors=True)
    start = time.monotonic()
    with cleanup_on_signals(_cleanup):
        qdiscs = net.setup(a.rate, a.burst)
        print(f"emulated cluster: {net.describe(qdiscs, with_veths=False)}", flush=True)
        if not a.calibrate_only:
            a.planned = make_plans(a, out, reuse=a.resume)
        for i, job in enumerate([] if a.calibrate_only else run_plan(a)):
            run_dir = out / "runs" / job["dir"]
            if a.resume and (run_dir / "raw" / "done.json").exists():
                print(f"{job['dir']}: done in an earlier run (--resume)", flush=True)
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            cores = [a.core_list[k % len(a.core_list)] for k in range(job["nodes"])]
            j = WorkerJob(net, WORKER, job_args(a, job, run_dir), run_dir / "logs", job["nodes"], job["rpn"], cores,
                          a.port + i, t0=start, tag=job["dir"], accelerator=a.accelerator, device_count=a.device_count)
            _jobs.append(j)
            try:
                j.run(a.timeout)
            finally:
                _jobs.remove(j)
        if not a.link_efficiency_given:  # an explicit --link-efficiency replaces the measured ones
            link_calibration.measure(a, out, net, run_plan(a), a.port + 50, start)
    return time.monotonic() - start


def analyse(a, out: Path, link: dict | None) -> dict:
    """runs[config][schedule]: each label's steps split by the worker's rounds, combined
    (``combine_rounds``); the simulator's link efficiency per run from ``link`` (OUT/link.json:
    ``link_calibration``) where measured, else ``--link-efficiency``."""
    runs = {}
    for job in run_plan(a):
        for s in job["schedules"]:
            one = {**job, "schedule": s, "label": job["labels"] if job.get("plan") else engine_label(s)}
            measured = link_calibration.efficiency(link, job["nodes"], s)
            a_run = a
            if measured is not None:
                a_run = copy.copy(a)
                a_run.link_efficiency = measured
            per_round = [analyse_job(out / "runs" / job["dir"], one, a_run, parse_rate(a.rate), only_round=r)
                         for r in range(a.rounds if job["config"] != "one_device" else 1)]
            r = combine_rounds(per_round)
            if r is not None:
                runs.setdefault(job["config"], {})[s] = r
    return runs


def emulated_memory(r: dict, scale: float) -> float | None:
    """Mean bytes per rank an emulated device would hold: parameters, gradients, optimizer state and
    the peak saved for backward, divided by the model's scale (the profile's real sizes)."""
    state, saved = r.get("mean_state_bytes"), r.get("mean_peak_saved_bytes")
    if state is None or saved is None:
        return None
    return (state + saved) / scale


def summarize(runs: dict, node_counts: list[int], scale: float, plans: dict | None = None,
              cores: int | None = None) -> dict:
    """Per node count and schedule: ratios to 1F1B and DP per round, scaling from one node per
    round, scalability, memory and ME against DP (the paper's definitions); the planned columns'
    predictions beside their measured figures (``plans``: {(nodes, name): scaling_plan.plan_record});
    each run's CPU per step against ``cores`` (the cores its nodes were pinned to, at most one per
    node). Pure."""
    single = ((runs.get("one_device") or {}).get("dp") or {}).get("throughput_samples_s")
    one = runs.get(config_name(1), {})
    out = {"single_device_throughput": single, "by_nodes": {}}
    for n in node_counts:
        here = runs.get(config_name(n), {})
        devices = next(iter(here.values()))["world"] if here else n  # every run on n nodes uses them all
        rows = {}
        for s, r in here.items():
            rows[s] = _row(s, r, here, one.get(s) or {}, n, devices, single, scale)
            rows[s].update(cpu_fields(r, min(n, cores) if cores else None))
        dp_me = (rows.get("dp") or {}).get("me")
        for row in rows.values():
            row["me_vs_dp"] = row["me"] / dp_me if row.get("me") and dp_me else None
        for s, row in rows.items():
            if (n, s) in (plans or {}):
                row.update(planned_fields(row, here[s], plans[(n, s)]))
        out["by_nodes"][str(n)] = rows
    return out


def _error(predicted, measured):
    return (predicted - measured) / measured if predicted is not None and measured else None


def planned_fields(row: dict, run: dict, plan: dict) -> dict:
    """A planned column's plan and its predictions beside the measured row: step, memory per device,
    ME and ME against DP, each with its error ((predicted - measured) / measured); ``used_plan``: the
    run's stage boundaries and re-computed layers are the plan's (as its ranks recorded them). Pure."""
    p = plan["predicted"]
    return {"plan": {k: plan[k] for k in ("objective", "schedule", "pipeline_depth", "data_parallel",
                                          "micro_batch_size", "micro_batches", "boundaries", "checkpointed_layers",
                                          "schedule_params", "deferred_layers", "command", "file")},
            "used_plan": run.get("parts") == plan["boundaries"] and run.get("checkpointed_layers") == plan[
                "checkpointed_layers"],
            "plan_predicted_step_s": p["step_s"], "plan_step_error": _error(p["step_s"], row.get("step_s")),
            "plan_predicted_memory_bytes": p["memory_bytes"],
            "plan_memory_error": _error(p["memory_bytes"], row.get("memory_bytes")),
            "plan_predicted_me": p["me"], "plan_me_error": _error(p["me"], row.get("me")),
            "plan_predicted_me_vs_dp": p["me_vs_dp"], "plan_me_vs_dp_error": _error(p["me_vs_dp"], row.get("me_vs_dp")),
            "plan_predicted_by": p["predicted_by"]}


def cpu_fields(r: dict, cores: int | None) -> dict:
    """A run's CPU per step (analysis.cpu_figures) and its verdict: ``waited_for_core`` when in any
    round a rank waited for a core more than WAITED_FOR_CORE of the step (the run then measures the
    machine's contention: reported, not averaged in); ``cpu_load_vs_cores``: the CPU every rank asked
    per step over what ``cores`` give in a step. Pure."""
    waits = [w for w in (r.get("round_runqueue_wait_share_max") or [r.get("runqueue_wait_share_max")])
             if w is not None]
    total, step = r.get("cpu_s_per_step_all_ranks"), r.get("median_step_s")
    return {"cpu_s_per_step_all_ranks": total, "cpu_share_median": r.get("cpu_share_median"),
            "runqueue_wait_share_max": max(waits) if waits else None,
            "waited_for_core": max(waits) > WAITED_FOR_CORE if waits else None, "cores": cores,
            "cpu_load_vs_cores": total / (step * cores) if total is not None and step and cores else None}


def _row(name: str, r: dict, here: dict, one: dict, n: int, devices: int, single, scale: float) -> dict:
    thr = r.get("throughput_samples_s")
    v1 = round_ratios(r.get("round_throughput_samples_s"), (here.get("1f1b") or {}).get("round_throughput_samples_s"))
    vd = round_ratios(r.get("round_throughput_samples_s"), (here.get("dp") or {}).get("round_throughput_samples_s"))
    sc = round_ratios(r.get("round_throughput_samples_s"), one.get("round_throughput_samples_s"))
    mem = emulated_memory(r, scale)
    scal = thr / (devices * single) if thr and single else None
    pred = r.get("prediction") or {}
    return {
        "step_s": r.get("median_step_s"), "step_min": r.get("median_step_s_min"), "step_max": r.get("median_step_s_max"),
        "throughput": thr, "devices": devices,
        "vs_1f1b": v1["median"], "vs_1f1b_min": v1["min"], "vs_1f1b_max": v1["max"],
        "real_vs_1f1b": spread_excludes(v1["min"], v1["max"]) if v1["n"] > 1 and name != "1f1b" else None,
        "vs_dp": vd["median"], "vs_dp_min": vd["min"], "vs_dp_max": vd["max"],
        "scaling": sc["median"] / n if sc["median"] else None,
        "scaling_min": sc["min"] / n if sc["min"] else None, "scaling_max": sc["max"] / n if sc["max"] else None,
        "scaling_rounds": [x / n if x else None for x in sc["rounds"]],
        "memory_bytes": mem, "scalability": scal, "me": scal * thr / (mem / 1e9) if scal and mem else None,
        "exposed_allreduce_s": r.get("exposed_allreduce_s_per_step"),
        "predicted_step_s": pred.get("step_time"), "prediction_error": pred.get("error"),
        "layout": (f"DP x{r['world']}" if name == "dp" else f"{r['stages']} stages x {r['world'] // r['stages']}"),
        "micro_batches": r.get("micro_batches"), "micro_batch_size": r.get("micro_batch_size"),
        "parts": r.get("parts"), "checkpointed_layers": r.get("checkpointed_layers"),
        "deferred_stages": (r.get("schedule_params") or {}).get("deferred_stages"),
        "delayed_fraction": r.get("delayed_fraction"),
    }


def source_state() -> dict:
    """The commit the run measured and the files of the code it ran that differ from it (a tree
    shared with other work: the planner's uncommitted changes plan too)."""
    import subprocess

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                                  text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    dirty = git("status", "--porcelain", "--", "hippie_ds", "tools/bench", "schedules")
    return {"commit": (git("rev-parse", "HEAD") or "").strip() or None,
            "uncommitted": [line[3:] for line in (dirty or "").splitlines() if line.strip()]}


def machine() -> dict:
    """The machine that gave the figures: host, CPU model, cores, load when the run ended."""
    import os
    import platform
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else None
    return {"host": platform.node(), "cpu": model, "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "load_average": list(os.getloadavg())}


def main(argv=None) -> int:
    a = parse_args(argv)
    a.command = " ".join(["python -m tools.bench scaling", *(sys.argv[1:] if argv is None else argv)])
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wall = None
    if not a.analyze_only or a.calibrate_only:
        try:
            wall = measure(a, out)
        except Refuse as exc:
            print(f"bench scaling: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:
            print(f"bench scaling: {exc}", file=sys.stderr)
            fix_owner(out)
            return 1
    from tools.bench.config import config_record
    from tools.bench.studies.scaling_report import report
    config = {**config_record(a), "nodes": a.node_counts, "command": a.command,
              "global_batch": a.micro_batch_size * a.micro_batches * max(a.node_counts), "machine": {**machine(), "load_average_at_start": getattr(a, "load_at_start", None)},
              "source": getattr(a, "source", None) or source_state(),
              "plan_memory": a.plan_memory, "waited_for_core_share": WAITED_FOR_CORE}
    if (a.analyze_only or a.calibrate_only) and (out / "results.json").exists():  # the measuring command stays
        old = json.loads((out / "results.json").read_text())
        wall = old.get("wall_s")
        config = {**old["config"], "reanalysed_by": a.command}
    link = None if a.link_efficiency_given else link_calibration.load(out)
    if not a.planned:
        a.planned = load_plans(a, out)
    results = {"config": config, "runs": analyse(a, out, link), "wall_s": wall, "link": link,
               "plans": {f"{n}/{name}": rec for (n, name), rec in a.planned.items()}}
    results["summary"] = summarize(results["runs"], a.node_counts, a.emulate_scale, a.planned, len(a.core_list))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = report(results)
    (out / "report.md").write_text(md)
    print(md)
    publish(a.publish, ("report.md", "results.json"), base=out)
    if a.publish and (out / "plans").is_dir():  # the plans run, their inputs and hippie-ds plan's output
        publish(Path(a.publish) / "plans", sorted((out / "plans").iterdir()))
    fix_owner(out)
    return 0
