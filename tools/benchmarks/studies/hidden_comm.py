#!/usr/bin/env python3
"""Benchmark: does Hippie's communication schedule hide the data-parallel all-reduce?

The full benchmark report (DP baseline, memory, memory efficiency, scaling, simulator predictions,
projection) is tools/bench.py (``make bench``); this tool interleaves schedules in the same
processes and breaks the exposed all-reduce down per stage.

An emulated two-node cluster on one machine (brief section 4): two network namespaces
(hds-node0, hds-node1) joined by a veth pair (veth0 10.77.0.1 <-> veth1 10.77.0.2), each end
shaped with ``tc tbf rate 1gbit burst 1mb latency 100ms``. One job of 4 ranks = 2 nodes x 2
ranks: a 2-stage pipeline inside each node (ranks 0,1 = node 0 = stages 0,1 of replica 0; ranks
2,3 = node 1) and 2 data-parallel replicas across the link
(``hippie_ds.make_topology(2, 4, "pipeline_in_node")``). Node 0's ranks are pinned to one core
(``taskset -c 0``), node 1's to another (``-c 1``); gloo on ``GLOO_SOCKET_IFNAME=vethN``,
``MASTER_ADDR=10.77.0.1``; DeepSpeed's launcher is started once per node
(``python -m deepspeed.launcher.launch --world_info=... --node_rank=N``).

The one worker script, tools/workers/bench_worker.py, trains a GPT-like PipelineModule (default 8
blocks, d_model 320, vocab 4096, sequence 64, micro-batch 2, fp32 AdamW: about 6.2M parameters
= 25 MB per stage) with, side by side in the same processes: stock DeepSpeed 1F1B
(``deepspeed.initialize``) and hippie-ds ``gpipe``, ``hippie``, ``hippie-1f1b`` (default
``deferred_stages``: [0] with 2 stages) and ``hippie-auto`` (``hippie`` with
``"deferred_stages": "auto"`` and a cost file measured on the stock engine's warm-up steps).
Every schedule gets a fresh module built from the same seed, ``--warmup`` untimed steps, then
``--rounds`` rounds of ``--steps`` timed steps; rounds visit the schedules round-robin (the
order rotated each round) so machine noise hits all alike: keep blocks short (a few steps,
more rounds), since load from other processes comes and goes on a scale of a minute. No
barrier is added around steps. CPU time used by other processes during every timed step is
sampled from /proc and reported ("foreign CPU"), with a warning when it is not negligible.

Usage (from the repository root, as root; `sudo` keeps the venv's python)::

    sudo .venv/bin/python tools/bench.py hidden-comm --steps 3 --rounds 4
    sudo .venv/bin/python tools/bench.py hidden-comm --rate 500mbit --out out/bench_500mbit
    .venv/bin/python tools/bench.py hidden-comm --analyze-only   # re-analyse out/bench_hidden_comm/raw

Outputs under ``--out`` (default out/bench_hidden_comm/):

* results.json: per schedule the step times, medians, ratio to stock 1F1B, throughput and a
  per-stage breakdown from the timelines; results.md: the same as markdown tables (also printed);
* traces/<schedule>.json: Chrome trace (chrome://tracing, ui.perfetto.dev) of the timed steps,
  one process per rank; traces/<schedule>.png: the last two timed steps as a Gantt chart;
* raw/: per-rank step records and instruction timelines, foreign_cpu.json (the noise samples);
  logs/node{0,1}.log: launcher output, logs/command.txt: node 0's launch command.

What is measured
----------------
* step time: wall time of one ``engine.train_batch`` call on each rank (``time.perf_counter``).
  Per step the maximum over the 4 ranks and rank 0's own; the headline is the median over all
  timed steps of the per-step maximum. Throughput = global samples per step (micro-batch size x
  micro-batches x 2 replicas) / that median.
* exposed all-reduce (per stage, seconds per step, mean over timed steps and the stage's two
  replicas): the summed duration of the instructions during which the rank's stream does
  gradient all-reduce work instead of compute: ``ReduceGrads`` and ``ReduceTiedGrads`` (stock and
  gpipe/1f1b: blocking all-reduce, with its flatten/unflatten copies), ``StartAllReduce``
  (flatten + divide + launch of the async all-reduce) and ``WaitAllReduce`` (blocking until the
  async all-reduce is complete, plus copying back the reduced gradients). NOT counted:
  ``OptimizerStep``/``StageOptimizerStep``/``ApplyBufferedUpdate`` (the update; DeepSpeed's
  ``OptimizerStep`` has no collective here: fp32, no clipping), ``CopyGradsToBuffer`` (a local
  copy), and the loss all-reduce + pipeline broadcast that ``train_batch`` runs after the
  schedule (reported as "after schedule").
* all-reduce span: from the start of ``StartAllReduce`` to the end of its ``WaitAllReduce``
  (``ReduceGrads``: its own duration): how long the all-reduce was outstanding, hidden or not.
* stock DeepSpeed has no timeline hook: the worker gives that engine a per-instance copy of
  ``PipelineEngine._INSTRUCTION_MAP`` whose functions time the original handlers
  (``_exec_schedule`` calls the functions in ``self._INSTRUCTION_MAP``). hippie-ds engines record
  the same with ``"hippie": {"timeline_dir": ...}``.

Needs root and ``ip netns`` (refuses with exit code 2 otherwise). The namespaces are always
removed: at exit, on SIGINT/SIGTERM/SIGHUP, and leftovers of a crashed run at start.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.config import parameter_count
# The analysis of the run (instruction groups, exposed all-reduce, traces, tables).
from benchmarks.studies.hidden_comm_analysis import analyse
# The emulated cluster (namespaces, link, launchers, noise) is tools/cluster/, shared with bench.py.
from cluster import (REPO, ForeignCpu, Network, Refuse, WorkerJob, check_cores, cleanup_on_signals, fix_owner,
                     parse_rate, preflight as cluster_preflight)

WORKER = REPO / "tools" / "workers" / "bench_worker.py"
NETWORK = Network(("hds-node0", "hds-node1"), ("veth0", "veth1"), ("10.77.0.1", "10.77.0.2"))
DEFAULT_SCHEDULES = "stock,gpipe,hippie,hippie-1f1b,hippie-auto"
KNOWN_LABELS = ("stock", "1f1b", "gpipe", "hippie", "hippie-1f1b", "hippie-auto", "hippie-1f1b-auto")


def preflight(args):
    cluster_preflight("this benchmark", ("ip", "taskset") + (() if args.no_shape else ("tc",)))
    check_cores(args.cores)
    if not args.no_shape:
        parse_rate(args.rate)


# ---------------------------------------------------------------------------------- job
def worker_args(a, out: Path) -> list[str]:
    """tools/workers/bench_worker.py's command line: every schedule in the same processes, in rounds."""
    return ["--out", str(out), "--schedules", a.schedules, "--micro-batches", str(a.micro_batches),
            "--micro-batch-size", str(a.micro_batch_size), "--seq", str(a.seq), "--d-model", str(a.d_model),
            "--heads", str(a.heads), "--layers", str(a.layers), "--vocab", str(a.vocab),
            "--warmup", str(a.warmup), "--steps", str(a.steps), "--rounds", str(a.rounds),
            "--allreduce-bandwidth", str(parse_rate(a.rate) if not a.no_shape else 1.25e9),
            "--timeout-s", str(a.timeout)]


