"""The benchmark's runs: which jobs, in which order (rounds, order rotated), with which worker
arguments; running them one after another on the emulated two-node cluster (tools/bench/cluster/);
and the planner layouts given to some schedules (``--auto-plan``)."""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import time
from pathlib import Path

from tools.bench import REPO, WORKERS
from tools.bench.analysis import analyse_all, analyse_job
from tools.bench.cluster import (
    ForeignCpu,
    Network,
    WorkerJob,
    check_cores,
    cleanup_on_signals,
    foreign_cpu_between,
    parse_rate,
)
from tools.bench.cluster import preflight as cluster_preflight
from tools.bench.config import model_choice_args, round_orders
from tools.bench.figures import mean_or_none
from tools.bench.labels import engine_label, split_layers

WORKER = WORKERS / "bench_worker.py"
CONFIGS = ("two_nodes", "one_node", "one_device")
# Our own names, so the bench and another emulated cluster can be set up side by side.
NETWORK = Network(("hdsb-node0", "hdsb-node1"), ("hdsb-veth0", "hdsb-veth1"), ("10.78.0.1", "10.78.0.2"))


def preflight(args):
    """Raise Refuse unless the measured part can run here: the tools, root, ``ip netns``."""
    cluster_preflight(
        "this benchmark",
        ("ip", "taskset") + (() if args.no_shape else ("tc",)),
        hint="`--projection-only` runs the projection alone, without root.",
    )
    check_cores(args.cores)
    if not args.no_shape:
        parse_rate(args.rate)


# ---------------------------------------------------------------------------------- jobs
_active_jobs: list[WorkerJob] = []


def _cleanup():
    for job in list(_active_jobs):
        job.stop()
    _active_jobs.clear()
    if NETWORK.up:
        NETWORK.teardown()


def run_dir_name(config: str, schedule: str, rnd: int | None = None) -> str:
    """A run's directory under OUT/runs: ``CONFIG/SCHEDULE`` (a single run, as with --rounds 1)
    or ``two_nodes/SCHEDULE/round<R>`` (each round's run kept apart: logs, raw/, traces)."""
    return f"{config}/{schedule}" + ("" if rnd is None else f"/round{rnd}")


def run_plan(args) -> list[dict]:
    """The jobs to run, in order: (config, schedule, nodes, ranks per node, worker label, round,
    run directory). The two-node and one-node runs come in ``--rounds`` rounds
    (``round_orders``): each round runs every schedule on two nodes, then on one node, so the
    scaling from one node to two is taken per round and has a spread too; the one-device run
    (the single-device throughput every schedule's scalability divides by) once, at the end."""
    rounds = getattr(args, "rounds", 1)
    per_round = []
    for r, order in enumerate(round_orders(args.schedule_list, rounds)):
        per_round += [{"config": "two_nodes", "schedule": s, "nodes": 2, "rpn": args.stages, "round": r} for s in order]
        if not args.no_scaling:
            per_round += [
                {"config": "one_node", "schedule": s, "nodes": 1, "rpn": args.stages, "round": r} for s in order
            ]
    jobs = [
        {**j, "dir": run_dir_name(j["config"], j["schedule"], j["round"] if rounds > 1 else None)} for j in per_round
    ]
    if not args.no_single:
        jobs.append({"config": "one_device", "schedule": "dp", "nodes": 1, "rpn": 1})
    for j in jobs:
        j["label"] = engine_label(j["schedule"])
        j.setdefault("round", 0)
        j.setdefault("dir", run_dir_name(j["config"], j["schedule"]))
    return jobs


def samples_per_replica(a) -> int:
    return a.micro_batch_size * a.micro_batches


