"""Schedules side by side on one node, one rank per core: step time, bubble and activation memory,
measured and simulated (default: zb-h1 against hippie-ds's 1f1b; any flush schedules, virtual
stages included: ``--schedules 1f1b,zb-h1,interleaved-1f1b,zb-v``).

``python -m tools.bench schedules`` (``--help``: the options) runs ``tools/bench/workers/bench_worker.py`` under the
``deepspeed`` launcher on one node, K ranks, each pinned to its own core (``--core-per-rank``), so
that a pipeline bubble is idle time and not another rank's compute. The schedules alternate in
rounds inside one job (the order rotated each round). Then, per schedule:

* step time: median over the timed steps of each round; the ratio to the first schedule per
  round, with the median and min-max spread over rounds;
* measured bubble: 1 - (the stages' mean compute time per step) / step time, from the engines'
  timelines; per-op medians;
* the simulator's step time and bubble with the measured costs (per stage, each compute kind's
  time per micro-batch summed over the stage's chunks; the end-of-step ReduceGrads +
  OptimizerStep and one p2p transfer from the runs) and its relative error;
* peak bytes held for backward per stage (``hippie_ds.adapter.profiling.memory.ActivationMeter``; a split
  backward adds the gradients its backward_input keeps until W) against the simulator's peak, the
  bytes per micro-batch calibrated on the first schedule (1f1b: peak / micro-batches in flight).

Writes ``results.json`` and ``report.md`` to ``--out`` (and ``--publish`` DIR). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from hippie_ds.schedules import compile as compile_schedule
from hippie_ds.schedules.costs import CommCost, Costs
from hippie_ds.schedules.simulator import simulate
from tools.bench import REPO, WORKERS
from tools.bench.analysis import load_run, stage_timings
from tools.bench.cluster import local_env
from tools.bench.config import add_model_choice, model_choice_args
from tools.bench.publish import publish

COMPUTE = ("forward", "backward", "backward_input", "backward_weight", "forward_backward")  # categories
PASSES = ("ForwardPass", "BackwardPass", "BackwardInputPass", "BackwardWeightPass")
SENDS = ("SendActivation", "SendGrad", "ISendActivation", "ISendGrad")


def run_worker(a) -> None:
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(a.stages),
        "--master_port",
        str(a.port),
        str(WORKERS / "bench_worker.py"),
        "--out",
        a.out,
        "--schedules",
        a.schedules,
        "--stages",
        str(a.stages),
        "--micro-batches",
        str(a.micro_batches),
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
        "--rounds",
        str(a.rounds),
        "--layers",
        str(a.layers),
        "--d-model",
        str(a.d_model),
        "--memory",
        "--core-per-rank",
        "--micro-batch-size",
        str(a.micro_batch_size),
        *model_choice_args(a),
    ]
    env = local_env()
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True, cwd=REPO)


def analyse_label(ranks: dict, micro_batches: int) -> dict:
    """One schedule's figures from its run (``tools.bench.analysis.load_run``: {rank: (steps, timeline)})."""
    by_stage = sorted(ranks.values(), key=lambda r: r[0]["stage"])
    timed = [s for s in by_stage[0][0]["steps"] if not s["warmup"]]
    rounds = sorted({s["round"] for s in timed})
    per_round = {r: statistics.median(s["end"] - s["start"] for s in timed if s["round"] == r) for r in rounds}
    step = statistics.median(per_round.values())
    timings = stage_timings(ranks)  # per stage: median of each instruction over the timed steps
    busy, per_mb = [], []
    for steps, timeline in by_stage:
        per_step: dict[int, float] = {}  # timeline steps count train_batch calls from 0, warm-up included
        kinds: dict[str, dict[int, float]] = {}  # pass -> call -> its time in the call
        for e in timeline["events"]:
            if e["category"] in COMPUTE:
                per_step[e["step"]] = per_step.get(e["step"], 0.0) + e["end"] - e["start"]
                calls_of = kinds.setdefault(e["kind"], {})
                calls_of[e["step"]] = calls_of.get(e["step"], 0.0) + e["end"] - e["start"]
        calls = [i for i, s in enumerate(steps["steps"]) if not s["warmup"] and i in per_step]
        busy.append(statistics.median(per_step[i] for i in calls))
        # a stage's time per micro-batch of each pass, all its chunks together (the simulator's stage cost)
        per_mb.append({k: statistics.median(v.get(i, 0.0) for i in calls) / micro_batches for k, v in kinds.items()})
    peaks = [
        statistics.median(s["saved_peak_bytes"] for s in steps["steps"] if not s["warmup"]) for steps, _ in by_stage
    ]
    return {
        "step_time": step,
        "per_round": per_round,
        "ops": [timings[s]["median"] for s in sorted(timings)],
        "per_micro_batch": per_mb,
        "busy": busy,
        "bubble": 1 - statistics.mean(busy) / step,
        "peak_saved_bytes": peaks,
    }


