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

The one worker script, tools/bench_worker.py, trains a GPT-like PipelineModule (default 8
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

    sudo .venv/bin/python tools/bench_hidden_comm.py --steps 3 --rounds 4
    sudo .venv/bin/python tools/bench_hidden_comm.py --rate 500mbit --out out/bench_500mbit
    .venv/bin/python tools/bench_hidden_comm.py --analyze-only   # re-analyse out/bench_hidden_comm/raw

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
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
WORKER = TOOLS / "bench_worker.py"
# The emulated cluster (namespaces, link, launchers, noise) is tools/cluster.py, shared with bench.py.
from cluster import (ForeignCpu, Network, Refuse, WorkerJob, check_cores, cleanup_on_signals, fix_owner,
                     foreign_cpu_between, parse_rate, preflight as cluster_preflight)

NETWORK = Network(("hds-node0", "hds-node1"), ("veth0", "veth1"), ("10.77.0.1", "10.77.0.2"))
NODES, VETHS, ADDRS = NETWORK.nodes, NETWORK.veths, NETWORK.addrs
DEFAULT_SCHEDULES = "stock,gpipe,hippie,hippie-1f1b,hippie-auto"
KNOWN_LABELS = ("stock", "1f1b", "gpipe", "hippie", "hippie-1f1b", "hippie-auto", "hippie-1f1b-auto")

GROUPS = {
    "compute": {"ForwardPass", "BackwardPass", "ForwardBackwardPass"},
    "p2p": {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ISendActivation", "ISendGrad", "WaitSends"},
    "allreduce": {"ReduceGrads", "ReduceTiedGrads", "StartAllReduce", "WaitAllReduce"},
    "optimizer": {"OptimizerStep", "StageOptimizerStep", "ApplyBufferedUpdate"},
    "buffer_copy": {"CopyGradsToBuffer"},
    "load": {"LoadMicroBatch"},
}
TRACE_CATEGORY = {"ForwardPass": "forward", "BackwardPass": "backward", "ForwardBackwardPass": "forward_backward",
                  "CopyGradsToBuffer": "buffer", "LoadMicroBatch": "load"}
for _g, _cat in (("p2p", "p2p"), ("allreduce", "allreduce"), ("optimizer", "optimizer")):
    TRACE_CATEGORY.update({k: _cat for k in GROUPS[_g]})


def preflight(args):
    cluster_preflight("this benchmark", ("ip", "taskset") + (() if args.no_shape else ("tc",)))
    check_cores(args.cores)
    if not args.no_shape:
        parse_rate(args.rate)


# ---------------------------------------------------------------------------------- job
def worker_args(a, out: Path) -> list[str]:
    """tools/bench_worker.py's command line: every schedule in the same processes, in rounds."""
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


# ---------------------------------------------------------------------------------- analysis
def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def load_raw(out: Path):
    done = json.loads((out / "raw" / "done.json").read_text())
    runs = {}
    for label in done["labels"]:
        ranks = {}
        for f in sorted((out / "raw" / label).glob("rank*.steps.json")):
            steps = json.loads(f.read_text())
            tl = json.loads((out / "raw" / label / "timeline" / f"rank{steps['rank']}.json").read_text())
            ranks[steps["rank"]] = (steps, tl)
        runs[label] = ranks
    return done, runs


def _target(name):
    """'grads' or 'buffer' from an instruction's name: DeepSpeed-style repr
    ``StartAllReduce(target='buffer')`` or the engine's op name ``start_allreduce(buffer)``."""
    m = re.search(r"target='(\w+)'|\((grads|buffer)\)", name)
    return (m.group(1) or m.group(2)) if m else "grads"


def analyse_rank(steps, tl):
    """Per timed step of one rank: duration, time per instruction group, all-reduce spans;
    plus the rank's events on the absolute clock (for traces)."""
    t0 = steps["t0"]
    if t0 is None:
        raise RuntimeError(f"rank {steps['rank']} ({steps['label']}): no timeline origin recorded")
    # The rank's instruction stream only: the engine also writes comm-track events of its own
    # ("AllReduceInFlight", category 'comm'); the spans are recomputed below for every engine alike.
    events = sorted(({**e, "start": e["start"] + t0, "end": e["end"] + t0} for e in tl["events"]
                     if e.get("category") != "comm" and e["kind"] != "AllReduceInFlight"), key=lambda e: e["start"])
    spans, open_ = [], {}
    for e in events:  # all-reduce outstanding: StartAllReduce start -> matching WaitAllReduce end
        if e["kind"] == "StartAllReduce":
            open_[_target(e["name"])] = e
        elif e["kind"] == "WaitAllReduce" and _target(e["name"]) in open_:
            s = open_.pop(_target(e["name"]))
            spans.append({"target": _target(e["name"]), "start": s["start"], "end": e["end"]})
        elif e["kind"] in ("ReduceGrads", "ReduceTiedGrads"):
            spans.append({"target": "grads", "start": e["start"], "end": e["end"]})
    per_step = []
    for st in steps["steps"]:
        mine = [e for e in events if st["start"] <= e["start"] < st["end"]]
        groups = {g: sum(e["end"] - e["start"] for e in mine if e["kind"] in kinds) for g, kinds in GROUPS.items()}
        busy = sum(e["end"] - e["start"] for e in mine)
        last_end = max((e["end"] for e in mine), default=st["start"])
        per_step.append({**st, "duration": st["end"] - st["start"], **groups,
                         "other": st["end"] - st["start"] - busy, "after_schedule": st["end"] - last_end,
                         "allreduce_span": sum(s["end"] - s["start"] for s in spans
                                               if st["start"] <= s["start"] < st["end"]),
                         "events": mine,
                         "spans": [s for s in spans if st["start"] <= s["start"] < st["end"]]})
    return per_step


def analyse(out: Path, args_record: dict | None = None, wall_s: float | None = None, quiet_below: float = 0.1):
    done, runs = load_raw(out)
    noise = out / "raw" / "foreign_cpu.json"
    cpu_samples = json.loads(noise.read_text())["samples"] if noise.exists() else []
    results = {"schedules": {}, "config": args_record or {}, "wall_s": wall_s, "quiet_below_cores": quiet_below,
               "counted_as_exposed_allreduce": sorted(GROUPS["allreduce"]),
               "not_counted": sorted(GROUPS["optimizer"] | GROUPS["buffer_copy"]) + ["loss all-reduce/broadcast "
                                                                                      "after the schedule"]}
    (out / "traces").mkdir(parents=True, exist_ok=True)
    for label, ranks in runs.items():
        per_rank = {r: analyse_rank(s, tl) for r, (s, tl) in ranks.items()}
        meta = {r: s for r, (s, _) in ranks.items()}
        timed = {r: [x for x in ps if not x["warmup"]] for r, ps in per_rank.items()}
        keys = sorted({(x["round"], x["index"]) for x in timed[0]})
        by_key = {r: {(x["round"], x["index"]): x for x in xs} for r, xs in timed.items()}
        per_step_max = [max(by_key[r][k]["duration"] for r in by_key) for k in keys]
        rank0 = [by_key[0][k]["duration"] for k in keys]
        dp = len({m["data_parallel_id"] for m in meta.values()})
        cfg = results["config"]
        samples = cfg.get("micro_batch_size", 0) * cfg.get("micro_batches", 0) * dp
        stages = {}
        for r, xs in timed.items():
            st = stages.setdefault(meta[r]["stage"], {"ranks": [], "params": meta[r]["params"], "_xs": []})
            st["ranks"].append(r)
            st["_xs"].extend(xs)
        for s, st in stages.items():
            xs = st.pop("_xs")
            for g in list(GROUPS) + ["other", "after_schedule", "allreduce_span"]:
                st[f"{g}_s"] = _mean([x[g] for x in xs])
            st["exposed_allreduce_s"] = st.pop("allreduce_s")
            st["exposed_allreduce_median_s"] = statistics.median([x["allreduce"] for x in xs]) if xs else 0.0
            st["exposed_allreduce_per_rank_s"] = {r: _mean([x["allreduce"] for x in timed[r]]) for r in st["ranks"]}
        med = statistics.median(per_step_max) if per_step_max else float("nan")
        spans = [(min(by_key[r][k]["start"] for r in by_key), max(by_key[r][k]["end"] for r in by_key)) for k in keys]
        foreign = [foreign_cpu_between(cpu_samples, a, b) / (b - a) for a, b in spans] if cpu_samples else []
        results["schedules"][label] = {
            "schedule": meta[0]["schedule"], "params": meta[0]["schedule_params"],
            "timed_steps": len(keys), "step_time_max_over_ranks_s": per_step_max, "step_time_rank0_s": rank0,
            "median_step_s": med, "median_step_rank0_s": statistics.median(rank0) if rank0 else float("nan"),
            "mean_step_s": _mean(per_step_max), "min_step_s": min(per_step_max, default=float("nan")),
            "max_step_s": max(per_step_max, default=float("nan")),
            "samples_per_step": samples, "throughput_samples_s": samples / med if med else None,
            "loss_first_timed": by_key[0][keys[0]]["loss"] if keys else None,
            "loss_last_timed": by_key[0][keys[-1]]["loss"] if keys else None,
            "per_stage": {str(s): st for s, st in sorted(stages.items())},
            # Cores' worth of CPU used by other processes during each timed step (0 = quiet machine).
            "foreign_cpu_cores_per_step": foreign,
            "foreign_cpu_cores_mean": _mean(foreign) if foreign else None,
        }
        quiet = [d for d, f in zip(per_step_max, foreign) if f < quiet_below]
        results["schedules"][label].update({
            "quiet_steps": len(quiet), "median_step_quiet_s": statistics.median(quiet) if quiet else None})
        write_traces(out, label, meta, timed, keys)
    stock = results["schedules"].get("stock")
    for r in results["schedules"].values():
        r["ratio_to_stock_1f1b"] = r["median_step_s"] / stock["median_step_s"] if stock else None
        r["ratio_rank0_to_stock_1f1b"] = r["median_step_rank0_s"] / stock["median_step_rank0_s"] if stock else None
        r["ratio_quiet_to_stock_1f1b"] = (r["median_step_quiet_s"] / stock["median_step_quiet_s"]
                                          if stock and r["median_step_quiet_s"] and stock["median_step_quiet_s"]
                                          else None)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "results.md").write_text(md)
    return results, md


def _trace_events(meta, steps):
    evs = []
    for r, xs in steps.items():
        for x in xs:
            for e in x["events"]:
                evs.append({"rank": r, "stage": meta[r]["stage"], "name": e["name"],
                            "category": TRACE_CATEGORY.get(e["kind"], "other"), "start": e["start"], "end": e["end"]})
            for s in x["spans"]:
                evs.append({"rank": r, "stage": meta[r]["stage"], "name": f"allreduce {s['target']} (outstanding)",
                            "category": "comm", "start": s["start"], "end": s["end"]})
            last = max((e["end"] for e in x["events"]), default=x["start"])
            evs.append({"rank": r, "stage": meta[r]["stage"], "name": "after schedule (loss all-reduce + broadcast)",
                        "category": "sync", "start": last, "end": x["end"]})
    return evs


def write_traces(out: Path, label, meta, timed, keys):
    from hippie_ds.schedules.trace import chrome_trace, timeline_png
    names = {r: f"rank {r}: node {r // 2}, stage {meta[r]['stage']}, replica {meta[r]['data_parallel_id']}"
             for r in meta}
    evs = _trace_events(meta, timed)
    if not evs:
        return
    origin = min(e["start"] for e in evs)
    for e in evs:
        e["start"] -= origin
        e["end"] -= origin
    chrome_trace(evs, out / "traces" / f"{label}.json", process_names=names)
    last = set(keys[-2:])
    tail = {r: [x for x in xs if (x["round"], x["index"]) in last] for r, xs in timed.items()}
    evs = _trace_events(meta, tail)
    origin = min(e["start"] for e in evs)
    for e in evs:
        e["start"] -= origin
        e["end"] -= origin
    try:
        timeline_png(evs, out / "traces" / f"{label}.png", title=f"{label}: last two timed steps (s)")
    except ImportError:  # matplotlib missing: the Chrome trace is enough
        pass


def markdown(results):
    sch = results["schedules"]
    stage_ids = sorted({s for r in sch.values() for s in r["per_stage"]}, key=int)
    cfg = results["config"]
    lines = []
    first = next(iter(sch.values()), None)
    params = ", ".join(f"stage {s}: {st['params'] / 1e6:.2f}M" for s, st in first["per_stage"].items()) if first else "?"
    if cfg:
        lines += [f"Emulated 2 nodes x 2 ranks, link {cfg.get('link')}, {cfg.get('micro_batches')} micro-batches of "
                  f"{cfg.get('micro_batch_size')} x {cfg.get('seq')} tokens, parameters {params} "
                  f"per stage (fp32 AdamW), {cfg.get('warmup')} warm-up + {cfg.get('rounds')} rounds x "
                  f"{cfg.get('steps')} timed steps per schedule.", ""]
    head = ["schedule", "deferred", "median step (s)", "rank 0 median (s)", "vs stock 1F1B", "samples/s"]
    head += [f"exposed all-reduce stage {s} (s/step)" for s in stage_ids] + ["foreign CPU (cores)",
                                                                             "quiet steps: median (s) [n]",
                                                                             "quiet: vs stock"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in sch.items():
        deferred = r["params"].get("deferred_stages", "-") if r["params"] else "-"
        ratio = f"{r['ratio_to_stock_1f1b']:.3f}x" if r.get("ratio_to_stock_1f1b") is not None else "-"
        row = [label if label != "stock" else "stock DeepSpeed 1F1B", str(deferred), f"{r['median_step_s']:.3f}",
               f"{r['median_step_rank0_s']:.3f}", ratio, f"{r['throughput_samples_s']:.2f}"]
        row += [f"{r['per_stage'][s]['exposed_allreduce_s']:.3f}" if s in r["per_stage"] else "-" for s in stage_ids]
        fc = r.get("foreign_cpu_cores_mean")
        row.append("-" if fc is None else f"{fc:.2f}")
        mq, rq = r.get("median_step_quiet_s"), r.get("ratio_quiet_to_stock_1f1b")
        row.append("-" if mq is None else f"{mq:.3f} [{r['quiet_steps']}/{r['timed_steps']}]")
        row.append("-" if rq is None else f"{rq:.3f}x")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Per stage, seconds per step (mean over timed steps and the stage's replicas):", ""]
    head = ["schedule", "stage", "compute", "p2p", "exposed all-reduce", "all-reduce outstanding", "optimizer",
            "buffer copy", "after schedule", "step (mean)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in sch.items():
        for s in stage_ids:
            st = r["per_stage"].get(s)
            if st is None:
                continue
            lines.append("| " + " | ".join([label, s] + [f"{st[k]:.3f}" for k in (
                "compute_s", "p2p_s", "exposed_allreduce_s", "allreduce_span_s", "optimizer_s", "buffer_copy_s",
                "after_schedule_s")] + [f"{r['mean_step_s']:.3f}"]) + " |")
    lines += ["", "median step = median over timed steps of the slowest rank's train_batch time; exposed all-reduce = "
              "time in ReduceGrads/StartAllReduce/WaitAllReduce; all-reduce outstanding = StartAllReduce start to "
              "WaitAllReduce end (ReduceGrads: its duration); after schedule = train_batch's loss all-reduce and "
              "pipeline broadcast after the last instruction (waiting for the last stage); foreign CPU = cores' "
              "worth of CPU used by processes outside the benchmark during the schedule's timed steps (mean; "
              f"anything above ~0.05 slows the 4 ranks on 2 cores and makes the comparison noisy); quiet steps = "
              f"timed steps with foreign CPU below {results.get('quiet_below_cores', 0.1)} cores."]
    noisy = {l: r["foreign_cpu_cores_mean"] for l, r in sch.items() if (r.get("foreign_cpu_cores_mean") or 0) > 0.05}
    if noisy:
        lines.append("WARNING: other processes competed for the CPU during " + ", ".join(
            f"{l} ({v:.2f} cores)" for l, v in noisy.items()) + "; rerun on a quiet machine.")
    if results.get("wall_s") is not None:
        lines.append(f"Wall time of the benchmark: {results['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Emulated two-node benchmark of stock DeepSpeed 1F1B vs hippie-ds schedules: step time and "
                    "exposed data-parallel all-reduce. Needs root (network namespaces).",
        epilog="example: sudo .venv/bin/python tools/bench_hidden_comm.py --steps 3 --rounds 4",
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
    block = 12 * a.d_model ** 2 + 13 * a.d_model
    total = (a.vocab + a.seq) * a.d_model + a.layers * block + 2 * a.d_model + a.d_model * a.vocab
    return {"micro_batches": a.micro_batches, "micro_batch_size": a.micro_batch_size, "seq": a.seq,
            "d_model": a.d_model, "layers": a.layers, "vocab": a.vocab, "warmup": a.warmup, "steps": a.steps,
            "rounds": a.rounds, "link": "unshaped veth" if a.no_shape else f"tbf {a.rate}",
            "params_per_stage": f"~{total / 2 / 1e6:.2f}M", "cores": a.cores, "command": " ".join(sys.argv)}


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
        print(f"bench_hidden_comm: {exc}", file=sys.stderr)
        return 2

    for d in ("raw", "traces", "logs"):
        shutil.rmtree(out / d, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("results.json", "results.md"):
        (out / f).unlink(missing_ok=True)
    start = time.monotonic()
    job = new_job(a, out)
    sampler = ForeignCpu()
    rc = 0

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
            print(f"bench_hidden_comm: {exc}", file=sys.stderr)
            rc = 1
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


if __name__ == "__main__":
    sys.exit(main())