def new_job(a, out: Path) -> WorkerJob:
    """The two launchers (one per emulated node, 2 ranks each), their logs and progress output."""
    return WorkerJob(NETWORK, WORKER, worker_args(a, out), out / "logs", nodes=2, ranks_per_node=2,
                     cores=a.cores.split(","), port=a.port)


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="tools/bench.py hidden-comm",
        description="Emulated two-node benchmark of stock DeepSpeed 1F1B vs hippie-ds schedules: step time and "
                    "exposed data-parallel all-reduce. Needs root (network namespaces).",
        epilog="example: sudo .venv/bin/python tools/bench.py hidden-comm --steps 3 --rounds 4",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="out/bench_hidden_comm", help="output directory")
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES, help=f"comma list from {', '.join(KNOWN_LABELS)}")
    p.add_argument("--steps", type=int, default=3, help="timed steps per schedule per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds over all schedules (round-robin)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule before the rounds")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (split over the 2 stages)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    p.add_argument("--no-shape", action="store_true", help="do not shape the link")
    p.add_argument("--cores", default="0,1", help="core of node 0, core of node 1 (taskset)")
    p.add_argument("--port", type=int, default=29500, help="master port (inside hds-node0)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before the job is killed")
    p.add_argument("--quiet-below", type=float, default=0.1,
                   help="a timed step is 'quiet' when other processes used fewer cores than this during it")
    p.add_argument("--analyze-only", action="store_true", help="only re-analyse OUT/raw of an earlier run (no root)")
    a = p.parse_args(argv)
    unknown = [s for s in a.schedules.split(",") if s and s not in KNOWN_LABELS]
    if unknown:
        p.error(f"--schedules: unknown {unknown}; known: {', '.join(KNOWN_LABELS)}")
    if a.d_model % a.heads:
        p.error("--d-model must be a multiple of --heads")
    return a


