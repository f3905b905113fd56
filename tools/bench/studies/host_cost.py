"""``python -m tools.bench host-cost``: hippie-ds's engine against stock ``PipelineEngine``, host time per instruction.

Both engines run the same 1F1B order on the same negligible-compute model (2 stages x 1 replica,
tools/bench/workers/host_cost_worker.py), built once each in the same processes, then timed in
interleaved rounds (each round every engine, order rotated). Per round and engine: the median step
of the slowest rank, its wall and CPU time per instruction; the ratio hippie-ds / stock is taken per
round and reported as median (min-max) over rounds: a difference is real only when every round
shows it (the machine is shared). ``--profile`` adds one untimed pass per engine under cProfile on
rank 0: its 40 costliest functions, and its Python function calls per instruction (host work that
no machine noise moves). Writes OUT/host_cost.json (raw), OUT/report.md; ``--publish DIR`` copies both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from tools.bench.cluster import LocalJob
from tools.bench.publish import publish

WORKER = Path(__file__).resolve().parents[1] / "workers" / "host_cost_worker.py"


def summarize(raw: dict) -> dict:
    """{engine: {round: {wall_us, cpu_us}}} per instruction (slowest rank's median step), and the
    per-round ratios of every engine to ``stock``."""
    ranks = raw["ranks"]
    engines = list(ranks[0])
    rounds = sorted({rec["round"] for rec in ranks[0][engines[0]]})
    per = {}
    for name in engines:
        per[name] = {}
        for r in rounds:
            worst = {"wall_us": 0.0, "cpu_us": 0.0}
            for recs in ranks:
                steps = [x for x in recs[name] if x["round"] == r]
                n = steps[0]["instructions"]
                worst["wall_us"] = max(worst["wall_us"], statistics.median(x["wall"] for x in steps) / n * 1e6)
                worst["cpu_us"] = max(worst["cpu_us"], statistics.median(x["cpu"] for x in steps) / n * 1e6)
            per[name][r] = worst
    ratios = {}
    for name in engines:
        if name == "stock":
            continue
        ratios[name] = {k: [per[name][r][k] / per["stock"][r][k] for r in rounds] for k in ("wall_us", "cpu_us")}
    return {"per_round": per, "ratios": ratios, "rounds": rounds}


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def report(summary: dict, raw: dict, command: str) -> str:
    lines = [
        "# Engine host cost per instruction: hippie-ds against stock PipelineEngine",
        "",
        f"Command: `{command}`. Model: {raw['args']['layers']} x Linear({raw['args']['width']}), micro-batch 1, "
        f"{raw['args']['micro_batches']} micro-batches, 2 stages x 1, gloo, {raw['args']['steps']} timed steps "
        f"per engine and round after {raw['args']['warmup']} untimed; load average at the end "
        f"{summary.get('load', 'n/a')}.",
        "",
        "| engine | wall per instruction (us), median over rounds | CPU per instruction (us) | wall / stock, "
        "median (min-max) | CPU / stock |",
        "|---|---|---|---|---|",
    ]
    for name, rounds in summary["per_round"].items():
        wall = statistics.median(v["wall_us"] for v in rounds.values())
        cpu = statistics.median(v["cpu_us"] for v in rounds.values())
        r = summary["ratios"].get(name)
        lines.append(
            f"| `{name}` | {wall:.0f} | {cpu:.0f} | {_spread(r['wall_us']) if r else ''} | "
            f"{_spread(r['cpu_us']) if r else ''} |"
        )
    calls = raw.get("calls_per_instruction") or {}
    if calls:
        lines += [
            "",
            "Python function calls per instruction on rank 0 (cProfile of the last round; deterministic, "
            "not timed): " + ", ".join(f"`{n}` {c:.1f}" for n, c in calls.items()) + ".",
        ]
    lines += ["", "A ratio counts as a difference only when its range excludes 1 (every round agrees)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench host-cost",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: .venv/bin/python -m tools.bench host-cost --rounds 5 --publish docs/bench/host_cost",
    )
    ap.add_argument("--out", default="out/bench/host_cost")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="rank 0's cProfile of each engine's last round")
    ap.add_argument("--publish", default=None, help="copy report.md and host_cost.json here")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    worker_args = [
        "--out",
        out,
        "--rounds",
        args.rounds,
        "--steps",
        args.steps,
        "--micro-batches",
        args.micro_batches,
        "--layers",
        args.layers,
    ] + (["--profile"] if args.profile else [])
    run = LocalJob(WORKER, 2, worker_args, launcher="fork").run(timeout=3600, log=out / "launch.log")
    if run.returncode != 0:
        print(f"host-cost: the job failed (exit {run.returncode}); see {out / 'launch.log'}")
        return 1
    raw = json.loads((out / "host_cost.json").read_text())
    summary = summarize(raw)
    summary["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(summary, raw, " ".join(sys.argv))
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text)
    publish(args.publish, ["report.md", "summary.json"], base=out)
    return 0
