#!/usr/bin/env python3
"""The benchmark report: schedules side by side on an emulated two-node cluster, plus a projection.

One command (``make bench``, as root) that

1. sets up the emulated two-node cluster of the brief (section 4): two network namespaces
   (``hdsb-node0``, ``hdsb-node1``) joined by a veth pair (10.78.0.1 <-> 10.78.0.2), both ends
   shaped with ``tc tbf rate 1gbit``; 2 ranks per node, node 0's pinned to core 0 and node 1's to
   core 1 (``taskset``); a 2-stage pipeline inside each node, data parallelism across the link;
2. trains the same GPT-like model (tools/bench_worker.py) with every schedule asked for
   (``--schedules``, default ``dp,gpipe,1f1b,hippie,hippie-1f1b``), each in its own processes
   (so that each rank's peak resident memory is its own):

   * ``dp``: plain DeepSpeed data parallelism (no pipeline) over all 4 ranks, same global batch;
   * ``1f1b``: stock DeepSpeed (``deepspeed.initialize``, its ``TrainSchedule``);
   * ``gpipe``, ``hippie``, ``hippie-1f1b`` and any other schedule name (``2bw``, ``pipedream``,
     ...): ``hippie_ds.initialize`` with ``configs/NAME.json``'s ``pipeline.schedule`` and
     ``hippie`` section; ``deferred_stages: auto`` is resolved from a cost file measured on the
     stock 1F1B run (so ``1f1b`` runs first); ``hds-1f1b`` is hippie-ds's own compiled 1F1B;
   * ``--plan NAME=PLAN`` gives a schedule a planner layout (stage boundaries, re-computed
     layers) through ``hippie_ds.PipelineModule(plan=...)``;

   The two-node runs come in ``--rounds`` rounds (default 3): each round runs every schedule once
   (a fresh job each), the order rotated from round to round (round r starts at the r-th
   schedule, 1F1B being the first of round 0), so drift of the machine lands on every schedule
   alike rather than inside the ratios. Figures are medians over rounds; ratios to stock 1F1B
   and DP are taken per round (runs of the same round) and reported as median (min-max); a
   difference counts as real only when it holds in every round (``summarize``);
3. runs the same schedules on node 0 alone (its 2 ranks, same per-replica batch) for the scaling
   efficiency from one node to two, and the whole model on one rank (core 0) for the
   single-device throughput;
4. predicts every run's step time with hippie-ds's simulator from the run's own measured
   per-stage forward/backward/optimizer times, parameter bytes and the link bandwidth;
5. projects scaling efficiency to 16, 64 and 1,024 V100s with the planner's cost model and
   simulator on the PipeDream V100 profiles (VGG-16, GNMT-8, GNMT-16).

Outputs (``--out``, default out/bench): ``results.json``, ``report.md``, ``*.png`` plots,
``runs/<config>/<schedule>/`` (per-rank step records, timelines, launcher logs, Gantt charts of
the last two steps in ``traces/``); with ``--rounds`` > 1 each two-node run in its own
``runs/two_nodes/<schedule>/round<R>/`` (``--analyze-only`` reads either layout).
``--publish DIR`` copies report.md, results.json and the
plots to DIR (``make bench`` publishes to docs/bench/, the committed copy).

Figures (definitions, also in the report):

* step time: wall time of one ``train_batch`` per rank; per step the slowest rank's; the median
  over the timed steps (after ``--warmup`` untimed ones); with rounds, the median over rounds of
  each round's median. Throughput = samples a step / median.
* memory per rank: peak bytes saved for backward (``saved_tensors_hooks``, storages counted
  once from first pack until autograd releases them, parameters excluded) and peak resident
  memory (VmHWM); "training RSS" = VmHWM minus the process's VmRSS after imports and
  ``init_distributed``, before the model is built (the interpreter, torch and DeepSpeed's own
  ~0.3 GB are the same for every schedule and are not what the schedules differ in).
* a device is an emulated node's core: scalability = throughput / (cores x single-device
  throughput); ME = scalability x throughput / memory, memory = mean over ranks of the peak
  training RSS; reported as a ratio to DP (the ratio does not depend on what a device is).
* scaling efficiency one node -> two = throughput on 2 nodes / (2 x throughput on 1 node).

Usage::

    sudo .venv/bin/python tools/bench.py                     # everything, defaults (3 rounds, ~20 min)
    sudo .venv/bin/python tools/bench.py --rounds 1          # one run per schedule, as before rounds
    sudo .venv/bin/python tools/bench.py --schedules 1f1b,hippie --steps 4 --no-scaling
    .venv/bin/python tools/bench.py --projection-only        # no root needed
    .venv/bin/python tools/bench.py --analyze-only           # re-analyse OUT/runs of an earlier run

Needs root and ``ip netns`` for the measured part (refuses with exit code 2 otherwise). The
namespaces are always removed: at exit, on SIGINT/SIGTERM/SIGHUP, and leftovers at start.
"""
from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
WORKER = TOOLS / "bench_worker.py"
DEFAULT_SCHEDULES = "dp,gpipe,1f1b,hippie,hippie-1f1b"
# Which engine a schedule name runs on (anything else: hippie_ds.initialize with that schedule).
WORKER_LABEL = {"1f1b": "stock", "hds-1f1b": "1f1b", "dp": "dp"}
DISPLAY = {"dp": "DP", "1f1b": "1F1B (stock DeepSpeed)", "gpipe": "GPipe+DP", "hippie": "hippie",
           "hippie-1f1b": "hippie-1f1b", "hds-1f1b": "1F1B (hippie-ds)"}
CONFIGS = ("two_nodes", "one_node", "one_device")
PROJECTION_MODELS = (("vgg16", "VGG-16"), ("gnmt", "GNMT-8"), ("gnmt_large", "GNMT-16"))
PROJECTION_SCHEDULES = ("dp", "gpipe", "1f1b", "hippie", "hippie-1f1b")
GB = 1e9


# The emulated cluster (namespaces, link, launchers, noise): tools/cluster.py.
from cluster import (ForeignCpu, Network, Refuse, WorkerJob, check_cores, cleanup_on_signals, fix_owner,  # noqa: E402
                     foreign_cpu_between, parse_rate, preflight as cluster_preflight)

# Our own names (not bench_hidden_comm's), so both benchmarks can be set up side by side.
NETWORK = Network(("hdsb-node0", "hdsb-node1"), ("hdsb-veth0", "hdsb-veth1"), ("10.78.0.1", "10.78.0.2"))
NODES, VETHS, ADDRS = NETWORK.nodes, NETWORK.veths, NETWORK.addrs


def preflight(args):
    """Raise Refuse unless the measured part can run here: the tools, root, ``ip netns``."""
    cluster_preflight("this benchmark", ("ip", "taskset") + (() if args.no_shape else ("tc",)),
                      hint="`--projection-only` runs the projection alone, without root.")
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


def schedule_order(schedules: list[str]) -> list[str]:
    """The schedules in run order: stock 1F1B first (it measures the cost file for 'auto')."""
    return [s for s in schedules if s == "1f1b"] + [s for s in schedules if s != "1f1b"]


def round_orders(schedules: list[str], rounds: int) -> list[list[str]]:
    """The order of the two-node runs in each round: every schedule once per round, the order
    rotated each round (round r starts at schedule r mod S of ``schedule_order``), so a drift
    of the machine lands on every schedule alike instead of on whichever runs last. Pure."""
    ordered = schedule_order(schedules)
    n = len(ordered)
    return [ordered[r % n:] + ordered[:r % n] for r in range(rounds)] if n else []


def run_dir_name(config: str, schedule: str, rnd: int | None = None) -> str:
    """A run's directory under OUT/runs: ``CONFIG/SCHEDULE`` (a single run, as with --rounds 1)
    or ``two_nodes/SCHEDULE/round<R>`` (each round's run kept apart: logs, raw/, traces)."""
    return f"{config}/{schedule}" + ("" if rnd is None else f"/round{rnd}")