def args_record(a):
    # Parameters per stage as the worker's PipelineModule(partition_method='uniform') splits them.
    total = parameter_count(a)
    return {"micro_batches": a.micro_batches, "micro_batch_size": a.micro_batch_size, "seq": a.seq,
            "d_model": a.d_model, "layers": a.layers, "vocab": a.vocab, "warmup": a.warmup, "steps": a.steps,
            "rounds": a.rounds, "link": "unshaped veth" if a.no_shape else f"tbf {a.rate}",
            "params_per_stage": f"~{total / 2 / 1e6:.2f}M", "cores": a.cores, "command": " ".join(sys.argv)}


def measure(a, out: Path) -> tuple[int, dict | None]:
    """Set up the cluster, run the job (every schedule, in rounds), tear down; the noise samples
    to raw/foreign_cpu.json. Returns (exit code, the link's qdiscs)."""
    job = new_job(a, out)
    sampler = ForeignCpu()
    rc, qdiscs = 0, None

    def cleanup():
        job.stop()
        NETWORK.teardown()
        sampler.stop()
        if (out / "raw").is_dir():
            sampler.save(out / "raw" / "foreign_cpu.json")

    with cleanup_on_signals(cleanup):
        try:
            qdiscs = NETWORK.setup(None if a.no_shape else a.rate)
            print(f"emulated cluster: {NETWORK.describe(None if a.no_shape else qdiscs)}", flush=True)
            print(f"schedules: {a.schedules}; {a.warmup} warm-up + {a.rounds} rounds x {a.steps} timed steps each, "
                  f"{a.micro_batches} micro-batches; logs in {out}/logs", flush=True)
            sampler.start()
            job.start()
            job.wait(a.timeout)
        except RuntimeError as exc:
            print(f"bench hidden-comm: {exc}", file=sys.stderr)
            rc = 1
    return rc, qdiscs


def main(argv=None):
    a = parse_args(argv)
    out = Path(a.out).resolve()
    if a.analyze_only:
        run = out / "raw" / "run.json"
        rec = json.loads(run.read_text()) if run.exists() else {"config": args_record(a), "wall_s": None}
        _, md = analyse(out, rec["config"], rec["wall_s"], a.quiet_below)
        print(md)
        return 0
    try:
        preflight(a)
    except Refuse as exc:
        print(f"bench hidden-comm: {exc}", file=sys.stderr)
        return 2

    for d in ("raw", "traces", "logs"):
        shutil.rmtree(out / d, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("results.json", "results.md"):
        (out / f).unlink(missing_ok=True)
    start = time.monotonic()
    rc, qdiscs = measure(a, out)
    if rc == 0:
        wall = time.monotonic() - start
        rec = args_record(a)
        rec["qdiscs"] = qdiscs
        (out / "raw" / "run.json").write_text(json.dumps({"config": rec, "wall_s": wall}, indent=1))
        _, md = analyse(out, rec, wall, a.quiet_below)
        print("\n" + md)
        print(f"results: {out}/results.json, {out}/results.md, traces in {out}/traces/")
    fix_owner(out)
    return rc