def costs_of(per_mb: list[dict], saved: list[float], step_end: list[float], p2p: float) -> Costs:
    """The simulator's costs from a schedule's measured time per micro-batch of each pass, per
    stage (all its chunks); ``step_end``: per stage, the end-of-step work (DeepSpeed's ReduceGrads
    and OptimizerStep), ``p2p``: one transfer."""
    stages = []
    for s, o in enumerate(per_mb):
        common = {"forward": o.get("ForwardPass", 0.0), "saved_bytes": saved[s], "optimizer_time": step_end[s]}
        if "BackwardInputPass" in o:
            w = o.get("BackwardWeightPass", 0.0)
            stages.append({**common, "backward": o["BackwardInputPass"] + w, "backward_weight": w})
        else:
            stages.append({**common, "backward": o.get("BackwardPass", 0.0)})
    return Costs(stages=stages, comm=CommCost(p2p_bandwidth=float("inf"), p2p_latency=p2p, data_parallel=1))


def _end_of_step(got: dict, stages: int) -> list[float]:
    """Per stage, the smaller of the schedules' ReduceGrads + OptimizerStep medians: the other
    includes waiting for the pipeline-wide gradient-norm reduction (the simulator adds that)."""
    return [
        min(r["ops"][s].get("ReduceGrads", 0.0) + r["ops"][s].get("OptimizerStep", 0.0) for r in got.values())
        for s in range(stages)
    ]


def _p2p(got: dict) -> float:
    """One activation or gradient transfer: the smallest median send (blocking or not)."""
    sends = [v for r in got.values() for o in r["ops"] for k, v in o.items() if k in SENDS]
    return min(sends) if sends else 0.0


def analyse(a) -> dict:
    labels = a.schedules.split(",")
    K, M = a.stages, a.micro_batches
    got = {label: analyse_label(load_run(Path(a.out), label), M) for label in labels}
    base = labels[0]
    # bytes per micro-batch in flight, calibrated on the first schedule's simulated peak
    in_flight = [
        p["peak_activation_microbatches"]
        for p in simulate(compile_schedule(base, K, M), Costs.uniform(K), iterations=3).per_stage
    ]
    per_mb = [p / n for p, n in zip(got[base]["peak_saved_bytes"], in_flight)]
    step_end, p2p = _end_of_step(got, K), _p2p(got)
    for label, r in got.items():
        sim = simulate(
            compile_schedule(label, K, M), costs_of(r["per_micro_batch"], per_mb, step_end, p2p), iterations=3
        )
        r["simulated"] = {
            "step_time": sim.step_time,
            "bubble": sim.bubble_fraction,
            "peak_saved_bytes": [p["peak_activation_bytes"] for p in sim.per_stage],
            "peak_micro_batches": [p["peak_activation_microbatches"] for p in sim.per_stage],
        }
        r["simulated"]["step_error"] = sim.step_time / r["step_time"] - 1
    ratios = {}
    for label in labels[1:]:
        per = [got[label]["per_round"][k] / got[base]["per_round"][k] for k in got[base]["per_round"]]
        ratios[label] = {"median": statistics.median(per), "min": min(per), "max": max(per), "per_round": per}
    return {
        "stages": K,
        "micro_batches": M,
        "layers": a.layers,
        "d_model": a.d_model,
        "base": base,
        "cores": len(os.sched_getaffinity(0)),
        "model": a.model,
        "micro_batch_size": a.micro_batch_size,
        "emulate_scale": a.emulate_scale,
        "emulate_speedup": a.emulate_speedup,
        "results": got,
        "ratio_to_base": ratios,
    }