def worker_args(a, job: dict, out: Path, costs: Path | str | None) -> list[str]:
    world = job["nodes"] * job["rpn"]
    replicas = world // a.stages if job["config"] != "one_device" else 1
    if job["schedule"] == "dp":
        # Same global batch as the pipelines on the same machine (per rank: replica batch / stages).
        global_batch = samples_per_replica(a) if job["config"] == "one_device" else samples_per_replica(a) * replicas
    else:
        global_batch = 0
    args = [
        "--out",
        str(out),
        "--schedules",
        job["label"],
        "--stages",
        str(a.stages),
        "--micro-batches",
        str(a.micro_batches),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--global-batch",
        str(global_batch),
        "--seq",
        str(a.seq),
        "--d-model",
        str(a.d_model),
        "--heads",
        str(a.heads),
        "--layers",
        str(a.layers),
        "--vocab",
        str(a.vocab),
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
        "--rounds",
        "1",
        "--timeout-s",
        str(a.timeout),
        "--memory",
        "--schedule-configs",
        str(REPO / "configs"),
        "--partition-method",
        a.partition_method,
        *model_choice_args(a),
    ]
    if costs is not None:
        args += ["--costs", str(costs)]
    if a.comm_dtype:
        args += ["--comm-dtype", a.comm_dtype]
    # NAME@L runs in NAME's planned layout (the label changes only hippie.deferred_layers)
    plan = a.plans.get(job["schedule"]) or a.plans.get(split_layers(job["schedule"])[0])
    if plan and job["config"] == "two_nodes":  # a plan is made for one world size: the two-node job's
        args += ["--plan", f"{job['label']}={plan}"]
    return args


def write_costs(path: Path, run: dict, data_parallel: int):
    """The stock 1F1B run's measured costs as a cost file for 'deferred_stages: auto'."""
    costs = json.loads(json.dumps(run["prediction"]["costs"]))
    costs["comm"]["data_parallel"] = data_parallel
    path.write_text(json.dumps(costs, indent=1))


def job_name(job: dict) -> str:
    return job["dir"].replace("/round", " round ")


def measure(a, out: Path) -> tuple[dict, float, dict]:
    """Set up the cluster, run every job, tear down. Returns (runs, wall seconds, noise)."""

    atexit.register(_cleanup)
    shutil.rmtree(out / "runs", ignore_errors=True)
    jobs = run_plan(a)
    start = time.monotonic()
    sampler = ForeignCpu()
    cores = a.cores.split(",")
    link_bw = 1.25e9 if a.no_shape else parse_rate(a.rate)
    costs_files: dict[str, Path] = {}
    spans = []

    def cleanup():
        _cleanup()
        sampler.stop()

    with cleanup_on_signals(cleanup):
        qdiscs = NETWORK.setup(None if a.no_shape else a.rate, a.burst)
        print(f"emulated cluster: {NETWORK.describe(None if a.no_shape else qdiscs, with_veths=False)}", flush=True)
        print(
            f"{len(jobs)} runs: "
            + ", ".join(job_name(j) for j in jobs)
            + f"; {a.warmup} warm-up + {a.steps} timed steps each",
            flush=True,
        )
        sampler.start()
        for i, job in enumerate(jobs):
            run_dir = out / "runs" / job["dir"]
            run_dir.mkdir(parents=True, exist_ok=True)
            costs = costs_files.get(job["config"]) if job["schedule"] not in ("dp", "1f1b") else None
            tag = f"[{i + 1}/{len(jobs)}] {job_name(job)}"
            print(
                f"[{time.monotonic() - start:6.1f}s] {tag}: starting ({job['nodes']} node(s) x {job['rpn']} rank(s))",
                flush=True,
            )
            j = WorkerJob(
                NETWORK,
                WORKER,
                worker_args(a, job, run_dir, costs),
                run_dir / "logs",
                job["nodes"],
                job["rpn"],
                cores,
                a.port + i,
                t0=start,
                tag=tag,
                accelerator=a.accelerator,
                device_count=a.device_count,
            )
            _active_jobs.append(j)
            t_begin = time.perf_counter()
            try:
                j.run(a.timeout)
            finally:
                _active_jobs.remove(j)
            spans.append((t_begin, time.perf_counter()))
            r = analyse_job(run_dir, job, a, link_bw)
            if r:
                print(
                    f"[{time.monotonic() - start:6.1f}s] {tag}: median step {r['median_step_s']:.3f} s, "
                    f"{r['throughput_samples_s']:.2f} samples/s",
                    flush=True,
                )
                # the first (round 0) stock run's costs: 'auto' resolves the same in every round
                if (
                    job["schedule"] == "1f1b"
                    and job["config"] in ("two_nodes", "one_node")
                    and job["config"] not in costs_files
                ):
                    dp_width = 2 if job["config"] == "two_nodes" else 1
                    costs_files[job["config"]] = out / "runs" / job["config"] / "costs.json"
                    write_costs(costs_files[job["config"]], r, dp_width)
    foreign = [foreign_cpu_between(sampler.samples, b, e) / (e - b) for b, e in spans if e > b]
    noise = {
        "foreign_cpu_cores_per_run": foreign,
        "runs": [job["dir"] for job in jobs][: len(foreign)],
        "foreign_cpu_cores_mean": mean_or_none(foreign),
        "qdiscs": qdiscs,
    }
    return analyse_all(out, a, jobs), time.monotonic() - start, noise