def run_plan(args) -> list[dict]:
    """The jobs to run, in order: (config, schedule, nodes, ranks per node, worker label, round,
    run directory). The two-node runs come in ``--rounds`` rounds (``round_orders``); the
    one-node and one-device runs once each, after them."""
    rounds = getattr(args, "rounds", 1)
    ordered = schedule_order(args.schedule_list)
    jobs = [{"config": "two_nodes", "schedule": s, "nodes": 2, "rpn": args.stages, "round": r,
             "dir": run_dir_name("two_nodes", s, r if rounds > 1 else None)}
            for r, order in enumerate(round_orders(args.schedule_list, rounds)) for s in order]
    if not args.no_scaling:
        jobs += [{"config": "one_node", "schedule": s, "nodes": 1, "rpn": args.stages} for s in ordered]
    if not args.no_single:
        jobs.append({"config": "one_device", "schedule": "dp", "nodes": 1, "rpn": 1})
    for j in jobs:
        j["label"] = WORKER_LABEL.get(j["schedule"], j["schedule"])
        j.setdefault("round", 0)
        j.setdefault("dir", run_dir_name(j["config"], j["schedule"]))
    return jobs


def samples_per_replica(a) -> int:
    return a.micro_batch_size * a.micro_batches


def worker_args(a, job: dict, out: Path, costs: Path | None) -> list[str]:
    world = job["nodes"] * job["rpn"]
    replicas = world // a.stages if job["config"] != "one_device" else 1
    if job["schedule"] == "dp":
        # Same global batch as the pipelines on the same machine (per rank: replica batch / stages).
        global_batch = samples_per_replica(a) if job["config"] == "one_device" else samples_per_replica(a) * replicas
    else:
        global_batch = 0
    args = ["--out", str(out), "--schedules", job["label"], "--stages", str(a.stages),
            "--micro-batches", str(a.micro_batches), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch", str(global_batch), "--seq", str(a.seq), "--d-model", str(a.d_model),
            "--heads", str(a.heads), "--layers", str(a.layers), "--vocab", str(a.vocab),
            "--warmup", str(a.warmup), "--steps", str(a.steps), "--rounds", "1", "--timeout-s", str(a.timeout),
            "--memory", "--schedule-configs", str(REPO / "configs"), "--partition-method", a.partition_method]
    if costs is not None:
        args += ["--costs", str(costs)]
    plan = a.plans.get(job["schedule"])
    if plan and job["config"] == "two_nodes":  # a plan is made for one world size: the two-node job's
        args += ["--plan", f"{job['label']}={plan}"]
    return args


# ---------------------------------------------------------------------------------- analysis
def _median(xs):
    return statistics.median(xs) if xs else None


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def load_run(run_dir: Path, label: str):
    """{rank: (steps record, timeline)} of one job."""
    ranks = {}
    for f in sorted((run_dir / "raw" / label).glob("rank*.steps.json")):
        steps = json.loads(f.read_text())
        tl_path = run_dir / "raw" / label / "timeline" / f"rank{steps['rank']}.json"
        tl = json.loads(tl_path.read_text()) if tl_path.exists() else {"events": []}
        ranks[steps["rank"]] = (steps, tl)
    return ranks


def stage_timings(ranks: dict) -> dict:
    """Per stage: median durations (s) of its instructions over its ranks' timed steps."""
    out = {}
    for r, (steps, tl) in ranks.items():
        timed = [(s["start"], s["end"]) for s in steps["steps"] if not s["warmup"]]
        t0 = steps.get("t0") or 0.0
        st = out.setdefault(steps["stage"], {"ranks": [], "params": steps["params"], "_d": {}})
        st["ranks"].append(r)
        for e in tl.get("events", []):
            start = e["start"] + t0
            if e.get("category") == "comm" or not any(a <= start < b for a, b in timed):
                continue
            st["_d"].setdefault(e["kind"], []).append(e["end"] - e["start"])
    for st in out.values():
        d = st.pop("_d")
        st["median"] = {k: statistics.median(v) for k, v in d.items()}
        st["count"] = {k: len(v) for k, v in d.items()}
    return out


def measured_costs(timings: dict, a, data_parallel: int, allreduce_bandwidth: float, p2p_bandwidth: float,
                   p2p_latency: float) -> dict:
    """A hippie-ds cost dict from measured stage timings (``Costs.from_dict`` format)."""
    fb = []
    for st in timings.values():
        f, b = st["median"].get("ForwardPass"), st["median"].get("BackwardPass")
        if f and b:
            fb.append(f / (f + b))
    ratio = _mean(fb) or 1 / 3
    stages = []
    for s in sorted(timings):
        m = timings[s]["median"]
        f, b = m.get("ForwardPass"), m.get("BackwardPass")
        if (f is None or b is None) and "ForwardBackwardPass" in m:  # fused last stage: split by the ratio
            f, b = ratio * m["ForwardBackwardPass"], (1 - ratio) * m["ForwardBackwardPass"]
        opt = sum(m.get(k, 0.0) for k in ("OptimizerStep", "StageOptimizerStep", "ApplyBufferedUpdate"))
        stages.append({"forward": f or 0.0, "backward": b or 0.0, "optimizer_time": opt,
                       "param_bytes": 4.0 * timings[s]["params"],
                       "activation_bytes": 4.0 * a.micro_batch_size * a.seq * a.d_model,
                       "saved_bytes": 0.0})
    return {"stages": stages, "comm": {"allreduce_bandwidth": allreduce_bandwidth, "data_parallel": data_parallel,
                                       "p2p_bandwidth": p2p_bandwidth, "p2p_latency": p2p_latency,
                                       "shared_link": True}}


def predict(schedule: str, params: dict, stages: int, micro_batches: int, costs: dict,
            delayed_fraction: dict | None = None) -> dict:
    """Simulated step time of a schedule under measured costs (hippie-ds simulator);
    ``delayed_fraction``: {stage: share of its gradient applied one step late} (partial deferral)."""
    from hippie_ds.schedules import compile as compile_schedule
    from hippie_ds.schedules.costs import Costs
    from hippie_ds.schedules.simulator import simulate
    try:
        compiled = compile_schedule(schedule, stages, micro_batches, validate=False, **(params or {}))
        res = simulate(compiled, Costs.from_dict(costs), iterations=3, critical_path=False,
                       delayed_fraction=delayed_fraction)
        return {"step_time": res.step_time, "bubble_fraction": res.bubble_fraction}
    except Exception as exc:  # a schedule the simulator does not know (yet): no prediction
        return {"step_time": None, "error": f"{type(exc).__name__}: {exc}"}