def report(res: dict) -> str:
    g, base = res["results"], res["base"]
    others = [x for x in g if x != base]
    rounds = len(g[base]["per_round"])
    model = res.get("model", "gpt")
    emulated = model.startswith("emulated:")
    per_core = (
        "one rank per core"
        if res["stages"] <= res["cores"]
        else f"{res['stages']} ranks on {res['cores']} cores"
        + (" (compute is a CPU-free wait)" if emulated else " (time-shared: a bubble is not all idle time)")
    )
    what = (
        f"{model} (PipeDream's V100 profile, compute emulated; micro-batch {res['micro_batch_size']}, "
        f"scale {res['emulate_scale']:g}, speedup {res['emulate_speedup']:g})"
        if emulated
        else f"GPT example, {res['layers']} blocks, d_model {res['d_model']}"
    )
    extra = (
        f" --model {model} --micro-batch-size {res['micro_batch_size']} --emulate-scale {res['emulate_scale']:g} "
        f"--emulate-speedup {res['emulate_speedup']:g}"
        if emulated
        else ""
    )
    lines = [
        f"# {', '.join(others)} against {base}: {res['stages']} stages x {res['micro_batches']} micro-batches, "
        f"{per_core}",
        "",
        f"{what}; "
        f"`python -m tools.bench schedules --schedules {','.join(g)} --stages {res['stages']} "
        f"--micro-batches {res['micro_batches']}{extra}` (rounds: {rounds}).",
        "",
        "| schedule | step (s) | sim step (s) | error | bubble | sim bubble | peak held / stage (MB) | sim (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, x in g.items():
        s = x["simulated"]
        lines.append(
            f"| {label} | {x['step_time']:.3f} | {s['step_time']:.3f} | {s['step_error']:+.1%} | "
            f"{x['bubble']:.1%} | {s['bubble']:.1%} | "
            f"{' / '.join(f'{b / 1e6:.1f}' for b in x['peak_saved_bytes'])} | "
            f"{' / '.join(f'{b / 1e6:.1f}' for b in s['peak_saved_bytes'])} |"
        )
    lines.append("")
    for label, r in res["ratio_to_base"].items():
        lines.append(
            f"{label} / {base} step time: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}; "
            f"per round {', '.join(f'{x:.3f}' for x in r['per_round'])})"
        )
    lines += ["", "Per-op medians (ms), per stage:", ""]
    for label, x in g.items():
        for s, o in enumerate(x["ops"]):
            lines.append(f"- {label} stage {s}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(o.items())))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench schedules",
        description=__doc__.split("\n\n")[0],
        epilog="example: .venv/bin/python -m tools.bench schedules --schedules "
        "1f1b,zb-h1,interleaved-1f1b,zb-v --stages 4 --micro-batches 8",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--schedules", default="1f1b,zb-h1", help="comma list of flush schedules; ratios are to the first")
    p.add_argument("--out", default="out/bench_schedules")
    p.add_argument("--publish", default=None, help="also copy report.md and results.json to this directory")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks = cores used")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    add_model_choice(p)  # emulated models wait without the CPU: their ranks may share cores
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per schedule and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--analyze-only", action="store_true", help="re-analyse the raw files of an earlier run")
    a = p.parse_args(argv)
    if not a.analyze_only:
        shutil.rmtree(Path(a.out, "raw"), ignore_errors=True)
        run_worker(a)
    res = analyse(a)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "results.json").write_text(json.dumps(res, indent=1))
    text = report(res)
    Path(a.out, "report.md").write_text(text)
    print(text)
    publish(a.publish, ("report.md", "results.json"), base=a.out)
    return 0
