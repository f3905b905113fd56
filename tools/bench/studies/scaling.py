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
rank's CPU time and its run-queue wait; a row (one schedule of a job) whose rank waited for a core more
than WAITED_FOR_CORE of its step is rerun alone at 2D, 4D, ... up to ``--max-dilate`` until it is
host-free, and reports the D its figure was taken at (tools/bench/studies/row_dilation.py); a row that
waited at every D is flagged.

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
from tools.bench.cluster import (
    QUEUE_S,
    Refuse,
    StarNetwork,
    WorkerJob,
    check_cores,
    cleanup_on_signals,
    fix_owner,
    parse_rate,
    rate_arg,
)
from tools.bench.cluster import preflight as cluster_preflight
from tools.bench.labels import engine_label
from tools.bench.publish import publish
from tools.bench.runs import WORKER, worker_args
from tools.bench.studies.provenance import machine, source_state
from tools.bench.studies import link_calibration, row_dilation
from tools.bench.studies.scaling_plan import PLANNED, load_plans, make_plans, planned_names, tensor_scale
from tools.bench.studies.scaling_summary import DILATION_RULE, WAITED_FOR_CORE, config_name, host_cores, summarize

DEFAULT_SCHEDULES = "dp,1f1b,gpipe,hippie-1f1b,planned,planned-throughput"
# Time dilation by default (tools/bench/studies/dilation.py: the step at D is within 5% of its limit
# T_inf of T(D) = T_inf + h / D; at least ranks / cores = 8 for 4 nodes x 4 on 2 cores)
DEFAULT_DILATION = 16.0
_net: list[StarNetwork] = []
_jobs: list[WorkerJob] = []