def analyse_job(run_dir: Path, job: dict, a, link_bw: float) -> dict | None:
    ranks = load_run(run_dir, job["label"])
    if not ranks:
        return None
    meta = next(iter(ranks.values()))[0]
    keys = sorted({(s["round"], s["index"]) for s in meta["steps"] if not s["warmup"]})
    by_rank = {r: {(s["round"], s["index"]): s for s in st["steps"] if not s["warmup"]} for r, (st, _) in ranks.items()}
    per_step = [max(by_rank[r][k]["end"] - by_rank[r][k]["start"] for r in by_rank if k in by_rank[r]) for k in keys]
    median = _median(per_step)
    world = meta["world"]
    if job["schedule"] == "dp":
        samples = meta["micro_batch_size"] * meta["micro_batches"] * world
    else:
        samples = meta["micro_batch_size"] * meta["micro_batches"] * (world // meta["stages"])
    mem = {}
    for r, (st, _) in sorted(ranks.items()):
        m = st.get("memory") or {}
        saved = max((s.get("saved_peak_bytes", 0) for s in st["steps"]), default=0)
        base, hwm = m.get("rss_baseline_bytes"), m.get("peak_rss_bytes")
        mem[r] = {"stage": st["stage"], "peak_saved_bytes": saved, "peak_rss_bytes": hwm,
                  "rss_baseline_bytes": base, "peak_training_rss_bytes": (hwm - base) if hwm and base else None,
                  "state_bytes": m.get("state_bytes")}
    timings = stage_timings(ranks)
    # Prediction: the run's own measured per-stage times + parameter bytes + the link.
    dp_width = world if job["schedule"] == "dp" else world // meta["stages"]
    if job["config"] == "two_nodes":
        ar_bw = link_bw * a.link_efficiency
    else:
        ar_bw = a.intra_allreduce_bandwidth
    costs = measured_costs(timings, a, dp_width, ar_bw, a.p2p_bandwidth, a.p2p_latency)
    sched_name = {"dp": "1f1b", "1f1b": "1f1b"}.get(job["schedule"], meta["schedule"])
    if job["schedule"] == "dp":
        stages, params = 1, {}
    else:
        stages, params = meta["stages"], meta.get("schedule_params") or {}
    fractions = {st["stage"]: st["delayed_fraction"] for st, _ in ranks.values()
                 if st.get("delayed_fraction") is not None}
    pred = predict(sched_name, params, stages, meta["micro_batches"], costs, fractions)
    err = (pred["step_time"] - median) / median if pred.get("step_time") and median else None
    exposed = {}
    for s, st in timings.items():
        exp = sum(st["median"].get(k, 0.0) * st["count"].get(k, 0) for k in
                  ("ReduceGrads", "ReduceTiedGrads", "StartAllReduce", "WaitAllReduce"))
        exposed[str(s)] = exp / max(1, len(keys) * len(st["ranks"]))
    return {
        "config": job["config"], "schedule": job["schedule"], "engine_schedule": meta["schedule"],
        "schedule_params": meta.get("schedule_params") or {}, "world": world, "stages": meta["stages"],
        "micro_batches": meta["micro_batches"], "micro_batch_size": meta["micro_batch_size"],
        "parts": meta.get("parts"), "timed_steps": len(keys), "step_times_s": per_step, "median_step_s": median,
        "samples_per_step": samples, "throughput_samples_s": samples / median if median else None,
        "loss_last": by_rank[0][keys[-1]]["loss"] if keys and 0 in by_rank else None,
        "memory_per_rank": {str(r): v for r, v in mem.items()},
        "mean_peak_saved_bytes": _mean([v["peak_saved_bytes"] for v in mem.values()]),
        "max_peak_saved_bytes": max((v["peak_saved_bytes"] for v in mem.values()), default=None),
        "mean_peak_rss_bytes": _mean([v["peak_rss_bytes"] for v in mem.values() if v["peak_rss_bytes"]]),
        "mean_peak_training_rss_bytes": _mean([v["peak_training_rss_bytes"] for v in mem.values()
                                               if v["peak_training_rss_bytes"]]),
        "max_peak_training_rss_bytes": max((v["peak_training_rss_bytes"] or 0 for v in mem.values()), default=None),
        "mean_state_bytes": _mean([v["state_bytes"] for v in mem.values() if v["state_bytes"]]),
        "stage_timings_s": {str(s): st["median"] for s, st in timings.items()},
        "exposed_allreduce_s_per_step": exposed,
        "prediction": {**pred, "costs": costs, "error": err},
    }


def round_dirs(base: Path) -> list[tuple[int, Path]]:
    """[(round, directory)] of one schedule's runs in one config: ``base/round<R>/`` when the runs
    came in rounds (--rounds > 1), else ``[(0, base)]`` (a single run, today's layout)."""
    rounds = sorted((int(d.name[5:]), d) for d in base.glob("round*") if d.is_dir() and d.name[5:].isdigit())
    return rounds or [(0, base)]


def combine_rounds(per_round: list[dict | None]) -> dict | None:
    """One schedule's record from its runs' records (``analyse_job``), one per round (None: the
    round's run left no data). Pure.

    * ``median_step_s``: the median over rounds of each round's median step (with one round:
      that round's median, as before rounds existed); ``throughput_samples_s`` from it;
    * ``round_median_step_s`` / ``round_throughput_samples_s``: per round (None where missing);
      ``median_step_s_min``/``_max`` and ``throughput_samples_s_min``/``_max``: over rounds;
    * ``step_times_s``/``timed_steps``: every round's timed steps, in round order;
    * the other figures (memory, stage timings, prediction, loss) are those of ``detail_round``,
      the round whose median is the lower median over rounds; the prediction error is
      recomputed against the median over rounds."""
    valid = [(i, r) for i, r in enumerate(per_round) if r and r.get("median_step_s")]
    if not valid:
        return next((r for r in per_round if r), None)
    meds = [r["median_step_s"] for _, r in valid]
    median = statistics.median(meds)
    detail_i, detail = next((i, r) for i, r in valid if r["median_step_s"] == statistics.median_low(meds))
    samples = detail["samples_per_step"]
    out = dict(detail)
    pred = dict(detail.get("prediction") or {})
    if pred.get("step_time"):
        pred["error"] = (pred["step_time"] - median) / median
    thr = [samples / m for m in meds]
    out.update({
        "median_step_s": median, "throughput_samples_s": samples / median,
        "rounds": len(per_round), "detail_round": detail_i,
        "round_median_step_s": [r.get("median_step_s") if r else None for r in per_round],
        "round_throughput_samples_s": [r.get("throughput_samples_s") if r else None for r in per_round],
        "median_step_s_min": min(meds), "median_step_s_max": max(meds),
        "throughput_samples_s_min": min(thr), "throughput_samples_s_max": max(thr),
        "step_times_s": [t for _, r in valid for t in r["step_times_s"]],
        "timed_steps": sum(r["timed_steps"] for _, r in valid),
        "prediction": pred,
    })
    return out


def round_ratios(num: list | None, den: list | None) -> dict:
    """Per-round ratios num[r] / den[r] (same round; rounds where either is missing are skipped)
    with their median, min and max. Pure."""
    per = [a / b if a and b else None for a, b in zip(num or [], den or [])]
    vals = [x for x in per if x is not None]
    return {"rounds": per, "median": _median(vals), "min": min(vals, default=None), "max": max(vals, default=None),
            "n": len(vals)}


def spread_excludes(lo, hi, value: float = 1.0) -> bool | None:
    """Whether the min-max spread [lo, hi] leaves ``value`` out; None without a spread. Pure."""
    if lo is None or hi is None:
        return None
    return not (lo <= value <= hi)


def ranges_overlap(a: tuple, b: tuple) -> bool | None:
    """Whether the ranges [a0, a1] and [b0, b1] overlap; None when either is missing. Pure."""
    if None in (*a, *b):
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def summarize(runs: dict, devices: dict | None = None) -> dict:
    """Ratios and efficiencies from the per-run figures. ``runs[config][schedule]`` holds at least
    throughput_samples_s and mean_peak_training_rss_bytes (and mean_peak_saved_bytes). Pure.

    * ratio_to_1f1b / ratio_to_dp: throughput ratios on two nodes;
    * scalability = throughput / (devices x single-device throughput), devices = cores in use
      (two_nodes: 2, one_node: 1);
    * me = scalability x throughput / memory (memory: mean per-rank peak training RSS, GB);
      me_vs_dp = me / DP's me (and me_saved_vs_dp with the peak bytes saved for backward +
      the rank's parameter/gradient/optimizer state instead);
    * scaling_efficiency = throughput(two_nodes) / (2 x throughput(one_node)).

    With rounds (``round_throughput_samples_s`` in the two-node records, ``combine_rounds``) the
    ratios are taken per round, between runs of the same round: ``ratio_to_1f1b`` is the median of
    ``ratio_to_1f1b_rounds`` and ``ratio_to_1f1b_min``/``_max`` their spread (same for dp).
    ``real_vs_1f1b``: the spread leaves 1.0 out; ``real_vs_dp``: the schedule's throughput range
    over rounds and DP's do not overlap; both None with fewer than two rounds (one run shows no
    spread to judge by). Without per-round figures the ratios are those of the throughputs."""
    devices = devices or {"two_nodes": 2, "one_node": 1}
    two, one = runs.get("two_nodes", {}), runs.get("one_node", {})
    single = (runs.get("one_device") or {}).get("dp") or {}
    thr1 = single.get("throughput_samples_s")
    out = {"single_device_throughput": thr1, "devices": devices, "schedules": {}}

    def me_of(r, memkey, config):
        thr = r.get("throughput_samples_s")
        mem = r.get(memkey)
        if not thr or not mem or not thr1:
            return None, None
        scal = thr / (devices[config] * thr1)
        return scal, scal * thr / (mem / GB)

    base_1f1b = (two.get("1f1b") or {}).get("throughput_samples_s")
    base_dp = (two.get("dp") or {}).get("throughput_samples_s")
    dp_me = me_of(two.get("dp") or {}, "mean_peak_training_rss_bytes", "two_nodes")[1]
    dp_tensor = two.get("dp") or {}
    dp_me_t = _me_tensor(dp_tensor, thr1, devices["two_nodes"])
    def per_round(r, base_run, base_thr):
        thr = r.get("throughput_samples_s")
        rr = round_ratios(r.get("round_throughput_samples_s"), (base_run or {}).get("round_throughput_samples_s"))
        if rr["n"] == 0:  # no per-round figures (or none shared): the throughputs' ratio
            x = thr / base_thr if thr and base_thr else None
            rr = {"rounds": [x] if x is not None else [], "median": x, "min": x, "max": x, "n": 1 if x else 0}
        return rr

    dp_range = (dp_tensor.get("throughput_samples_s_min"), dp_tensor.get("throughput_samples_s_max"))
    for name, r in two.items():
        thr = r.get("throughput_samples_s")
        scal, me = me_of(r, "mean_peak_training_rss_bytes", "two_nodes")
        me_t = _me_tensor(r, thr1, devices["two_nodes"])
        one_thr = (one.get(name) or {}).get("throughput_samples_s")
        v1, vd = per_round(r, two.get("1f1b"), base_1f1b), per_round(r, two.get("dp"), base_dp)
        own_range = (r.get("throughput_samples_s_min"), r.get("throughput_samples_s_max"))
        several = (r.get("rounds") or 1) > 1
        overlap = ranges_overlap(own_range, dp_range) if several and (dp_tensor.get("rounds") or 1) > 1 else None
        out["schedules"][name] = {
            "throughput_samples_s": thr,
            "ratio_to_1f1b": v1["median"], "ratio_to_1f1b_rounds": v1["rounds"],
            "ratio_to_1f1b_min": v1["min"], "ratio_to_1f1b_max": v1["max"],
            "real_vs_1f1b": spread_excludes(v1["min"], v1["max"]) if v1["n"] > 1 and name != "1f1b" else None,
            "ratio_to_dp": vd["median"], "ratio_to_dp_rounds": vd["rounds"],
            "ratio_to_dp_min": vd["min"], "ratio_to_dp_max": vd["max"],
            "real_vs_dp": (not overlap) if overlap is not None and name != "dp" else None,
            "scalability": scal, "me": me, "me_vs_dp": me / dp_me if me and dp_me else None,
            "me_tensors_vs_dp": me_t / dp_me_t if me_t and dp_me_t else None,
            "one_node_throughput_samples_s": one_thr,
            "scaling_efficiency": thr / (2 * one_thr) if thr and one_thr else None,
        }
    return out


def _me_tensor(r, thr1, devices):
    """ME with memory = parameters/gradients/optimizer state + peak bytes saved for backward."""
    thr, state, saved = r.get("throughput_samples_s"), r.get("mean_state_bytes"), r.get("mean_peak_saved_bytes")
    if not thr or not thr1 or state is None or saved is None or state + saved <= 0:
        return None
    scal = thr / (devices * thr1)
    return scal * thr / ((state + saved) / GB)


# ---------------------------------------------------------------------------------- projection
def projection(models=PROJECTION_MODELS, sizes=(16, 64, 1024), devices_per_node=4, schedules=PROJECTION_SCHEDULES,
               depth=None, objective="throughput", batch_per_device=0, profile_dir=None, cluster_tail="16GB,100Gbit",
               progress=None) -> dict:
    """Scaling efficiency (planner's scalability: throughput / (P x single-device throughput)) per
    model, cluster size and schedule, from the planner's cost model refined by the simulator.
    Pipeline schedules: depth ``depth`` (default: a pipeline per node, ``devices_per_node``
    stages; 0: the planner's choice), the planner choosing micro-batches, partition and
    re-computation for ``objective``; dp: the planner's data-parallel baseline (all-reduce
    overlapped with the last backward); 'planner': the Hippie planner's free choice (ME
    objective, every schedule and depth). Global batch = batch_per_device (default: the
    profile's batch) x P (weak scaling). Pure Python."""
    from hippie_ds.planner import make_plan, parse_cluster, read_pipedream
    from hippie_ds.planner.profile import PlannerError
    profile_dir = Path(profile_dir) if profile_dir else _profile_dir()
    depth = devices_per_node if depth is None else depth
    rows = []
    for key, title in models:
        prof = read_pipedream(profile_dir / f"{key}.txt")
        for P in sizes:
            if P % devices_per_node:
                raise ValueError(f"{P} devices is not a multiple of {devices_per_node} per node")
            cluster = parse_cluster(f"{P // devices_per_node}x{devices_per_node},{cluster_tail}")
            G = (batch_per_device or prof.batch_size) * P
            if progress:
                progress(f"projection: {title} on {P} devices ({cluster.nodes}x{devices_per_node}), global batch {G}")
            free = make_plan(prof, cluster, G, objective="me", baselines=True, baseline_budget=0)
            dp = next((b for b in free.baselines if b.name == "dp"), None)
            dp_me = dp.prediction.me if dp and dp.prediction else None

            def row(schedule, plan_like, pred, note=""):
                return {"model": title, "profile": key, "devices": P, "nodes": cluster.nodes, "schedule": schedule,
                        "global_batch": G, "pipeline_depth": plan_like.pipeline_depth,
                        "data_parallel": plan_like.data_parallel, "micro_batch_size": plan_like.micro_batch_size,
                        "micro_batches": plan_like.micro_batches,
                        "deferred_stages": plan_like.schedule_params.get("deferred_stages"),
                        "step_time_s": pred.step_time, "throughput_samples_s": pred.throughput,
                        "scaling_efficiency": pred.scalability, "memory_mean_gb": pred.memory / GB,
                        "memory_max_gb": pred.memory_max / GB, "me": pred.me,
                        "me_vs_dp": pred.me / dp_me if dp_me else None, "fits": pred.fits,
                        "predicted_by": pred.predicted_by, "note": note}

            for s in schedules:
                if s == "dp":
                    if dp and dp.prediction:
                        rows.append(row("dp", dp, dp.prediction, "all-reduce overlapped with the last backward"))
                    continue
                try:
                    p = make_plan(prof, cluster, G, schedules=[s], objective=objective,
                                  depths=[depth] if depth else None, baselines=False)
                except PlannerError as exc:
                    rows.append({"model": title, "profile": key, "devices": P, "schedule": s, "error": str(exc)})
                    continue
                rows.append(row(s, p, p.prediction))
            rows.append(row("planner", free, free.prediction, f"{free.schedule}, ME objective, free depth"))
    return {"sizes": list(sizes), "devices_per_node": devices_per_node, "depth": depth, "objective": objective,
            "cluster": f"NODESx{devices_per_node},{cluster_tail}", "batch_per_device": batch_per_device or "profile",
            "rows": rows}


def _profile_dir() -> Path:
    for d in (Path("/work/shared/profiles/pipedream"), REPO / "tests" / "data" / "pipedream"):
        if (d / "vgg16.txt").exists():
            return d
    raise FileNotFoundError("no PipeDream profiles (tests/data/pipedream/ is vendored in the repository)")


# ---------------------------------------------------------------------------------- report
def _f(x, fmt="{:.3f}", none="-"):
    return none if x is None else fmt.format(x)


def _mb(x):
    return _f(x / 1e6 if x is not None else None, "{:.1f}")


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def spread_cell(median, lo, hi, fmt="{:.2f}", suffix="x", real: bool | None = None) -> str:
    """``median (min-max)`` (just the median without a spread, e.g. one round), with ``**real**``
    appended where the difference is real by the report's rule (``summarize``). Pure."""
    if median is None:
        return "-"
    cell = fmt.format(median) + suffix
    if lo is not None and hi is not None and (lo != hi or real is not None):
        cell += f" ({fmt.format(lo)}-{fmt.format(hi)})"
    return cell + (" **real**" if real else "")


def rounds_of(results: dict) -> int:
    """The number of rounds of the two-node runs (1 for results from before rounds)."""
    return max([r.get("rounds") or 1 for r in results.get("runs", {}).get("two_nodes", {}).values()], default=1)


def single_runs_note(results: dict) -> str:
    """The sentence saying which reference runs were not repeated in rounds ('' if none ran)."""
    runs = results.get("runs", {})
    which = [w for c, w in (("one_node", "the one-node runs (1-node samples/s, scaling 1->2 nodes)"),
                            ("one_device", "the one-device run (single-device throughput, scalability, ME)"))
             if runs.get(c)]
    if not which:
        return ""
    text = " and ".join(which)
    return f" Not repeated in rounds: {text} ran once each, so their figures carry no spread."


def main_table(results: dict) -> list[str]:
    two = results["runs"].get("two_nodes", {})
    summ = results["summary"]["schedules"]
    head = ["schedule", "layout", "median step (s)", "samples/s", "vs 1F1B", "vs DP", "peak saved/rank (MB)",
            "peak RSS/rank (MB)", "training RSS/rank (MB)", "ME vs DP", "ME vs DP (tensors)", "1-node samples/s",
            "scaling 1->2 nodes", "predicted step (s)", "prediction error"]
    rows = []
    for name, r in two.items():
        s = summ.get(name, {})
        if name == "dp":
            layout = f"DP x{r['world']}"
        else:
            d = r["schedule_params"].get("deferred_stages")
            layout = f"{r['stages']} stages x {r['world'] // r['stages']}" + (f", deferred {d}" if d is not None else "")
        pred = r.get("prediction") or {}
        several = (r.get("rounds") or 1) > 1
        step = spread_cell(r["median_step_s"], r.get("median_step_s_min") if several else None,
                           r.get("median_step_s_max"), "{:.3f}", "")
        rows.append([DISPLAY.get(name, name), layout, step, _f(r["throughput_samples_s"], "{:.2f}"),
                     spread_cell(s.get("ratio_to_1f1b"), s.get("ratio_to_1f1b_min") if several else None,
                                 s.get("ratio_to_1f1b_max"), real=s.get("real_vs_1f1b")),
                     spread_cell(s.get("ratio_to_dp"), s.get("ratio_to_dp_min") if several else None,
                                 s.get("ratio_to_dp_max"), real=s.get("real_vs_dp")),
                     _mb(r["mean_peak_saved_bytes"]), _mb(r["mean_peak_rss_bytes"]),
                     _mb(r["mean_peak_training_rss_bytes"]), _f(s.get("me_vs_dp"), "{:.2f}x"),
                     _f(s.get("me_tensors_vs_dp"), "{:.2f}x"), _f(s.get("one_node_throughput_samples_s"), "{:.2f}"),
                     _f(s.get("scaling_efficiency"), "{:.2f}"), _f(pred.get("step_time")),
                     _f(pred.get("error"), "{:+.1%}")])
    return table(head, rows)


def rounds_table(results: dict) -> list[str]:
    """Per schedule and round: the run's median step and its ratios to 1F1B and DP of that round."""
    two = results["runs"].get("two_nodes", {})
    summ = results.get("summary", {}).get("schedules", {})
    n = rounds_of(results)
    head = ["schedule"] + [f"round {i}: step (s)" for i in range(n)] + ["vs 1F1B per round", "vs DP per round"]
    rows = []
    for name, r in two.items():
        steps = list(r.get("round_median_step_s") or [r["median_step_s"]]) + [None] * n
        s = summ.get(name, {})
        rows.append([DISPLAY.get(name, name)] + [_f(x) for x in steps[:n]]
                    + [", ".join(_f(x, "{:.2f}") for x in s.get(k) or []) or "-"
                       for k in ("ratio_to_1f1b_rounds", "ratio_to_dp_rounds")])
    return table(head, rows)


def memory_table(results: dict) -> list[str]:
    rows = []
    for name, r in results["runs"].get("two_nodes", {}).items():
        for rank, m in r["memory_per_rank"].items():
            rows.append([DISPLAY.get(name, name), rank, str(m["stage"]), _mb(m["peak_saved_bytes"]),
                         _mb(m["state_bytes"]), _mb(m["peak_rss_bytes"]), _mb(m["rss_baseline_bytes"]),
                         _mb(m["peak_training_rss_bytes"])])
    return table(["schedule", "rank", "stage", "peak saved for backward (MB)", "params+grads+optimizer (MB)",
                  "peak RSS (MB)", "RSS before the model (MB)", "training RSS (MB)"], rows)


def prediction_table(results: dict) -> list[str]:
    rows = []
    for config in ("two_nodes", "one_node", "one_device"):
        for name, r in results["runs"].get(config, {}).items():
            p = r.get("prediction") or {}
            times = "; ".join(f"s{s}: " + ", ".join(f"{k[0]}{v * 1e3:.0f}" for k, v in (
                ("F", st.get("forward")), ("B", st.get("backward")), ("U", st.get("optimizer_time")))
                if v is not None) for s, st in enumerate((p.get("costs") or {}).get("stages", [])))
            rows.append([config.replace("_", " "), DISPLAY.get(name, name), _f(r["median_step_s"]),
                         _f(p.get("step_time")), _f(p.get("error"), "{:+.1%}"), times or p.get("error") or "-"])
    return table(["run", "schedule", "measured step (s)", "predicted step (s)", "error",
                  "measured costs (ms: F forward, B backward, U update, per micro-batch)"], rows)


def projection_table(proj: dict) -> list[str]:
    rows = []
    for r in proj["rows"]:
        if "error" in r:
            rows.append([r["model"], str(r["devices"]), r["schedule"], "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        layout = f"{r['pipeline_depth']} x {r['data_parallel']}"
        rows.append([r["model"], str(r["devices"]), r["schedule"], layout,
                     f"{r['micro_batch_size']} x {r['micro_batches']}", _f(r["step_time_s"] * 1e3, "{:.1f}"),
                     _f(r["scaling_efficiency"], "{:.1%}"), _f(r["memory_mean_gb"], "{:.2f}"),
                     _f(r["me_vs_dp"], "{:.2f}x"), (r["note"] + ("" if r["fits"] else " DOES NOT FIT")).strip()])
    return table(["model", "GPUs", "schedule", "stages x dp", "micro-batch x M", "step (ms)", "scaling efficiency",
                  "memory/GPU (GB)", "ME vs DP", "note"], rows)


def projection_pivot(proj: dict) -> list[str]:
    sizes = proj["sizes"]
    by = {}
    for r in proj["rows"]:
        if "error" not in r:
            by.setdefault((r["model"], r["schedule"]), {})[r["devices"]] = r["scaling_efficiency"]
    head = ["model", "schedule"] + [f"{n} GPUs" for n in sizes]
    rows = [[m, s] + [_f(v.get(n), "{:.1%}") for n in sizes] for (m, s), v in by.items()]
    return table(head, rows)


def report_markdown(results: dict) -> str:
    cfg = results.get("config", {})
    lines = ["# hippie-ds benchmark report", ""]
    if results.get("runs"):
        lines += [
            f"Emulated cluster: 2 nodes (network namespaces) x {cfg.get('stages')} ranks, one core per node, "
            f"link {cfg.get('link')}; pipeline of {cfg.get('stages')} stages inside a node, data parallelism across. "
            f"Model: GPT-like, {cfg.get('layers')} blocks, d_model {cfg.get('d_model')}, vocab {cfg.get('vocab')}, "
            f"sequence {cfg.get('seq')}, fp32 AdamW ({cfg.get('params_total', '?')} parameters). "
            f"{cfg.get('micro_batches')} micro-batches of {cfg.get('micro_batch_size')} per replica and step "
            f"(global batch {cfg.get('global_batch')}); {cfg.get('warmup')} warm-up + {cfg.get('steps')} timed steps "
            f"per schedule and run, each run in its own processes. Command: `{cfg.get('command', '')}`.", "",
            "## Side by side (two emulated nodes)", ""]
        n = rounds_of(results)
        if n > 1:
            lines += [
                f"The two-node runs came in {n} rounds: each round ran every schedule once (a fresh job), the order "
                "rotated from one round to the next (round r starts at the r-th schedule), so a drift of the machine "
                "lands on every schedule alike. Step time: median over rounds of each round's median step "
                "(min-max over rounds in brackets). Ratios (vs 1F1B, vs DP) are throughput ratios taken per round, "
                "between runs of the same round, shown as `median (min-max)` over rounds. A difference is marked "
                "**real** only when it holds in every round: vs 1F1B when the ratio's min-max spread does not "
                "include 1.0; vs DP when the schedule's throughput range over rounds and DP's do not overlap. "
                "Anything unmarked is within the round-to-round noise of this machine." + single_runs_note(results), ""]
        else:
            lines += ["Each schedule ran once (one round, `--rounds 1`): the ratios carry no spread, so no difference "
                      "below is marked real; rerun with `--rounds 3` or more to see which hold across rounds.", ""]
        lines += main_table(results)
        thr1 = results["summary"].get("single_device_throughput")
        lines += ["", f"Single device (whole model, one rank on one core): {_f(thr1, '{:.2f}')} samples/s. "
                      "Throughput: samples a step / median step (slowest rank's `train_batch`). ME = scalability x "
                      "throughput / memory, memory = mean per-rank peak training RSS (peak RSS minus the RSS before "
                      "the model was built); ME (tensors) uses parameters+gradients+optimizer state + peak bytes saved "
                      "for backward instead. Scalability counts a device per emulated node (core); the ME ratio to DP "
                      "does not depend on that choice. Scaling 1->2 nodes = two-node throughput / (2 x one-node "
                      "throughput), one node = node 0's ranks alone with the same per-replica batch. The prediction "
                      "is hippie-ds's simulator on the run's own measured per-stage times (below), parameter bytes "
                      f"and the link ({cfg.get('link_efficiency', 1):.2f} x the shaped rate for the all-reduce).", ""]
        for png in ("throughput.png", "memory.png", "me.png", "prediction.png"):
            if png in results.get("plots", []):
                lines.append(f"![{png[:-4]}]({png})")
        if n > 1:
            lines += ["", "## Rounds (two nodes)", ""]
            orders = cfg.get("round_orders") or []
            if orders:
                lines += ["Order: " + "; ".join(f"round {i}: " + ", ".join(DISPLAY.get(x, x) for x in o)
                                                for i, o in enumerate(orders)) + ".", ""]
            lines += rounds_table(results)
            detail = ", ".join(f"{DISPLAY.get(k, k)}: round {r['detail_round']}"
                               for k, r in results["runs"].get("two_nodes", {}).items()
                               if r.get("detail_round") is not None)
            lines += ["", "Memory, stage timings and predictions below are those of each schedule's median round "
                          f"(the lower median with an even number of rounds; {detail}); the prediction error is "
                          "against the median over rounds."]
        lines += ["", "## Memory per rank (two nodes)", ""] + memory_table(results)
        lines += ["", "## Predicted vs measured step time", ""] + prediction_table(results)
        exposed = [[DISPLAY.get(n, n)] + [f"s{s}: {v:.3f}" for s, v in sorted(r["exposed_allreduce_s_per_step"].items())]
                   for n, r in results["runs"].get("two_nodes", {}).items()]
        if exposed:
            lines += ["", "Exposed all-reduce per step (s, time the rank's stream spends in ReduceGrads / "
                          "StartAllReduce / WaitAllReduce, mean over the stage's ranks):", ""]
            lines += ["- " + " ".join(r) for r in exposed]
        noisy = results.get("noise", {}).get("foreign_cpu_cores_mean")
        if noisy is not None:
            lines += ["", f"CPU used by other processes during the runs: {noisy:.2f} cores on average"
                          + (" (the machine was busy: rerun on a quiet machine)" if noisy > 0.05 else "") + "."]
        if results.get("wall_s"):
            lines.append(f"Wall time of the measured part: {results['wall_s']:.0f} s.")
    proj = results.get("projection")
    if proj:
        lines += ["", "## Projection: scaling efficiency on V100 clusters (planner cost model + simulator)", "",
                  f"PipeDream V100 profiles; clusters of NODES x {proj['devices_per_node']} V100 (16 GB), 100 Gbit/s "
                  f"between nodes, 100 GB/s inside (the planner's NVLink-class default); global batch = "
                  f"{proj['batch_per_device']} per GPU x GPUs (weak scaling). Pipeline schedules: "
                  f"{proj['depth'] or 'planner-chosen'} stages (a pipeline per node, data parallelism across), "
                  f"micro-batches, partition and re-computation chosen by the planner for {proj['objective']}; dp: the "
                  "planner's data-parallel baseline (all-reduce overlapped with the last micro-batch's backward); "
                  "planner: the Hippie planner's own choice (ME objective, any schedule and depth). Scaling "
                  "efficiency = throughput / (GPUs x single-GPU throughput). The paper claims > 90% on 16 GPUs.", ""]
        lines += projection_pivot(proj) + [""]
        if "projection.png" in results.get("plots", []):
            lines += ["![projection](projection.png)", ""]
        lines += ["<details><summary>Projection details</summary>", ""] + projection_table(proj) + ["", "</details>"]
    lines += ["", "Reproduce: `sudo make bench` (or `sudo .venv/bin/python tools/bench.py --help`); "
                  "`tools/bench.py --projection-only` for the projection alone (no root)."]
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    two = results.get("runs", {}).get("two_nodes", {})
    summ = results.get("summary", {}).get("schedules", {})
    names = list(two)
    labels = [DISPLAY.get(n, n).replace(" (stock DeepSpeed)", "\n(stock DS)") for n in names]
    if names:
        fig, ax = plt.subplots(figsize=(8, 4))
        xs = range(len(names))
        two_thr = [two[n]["throughput_samples_s"] or 0 for n in names]
        one_thr = [summ.get(n, {}).get("one_node_throughput_samples_s") or 0 for n in names]
        lo = [max(0.0, t - (two[n].get("throughput_samples_s_min") or t)) for n, t in zip(names, two_thr)]
        hi = [max(0.0, (two[n].get("throughput_samples_s_max") or t) - t) for n, t in zip(names, two_thr)]
        ax.bar([x - 0.2 for x in xs], two_thr, 0.4, label="2 nodes",
               yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=3)
        ax.bar([x + 0.2 for x in xs], one_thr, 0.4, label="1 node")
        for x, n in zip(xs, names):
            se = summ.get(n, {}).get("scaling_efficiency")
            if se:
                ax.text(x - 0.2, two_thr[x], f"{se:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("samples/s")
        ax.set_title("Throughput (numbers: scaling efficiency 1 -> 2 nodes"
                     + ("; bars: min-max over rounds)" if any(lo) or any(hi) else ")"))
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=110)
        plt.close(fig)
        made.append("throughput.png")

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        ranks = sorted({r for n in names for r in two[n]["memory_per_rank"]}, key=int)
        w = 0.8 / max(1, len(ranks))
        for i, r in enumerate(ranks):
            saved = [(two[n]["memory_per_rank"].get(r) or {}).get("peak_saved_bytes") or 0 for n in names]
            rss = [(two[n]["memory_per_rank"].get(r) or {}).get("peak_training_rss_bytes") or 0 for n in names]
            axes[0].bar([x - 0.4 + w * (i + 0.5) for x in xs], [v / 1e6 for v in saved], w, label=f"rank {r}")
            axes[1].bar([x - 0.4 + w * (i + 0.5) for x in xs], [v / 1e6 for v in rss], w, label=f"rank {r}")
        axes[0].set_title("peak bytes saved for backward (MB)")
        axes[1].set_title("peak training RSS (MB, above pre-model RSS)")
        for ax in axes:
            ax.set_xticks(list(xs), labels, fontsize=7)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=110)
        plt.close(fig)
        made.append("memory.png")

        fig, ax = plt.subplots(figsize=(8, 4))
        me = [summ.get(n, {}).get("me_vs_dp") or 0 for n in names]
        me_t = [summ.get(n, {}).get("me_tensors_vs_dp") or 0 for n in names]
        ax.bar([x - 0.2 for x in xs], me, 0.4, label="memory = training RSS")
        ax.bar([x + 0.2 for x in xs], me_t, 0.4, label="memory = state + saved for backward")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("ME / ME of DP")
        ax.set_title("Memory efficiency relative to data parallelism")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "me.png", dpi=110)
        plt.close(fig)
        made.append("me.png")

        fig, ax = plt.subplots(figsize=(8, 4))
        meas = [two[n]["median_step_s"] or 0 for n in names]
        pred = [(two[n].get("prediction") or {}).get("step_time") or 0 for n in names]
        ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], pred, 0.4, label="simulator")
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("step time (s)")
        ax.set_title("Step time: measured vs predicted (two nodes)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "prediction.png", dpi=110)
        plt.close(fig)
        made.append("prediction.png")
    proj = results.get("projection")
    if proj:
        models = list(dict.fromkeys(r["model"] for r in proj["rows"]))
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), sharey=True, squeeze=False)
        for ax, m in zip(axes[0], models):
            rows = [r for r in proj["rows"] if r["model"] == m and "error" not in r]
            for s in dict.fromkeys(r["schedule"] for r in rows):
                pts = sorted((r["devices"], r["scaling_efficiency"]) for r in rows if r["schedule"] == s)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
            ax.set_xscale("log", base=2)
            ax.set_xticks(proj["sizes"], [str(x) for x in proj["sizes"]])
            ax.axhline(0.9, color="grey", lw=0.8, ls="--")
            ax.set_title(m)
            ax.set_xlabel("V100 GPUs")
        axes[0][0].set_ylabel("scaling efficiency")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "projection.png", dpi=110)
        plt.close(fig)
        made.append("projection.png")
    return made


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="tools/bench.py",
        description="hippie-ds benchmark report: DP, GPipe+DP, stock 1F1B, hippie, hippie-1f1b (and any schedule by "
                    "name) on an emulated two-node cluster (network namespaces, shaped link; needs root), plus a "
                    "simulator projection to 16/64/1,024 V100s. Writes results.json, report.md and PNG plots.",
        epilog="example: sudo .venv/bin/python tools/bench.py --out out/bench --publish docs/bench",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="out/bench", help="output directory")
    p.add_argument("--publish", default=None, metavar="DIR",
                   help="also copy report.md, results.json and the plots to DIR (e.g. docs/bench)")
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                   help="comma list: dp, 1f1b (stock DeepSpeed), hds-1f1b (hippie-ds's 1F1B), gpipe, hippie, "
                        "hippie-1f1b, or any schedule name hippie-ds knows (configs/NAME.json is used if present)")
    p.add_argument("--plan", action="append", default=[], metavar="SCHEDULE=PLAN_FILE",
                   help="planner layout for a schedule's two-node run (stage boundaries and re-computed layers via "
                        "hippie_ds.PipelineModule(plan=...); the plan's batch settings are not applied; the one-node "
                        "run keeps --partition-method, a plan being made for one world size); repeatable")
    p.add_argument("--steps", type=int, default=8, help="timed steps per schedule and run (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule (per run)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the two-node runs: each round runs every schedule once (its own job: warm-up + "
                        "--steps), the order rotated each round; figures are medians over rounds, ratios to 1F1B/DP "
                        "taken per round with their min-max spread (1: one run per schedule); one-node and "
                        "one-device runs run once")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks per node")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per replica and step")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--partition-method", default="uniform", help="PipelineModule partition_method without a plan")
    p.add_argument("--auto-plan", action="store_true",
                   help="profile the model here (hippie-ds profile) and give hippie, hippie-1f1b, 2bw and pipedream "
                        "their planner-chosen layout (boundaries and re-computation for ME) in the two-node run")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    p.add_argument("--no-shape", action="store_true", help="do not shape the link")
    p.add_argument("--cores", default="0,1", help="core of node 0, core of node 1 (taskset)")
    p.add_argument("--port", type=int, default=29610, help="first master port (one per job)")
    p.add_argument("--timeout", type=int, default=600, help="seconds before one job is killed")
    p.add_argument("--no-scaling", action="store_true", help="skip the one-node runs (no scaling efficiency)")
    p.add_argument("--no-single", action="store_true", help="skip the one-device run (no scalability / ME)")
    p.add_argument("--link-efficiency", type=float, default=0.91,
                   help="all-reduce bandwidth / shaped rate for the prediction (the brief: 64 MB in 561 ms at 1 Gbit/s)")
    p.add_argument("--intra-allreduce-bandwidth", type=float, default=1.1e9,
                   help="bytes/s of an all-reduce inside a node (prediction of one-node DP; the brief: 64 MB in ~60 ms)")
    p.add_argument("--p2p-bandwidth", type=float, default=4e9, help="bytes/s of a pipeline send inside a node "
                                                                     "(the brief: 4 MB in ~1 ms)")
    p.add_argument("--p2p-latency", type=float, default=2e-4, help="seconds per pipeline send inside a node")
    p.add_argument("--no-projection", action="store_true", help="skip the projection")
    p.add_argument("--projection-only", action="store_true", help="only the projection (no root, no namespaces)")
    p.add_argument("--projection-sizes", default="16,64,1024", help="cluster sizes (GPUs)")
    p.add_argument("--projection-depth", type=int, default=None,
                   help="pipeline stages for the pipeline schedules (default: GPUs per node; 0: planner's choice)")
    p.add_argument("--projection-objective", choices=("throughput", "me"), default="throughput",
                   help="what the planner maximizes for each pipeline schedule")
    p.add_argument("--projection-batch", type=int, default=0,
                   help="samples per GPU (global batch = this x GPUs); 0: the profile's batch")
    p.add_argument("--analyze-only", action="store_true", help="only re-analyse OUT/runs of an earlier run (no root)")
    a = p.parse_args(argv)
    a.schedule_list = [s.strip() for s in a.schedules.split(",") if s.strip()]
    if not a.schedule_list:
        p.error("--schedules: empty")
    if len(set(a.schedule_list)) != len(a.schedule_list):
        p.error("--schedules: a schedule is named twice")
    a.plans = {}
    for item in a.plan:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--plan {item!r}: expected SCHEDULE=PLAN_FILE")
        if name == "dp":
            p.error("--plan: dp has no pipeline layout")
        a.plans[name] = str(Path(path).resolve())
    if a.d_model % a.heads:
        p.error("--d-model must be a multiple of --heads")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        a.sizes = [int(x) for x in a.projection_sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--projection-sizes {a.projection_sizes!r}: expected integers, e.g. 16,64,1024")
    return a


def config_record(a) -> dict:
    block = 12 * a.d_model ** 2 + 13 * a.d_model
    total = (a.vocab + a.seq) * a.d_model + a.layers * block + 2 * a.d_model + a.d_model * a.vocab
    return {"stages": a.stages, "micro_batches": a.micro_batches, "micro_batch_size": a.micro_batch_size,
            "global_batch": a.micro_batch_size * a.micro_batches * 2, "seq": a.seq, "d_model": a.d_model,
            "layers": a.layers, "vocab": a.vocab, "heads": a.heads, "warmup": a.warmup, "steps": a.steps,
            "params_total": f"{total / 1e6:.1f}M", "link": "unshaped veth" if a.no_shape else f"tbf {a.rate}",
            "link_efficiency": a.link_efficiency, "cores": a.cores, "schedules": a.schedule_list,
            "plans": a.plans, "rounds": a.rounds, "round_orders": round_orders(a.schedule_list, a.rounds),
            "command": " ".join(["tools/bench.py"] + sys.argv[1:])}


def analyse_all(out: Path, a, jobs: list[dict]) -> dict:
    """runs[config][schedule]: each schedule's runs in a config, one per round as found on disk
    (``round_dirs``: so --analyze-only reads either layout whatever --rounds says), combined."""
    link_bw = 1.25e9 if a.no_shape else parse_rate(a.rate)
    runs = {}
    for job in {(j["config"], j["schedule"]): j for j in jobs}.values():
        found = round_dirs(out / "runs" / job["config"] / job["schedule"])
        per_round = [None] * (found[-1][0] + 1)
        for rnd, d in found:
            per_round[rnd] = analyse_job(d, job, a, link_bw)
        r = combine_rounds(per_round)
        if r is not None:
            runs.setdefault(job["config"], {})[job["schedule"]] = r
    return runs


def write_outputs(out: Path, results: dict, publish: str | None):
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = report_markdown(results)
    (out / "report.md").write_text(md)
    if publish:
        dest = Path(publish)
        dest.mkdir(parents=True, exist_ok=True)
        for name in ["report.md", "results.json"] + results["plots"]:
            shutil.copy2(out / name, dest / name)
    return md


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
        qdiscs = NETWORK.setup(None if a.no_shape else a.rate)
        print(f"emulated cluster: {NETWORK.describe(None if a.no_shape else qdiscs, with_veths=False)}", flush=True)
        print(f"{len(jobs)} runs: " + ", ".join(job_name(j) for j in jobs)
              + f"; {a.warmup} warm-up + {a.steps} timed steps each", flush=True)
        sampler.start()
        for i, job in enumerate(jobs):
            run_dir = out / "runs" / job["dir"]
            run_dir.mkdir(parents=True, exist_ok=True)
            costs = costs_files.get(job["config"]) if job["schedule"] not in ("dp", "1f1b") else None
            tag = f"[{i + 1}/{len(jobs)}] {job_name(job)}"
            print(f"[{time.monotonic() - start:6.1f}s] {tag}: starting ({job['nodes']} node(s) x {job['rpn']} "
                  f"rank(s))", flush=True)
            j = WorkerJob(NETWORK, WORKER, worker_args(a, job, run_dir, costs), run_dir / "logs", job["nodes"],
                          job["rpn"], cores, a.port + i, t0=start, tag=tag)
            _active_jobs.append(j)
            t_begin = time.perf_counter()
            j.start()
            try:
                j.wait(a.timeout)
            finally:
                j.stop()
                _active_jobs.remove(j)
            spans.append((t_begin, time.perf_counter()))
            r = analyse_job(run_dir, job, a, link_bw)
            if r:
                print(f"[{time.monotonic() - start:6.1f}s] {tag}: median step {r['median_step_s']:.3f} s, "
                      f"{r['throughput_samples_s']:.2f} samples/s", flush=True)
                # the first (round 0) stock run's costs: 'auto' resolves the same in every round
                if job["schedule"] == "1f1b" and job["config"] in ("two_nodes", "one_node") \
                        and job["config"] not in costs_files:
                    dp_width = 2 if job["config"] == "two_nodes" else 1
                    costs_files[job["config"]] = out / "runs" / job["config"] / "costs.json"
                    write_costs(costs_files[job["config"]], r, dp_width)
    foreign = [foreign_cpu_between(sampler.samples, b, e) / (e - b) for b, e in spans if e > b]
    noise = {"foreign_cpu_cores_per_run": foreign, "runs": [job["dir"] for job in jobs][:len(foreign)],
             "foreign_cpu_cores_mean": _mean(foreign), "qdiscs": qdiscs}
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

    import bench_worker
    import torch
    from hippie_ds.planner import Cluster, make_plan, save_plan, save_profile
    from hippie_ds.planner.plan import SCHEDULES
    from hippie_ds.profiler import profile_layers

    wanted = [s for s in a.schedule_list if s in AUTO_PLAN_SCHEDULES and s in SCHEDULES and s not in a.plans]
    if not wanted:
        return {}
    d = out / "plans"
    d.mkdir(parents=True, exist_ok=True)
    shape = types.SimpleNamespace(vocab=a.vocab, seq=a.seq, d_model=a.d_model, heads=a.heads, layers=a.layers)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as a rank runs: one core per node, OMP_NUM_THREADS=1
    sample = torch.randint(0, a.vocab, (a.micro_batch_size, a.seq))
    profile = profile_layers(bench_worker.layer_specs(shape), sample, model="bench-gpt", repeats=5, warmup=2,
                             progress=sys.stdout)
    save_profile(profile, d / "profile.yaml")
    link = (1.25e9 if a.no_shape else parse_rate(a.rate)) * a.link_efficiency
    cluster = Cluster(nodes=2, devices_per_node=a.stages, device_memory=8e9, inter_node_bandwidth=link,
                      intra_node_bandwidth=a.p2p_bandwidth, latency=a.p2p_latency)
    plans = {}
    for s in wanted:
        plan = make_plan(profile, cluster, samples_per_replica(a) * 2, schedules=[s], depths=[a.stages],
                         micro_batch_sizes=[a.micro_batch_size], objective="me", baselines=False)
        path = d / f"{s}.json"
        save_plan(plan, path)
        plans[s] = str(path)
        print(f"planned {s}: boundaries {plan.boundaries}, re-computed layers {plan.checkpointed_layers or 'none'}, "
              f"{plan.micro_batches} micro-batches -> {path}", flush=True)
    return plans


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    if a.auto_plan and not (a.analyze_only or a.projection_only):
        out.mkdir(parents=True, exist_ok=True)
        a.plans.update(auto_plan(a, out))
    results: dict = {"config": config_record(a), "runs": {}}
    if a.analyze_only:
        old = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
        results["config"] = old.get("config", results["config"])
        results["runs"] = analyse_all(out, a, run_plan(a))
        results["wall_s"], results["noise"] = old.get("wall_s"), old.get("noise", {})
        results["projection"] = old.get("projection")
    elif not a.projection_only:
        try:
            preflight(a)
        except Refuse as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        rc = 0
        try:
            results["runs"], results["wall_s"], results["noise"] = measure(a, out)
        except RuntimeError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            rc = 1
        if rc:
            fix_owner(out)
            return rc
    out.mkdir(parents=True, exist_ok=True)
    if results["runs"]:
        results["summary"] = summarize(results["runs"])
    if not a.no_projection and (not a.analyze_only or results.get("projection") is None):
        t = time.monotonic()
        results["projection"] = projection(sizes=a.sizes, depth=a.projection_depth, objective=a.projection_objective,
                                           batch_per_device=a.projection_batch,
                                           progress=lambda m: print(m, flush=True))
        print(f"projection: {time.monotonic() - t:.1f} s", flush=True)
    md = write_outputs(out, results, a.publish)
    print("\n" + md)
    print(f"results: {out}/results.json, {out}/report.md, plots {', '.join(results['plots']) or 'none'}"
          + (f"; published to {a.publish}" if a.publish else ""))
    fix_owner(out)
    if a.publish:
        fix_owner(Path(a.publish))
    return 0


if __name__ == "__main__":
    sys.exit(main())