# Schedules whose two-node run takes the planner's layout with --auto-plan (GPipe+DP and stock
# 1F1B are the baselines as DeepSpeed users run them: uniform partition, no re-computation).
AUTO_PLAN_SCHEDULES = ("hippie", "hippie-1f1b", "2bw", "pipedream")


def auto_plan(a, out: Path) -> dict:
    """Profile the benchmark model on this machine (``hippie_ds.profiler``) and plan, for each
    schedule of AUTO_PLAN_SCHEDULES that runs and has no --plan, the layout of the two-node job:
    ``a.stages`` stages x 2 replicas, the run's micro-batch size and count, boundaries and
    re-computation chosen by the planner for ME. Returns {schedule: plan file}."""
    import types

    import torch

    from hippie_ds.planner import Cluster, make_plan, save_plan, save_profile
    from hippie_ds.planner.plan_file import SCHEDULES
    from hippie_ds.profiler import profile_layers
    from tools.bench import model as bench_model

    names = dict.fromkeys(split_layers(s)[0] for s in a.schedule_list)  # hippie@auto: hippie's layout
    wanted = [s for s in names if s in AUTO_PLAN_SCHEDULES and s in SCHEDULES and s not in a.plans]
    if not wanted:
        return {}
    d = out / "plans"
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as a rank runs: one core per node, OMP_NUM_THREADS=1
    if bench_model.is_vgg_example(a):
        specs, sample, name = bench_model.layer_specs(a), next(bench_model.data_iter(a, 0))[0], "bench-vgg-example"
    else:  # the GPT at the run's shape (an emulated model is profiled as the GPT, as before)
        shape = types.SimpleNamespace(vocab=a.vocab, seq=a.seq, d_model=a.d_model, heads=a.heads, layers=a.layers)
        specs, sample, name = (
            bench_model.layer_specs(shape),
            torch.randint(0, a.vocab, (a.micro_batch_size, a.seq)),
            "bench-gpt",
        )
    profile = profile_layers(specs, sample, model=name, repeats=5, warmup=2, progress=sys.stdout)
    save_profile(profile, d / "profile.yaml")
    link = (1.25e9 if a.no_shape else parse_rate(a.rate)) * a.link_efficiency
    cluster = Cluster(
        nodes=2,
        devices_per_node=a.stages,
        device_memory=8e9,
        inter_node_bandwidth=link,
        intra_node_bandwidth=a.p2p_bandwidth,
        latency=a.p2p_latency,
    )
    plans = {}
    for s in wanted:
        plan = make_plan(
            profile,
            cluster,
            samples_per_replica(a) * 2,
            schedules=[s],
            depths=[a.stages],
            micro_batch_sizes=[a.micro_batch_size],
            objective="me",
            baselines=False,
        )
        path = d / f"{s}.json"
        save_plan(plan, path)
        plans[s] = str(path)
        print(
            f"planned {s}: boundaries {plan.boundaries}, re-computed layers {plan.checkpointed_layers or 'none'}, "
            f"{plan.micro_batches} micro-batches -> {path}",
            flush=True,
        )
    return plans