def parse_args(argv=None):
    """The study's options, plus the cluster bench's (tools/bench/config.py) for the worker and the analysis."""
    from tools.bench.config import parse_args as bench_args

    p = argparse.ArgumentParser(
        prog="python -m tools.bench scaling",
        description=__doc__.split("\n\n")[0]
        + (
            " Defaults (any can be given): --model emulated:vgg16 --stages 4 "
            "--micro-batch-size 32 --micro-batches 8 --rate 10mbit --burst min --steps 4 "
            f"--warmup 2 --rounds 3 --schedules {DEFAULT_SCHEDULES} "
            "--out out/bench/scaling."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: sudo .venv/bin/python -m tools.bench scaling --model emulated:vgg16 "
        "--nodes 1,2,4 --rate 10mbit --publish docs/bench/scaling/vgg16. Any other "
        "option of the cluster bench (python -m tools.bench --help: --comm-dtype, "
        "--link-efficiency, --partition-method, ...) is passed on.",
    )
    p.add_argument("--nodes", default="1,2,4", help="node counts; 1 must be among them (scaling is from one node)")
    p.add_argument("--no-single", action="store_true", help="skip the single-device run (no scalability, ME)")
    p.add_argument("--analyze-only", action="store_true", help="re-analyse OUT/runs of an earlier run (no root)")
    p.add_argument(
        "--calibrate-only",
        action="store_true",
        help="time only the link calibration on OUT/runs of an earlier run (root), then re-analyse",
    )
    p.add_argument(
        "--network",
        default="hdss,10.82.0",
        metavar="PREFIX,SUBNET",
        help="the namespaces' name prefix and /24 subnet: another pair runs beside a study that uses "
        "the default (setting a network up first removes one of the same names)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep OUT/runs and OUT/plans of an earlier run of the "
        "same command: jobs that finished (raw/done.json) and plans made are not run again",
    )
    p.add_argument(
        "--dilate",
        type=float,
        default=DEFAULT_DILATION,
        metavar="D",
        help="time dilation: every device time x D and every transfer D x longer (the link shaped at "
        "--rate / D), so each rank has D x cores / ranks cores of host; reports divide every "
        "time by its row's D (tools/bench/studies/dilation.py measures the choice)",
    )
    p.add_argument(
        "--max-dilate",
        type=float,
        default=row_dilation.D_MAX,
        metavar="D",
        help="a row whose rank waited for a core more than 5%% of a step at D is rerun alone at 2D, "
        "4D, ... up to this D until it is host-free (--dilate's value: no reruns); each row "
        "reports its D, its times / its own D",
    )
    p.add_argument(
        "--host-cost",
        default=None,
        metavar="FILE",
        help="the host's CPU per instruction kind (a host_cost.json this study wrote: fitted from every "
        "instruction's CPU on its ranks); the planned columns' planner charges it, scaled to this "
        "cluster's host (ranks a core / D). Default: none (the planner prices no host)",
    )
    p.add_argument(
        "--plan-memory",
        type=float,
        default=16e9,
        help="bytes of one device for the planned columns "
        "(planned: hippie-ds plan's ME objective; planned-throughput: its throughput objective), x "
        "--emulate-scale for the emulated cluster (tools/bench/studies/scaling_plan.py)",
    )
    own, rest = p.parse_known_args(argv)
    defaults = [
        "--model",
        "emulated:vgg16",
        "--stages",
        "4",
        "--micro-batch-size",
        "32",
        "--micro-batches",
        "8",
        "--rate",
        "10mbit",
        "--burst",
        "min",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--schedules",
        DEFAULT_SCHEDULES,
        "--out",
        "out/bench/scaling",
        "--allreduce-cpu-per-mb",
        "0",
    ]
    a = bench_args(defaults + rest)
    a.no_single, a.analyze_only, a.calibrate_only = own.no_single, own.analyze_only, own.calibrate_only
    a.plan_memory, a.planned, a.network, a.resume = own.plan_memory, {}, own.network, own.resume
    if own.dilate < 1:
        p.error(f"--dilate {own.dilate}: D must be at least 1 (1: no dilation)")
    a.dilate, a.host_cost, a.max_dilate = own.dilate, own.host_cost, max(own.max_dilate, own.dilate)
    if own.host_cost and not Path(own.host_cost).is_file():
        p.error(
            f"--host-cost {own.host_cost!r}: no such file (python -m tools.bench scaling writes OUT/host_cost.json)"
        )
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
            jobs.append(
                {
                    "config": config_name(n),
                    "nodes": n,
                    "rpn": a.stages,
                    "dir": config_name(n),
                    "schedules": pipelines,
                    "labels": ",".join(engine_label(s) for s in pipelines),
                }
            )
        if "dp" in a.schedule_list:
            jobs.append(
                {
                    "config": config_name(n),
                    "nodes": n,
                    "rpn": a.stages,
                    "dir": f"{config_name(n)}_dp",
                    "schedules": ["dp"],
                    "labels": "dp",
                }
            )
        for name in planned_names(a.schedule_list):
            plan = getattr(a, "planned", {}).get((n, name))
            jobs.append(
                {
                    "config": config_name(n),
                    "nodes": n,
                    "rpn": a.stages,
                    "dir": f"{config_name(n)}_{name}",
                    "schedules": [name],
                    "labels": plan["schedule"] if plan else name,
                    "plan": plan,
                }
            )
    if not a.no_single:
        jobs.append(
            {"config": "one_device", "nodes": 1, "rpn": 1, "labels": "dp", "dir": "one_device", "schedules": ["dp"]}
        )
    return jobs


def job_args(a, job: dict, run_dir: Path) -> list[str]:
    """The worker's command line: the cluster bench's (``runs.worker_args``) with every label of the
    job, the rounds inside the worker, and for 'deferred_stages: auto' (the hippie configs) the costs
    the worker measures on the stock engine in the same job at the link's bandwidth."""
    pipelines = job["labels"] != "dp"
    planned = job.get("plan")
    a = dilated(a)
    args = worker_args(
        a,
        {**job, "schedule": "" if pipelines else "dp", "label": job["labels"]},
        run_dir,
        "measured" if pipelines and not planned else None,
    )
    args[args.index("--rounds") + 1] = str(a.rounds)
    if planned:  # the worker runs the plan through hippie.plan, its stages and batch the plan's
        for key, value in (
            ("--stages", planned["pipeline_depth"]),
            ("--micro-batch-size", planned["micro_batch_size"]),
            ("--micro-batches", planned["micro_batches"]),
            ("--global-batch", 0),
        ):
            args[args.index(key) + 1] = str(value)
        return args + ["--plan-config", planned["file"]]
    replicas = job["nodes"] * job["rpn"] // a.stages or 1  # DP: the pipelines' global batch, every rank
    args[args.index("--global-batch") + 1] = str(a.micro_batch_size * a.micro_batches * replicas)
    return args + ["--allreduce-bandwidth", str(parse_rate(a.rate) * a.link_efficiency)]


def dilated(a):
    """The options as the ranks run them at ``a.dilate`` = D: device times x D (``emulate_speedup`` / D),
    the link shaped at ``--rate`` / D (``rate``), so every transfer takes D x longer; time-outs x D.
    tbf's queue is D x ``QUEUE_S`` (``queue_s``): the undilated link's bytes. A queue of ``QUEUE_S``
    at every D gave a lone ring of 4 nodes 0.89 of the rate (11.3-11.5 s) against 0.65 (11.8-16.6 s)
    (625 kbit/s, 0.53 MB, AMD, 2026-12-02), but hung 8 ranks on 2 nodes in DeepSpeed's start-up
    (gloo's broadcast, 10-12 thousand frames dropped at each node's end): many flows need the bytes.
    The tensors keep their size (``emulate_scale``): the host's work per byte (copies, the emulated
    layers' element-wise ops, gloo's reduction) then does not grow with D, and its share of a dilated
    step shrinks as 1 / D, as the dilation means it to.
    (Scaling the tensors by D on the undilated rate instead made that work grow with D: a rank that
    waited for a core at D waited as much at 2D.) Pure."""
    d = copy.copy(a)
    d.emulate_speedup = a.emulate_speedup / a.dilate
    d.rate, d.queue_s = rate_arg(parse_rate(a.rate) / a.dilate), QUEUE_S * a.dilate
    d.timeout = int(a.timeout * a.dilate)
    return d


def shape_for(a, net) -> None:
    """Shape ``net``'s links for a job at ``a.dilate`` (``dilated``), unless they already are."""
    d = dilated(a)
    if net.reshape(d.rate, a.burst, d.queue_s):
        print(f"links shaped for D = {a.dilate:g}: {next(iter(net.qdiscs().values()), '')}", flush=True)


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
        net.setup(None, a.burst)  # unshaped: shape_for shapes the links for each job's D
        shape_for(a, net)
        print(f"emulated cluster: {net.describe(net.qdiscs(), with_veths=False)}", flush=True)
        if not a.calibrate_only:
            a.planned = make_plans(a, out, reuse=a.resume)
        reruns = iter(range(a.port + 100, a.port + 10000))  # a port per rerun job
        for i, job in enumerate([] if a.calibrate_only else run_plan(a)):
            run_dir = out / "runs" / job["dir"]
            if a.resume and (run_dir / "raw" / "done.json").exists():
                print(f"{job['dir']}: done in an earlier run (--resume)", flush=True)
            else:
                run_job(a, net, job, run_dir, a.port + i, start)
            # a row whose rank waited for a core measured the machine: rerun it alone at 2D, 4D, ...
            row_dilation.rerun_rows(a, out, job, lambda a_d, one, d: run_job(a_d, net, one, d, next(reruns), start))
        if not a.link_efficiency_given:  # an explicit --link-efficiency replaces the measured ones
            shape_for(a, net)
            link_calibration.measure(dilated(a), out, net, run_plan(a), a.port + 50, start)
    return time.monotonic() - start


def run_job(a, net, job: dict, run_dir: Path, port: int, start: float) -> None:
    """One worker job on the cluster, the load average before and after it in RUN/job.json."""
    import os

    run_dir.mkdir(parents=True, exist_ok=True)
    cores = [a.core_list[k % len(a.core_list)] for k in range(job["nodes"])]
    j = WorkerJob(
        net,
        WORKER,
        job_args(a, job, run_dir),
        run_dir / "logs",
        job["nodes"],
        job["rpn"],
        cores,
        port,
        t0=start,
        tag=job["dir"],
        accelerator=a.accelerator,
        device_count=a.device_count,
    )
    shape_for(a, net)
    load_before = list(os.getloadavg())
    _jobs.append(j)
    try:
        j.run(dilated(a).timeout)
    finally:
        _jobs.remove(j)
    (run_dir / "job.json").write_text(
        json.dumps({"load_before": load_before, "load_after": list(os.getloadavg()), "dilation": a.dilate})
    )


def analyse(a, out: Path, link: dict | None) -> dict:
    """runs[config][schedule]: each label's steps split by the worker's rounds, combined
    (``combine_rounds``), from the run at the D its figure is taken at (row_dilation.chosen_run: its
    ``dilation``; ``dilation_tried``: every D it ran at and its worst wait); the simulator's link
    efficiency per run from ``link`` (OUT/link.json: ``link_calibration``) where measured, else
    ``--link-efficiency``."""
    runs = {}
    for job in run_plan(a):
        for s in job["schedules"]:
            d, run_dir, job_d, tried = row_dilation.chosen_run(a, out, job, s)
            one = {**job_d, "schedule": s, "label": row_dilation.row_label(job_d, s)}
            measured = link_calibration.efficiency(link, job["nodes"], s)
            a_run = dilated(row_dilation.at_dilation(a, d))
            if measured is not None:
                a_run.link_efficiency = measured
            per_round = [
                analyse_job(run_dir, one, a_run, parse_rate(a_run.rate), only_round=r)
                for r in range(a.rounds if job["config"] != "one_device" else 1)
            ]
            r = combine_rounds(per_round)
            if r is not None:
                r.update(dilation=d, dilation_tried=[{"dilation": x, "wait": w} for x, w in tried])
                runs.setdefault(job["config"], {})[s] = r
    return runs


def write_host_cost(a, out: Path) -> dict | None:
    """Fit the host's CPU per instruction kind over every pipeline run of this study (each rank's
    instructions, tools/bench/studies/host_samples.py) into OUT/host_cost.json; its record."""
    from tools.bench.studies.host_samples import fit_runs

    host = fit_runs(out / "runs", source=f"fitted from {out / 'runs'} ({a.command})")
    if host is None:
        return None
    (out / "host_cost.json").write_text(host.model_dump_json(indent=1))
    return host.model_dump()


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

    config = {
        **config_record(a),
        "nodes": a.node_counts,
        "command": a.command,
        "global_batch": a.micro_batch_size * a.micro_batches * max(a.node_counts),
        "machine": {**machine(), "load_average_at_start": getattr(a, "load_at_start", None)},
        "source": getattr(a, "source", None) or source_state(),
        "plan_memory": a.plan_memory,
        "waited_for_core_share": WAITED_FOR_CORE,
        "dilation": a.dilate,
        "dilation_rule": DILATION_RULE,
        "max_dilation": a.max_dilate,
        "host_cost_file": a.host_cost,
        "host_per_rank_cores": {str(n): host_cores(a, n) for n in a.node_counts},
    }
    if (a.analyze_only or a.calibrate_only) and (out / "results.json").exists():  # the measuring command stays
        old = json.loads((out / "results.json").read_text())
        if old["config"].get("dilation") and old["config"].get("dilation_rule") != DILATION_RULE:
            print(
                f"bench scaling: {out / 'results.json'} was measured with the tensors' bytes x D (before "
                f"dilation_rule {DILATION_RULE!r}): its runs cannot be re-analysed under this rule; rerun them",
                file=sys.stderr,
            )
            return 2
        wall = old.get("wall_s")
        config = {**old["config"], "reanalysed_by": a.command}
    link = None if a.link_efficiency_given else link_calibration.load(out)
    if not a.planned:
        a.planned = load_plans(a, out)
    runs = analyse(a, out, link)
    a.planned = row_dilation.row_plans(a, out, run_plan(a))  # each planned column's plan at its row's D
    results = {
        "config": config,
        "runs": runs,
        "wall_s": wall,
        "link": link,
        "plans": {f"{n}/{name}": rec for (n, name), rec in a.planned.items()},
    }
    results["summary"] = summarize(
        results["runs"], a.node_counts, tensor_scale(a), a.planned, len(a.core_list), a.dilate
    )
    results["host_cost"] = write_host_cost(a, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = report(results)
    (out / "report.md").write_text(md)
    print(md)
    publish(a.publish, ("report.md", "results.json"), base=out)
    if a.publish and (out / "plans").is_dir():  # the plans run, their inputs and hippie-ds plan's output
        publish(Path(a.publish) / "plans", sorted((out / "plans").iterdir()))
    fix_owner(out)
    return 0
