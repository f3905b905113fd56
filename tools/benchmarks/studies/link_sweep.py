"""Scaling against link speed: ``tools/bench.py`` once per inter-node rate, collated.

``sudo .venv/bin/python tools/bench.py link-sweep --publish docs/bench/link_sweep`` (``--help``:
the options).

For each rate (tc-shaped veth between the two emulated nodes) it runs the benchmark's one-node and
two-node runs of every schedule (two-node runs in interleaved rounds), then reports, per schedule
and rate: two-node step time, its ratio to stock 1F1B (median of rounds, min-max spread, "real"
when the spread excludes 1), scaling efficiency from one node to two (throughput(two nodes) / (2 x
throughput(one node))), and the simulator's predicted step time, its error, and the scaling it
implies. Where the all-reduce goes: the exposed all-reduce per step (the slowest stage's wait on
it), how busy the ranks' cores were over a step (median; all processes and the kernel: 1 leaves
no idle time for hidden communication to use), and each compute op's inflation, its median
duration on two nodes over one node (the one-node run is node 0's ranks alone: the same stages on
the same core, with no inter-node link, so an inflation above 1 is compute slowed by the
communication it overlaps). Writes ``report.md``,
``results.json`` and ``scaling.png`` (measured and predicted scaling efficiency against the rate).
Needs root (as bench.py). Not a test.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ..publish import publish

REPO = Path(__file__).resolve().parents[3]
BITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
COMPUTE_OPS = {"ForwardPass": "F", "BackwardPass": "B", "BackwardInputPass": "I", "BackwardWeightPass": "W"}


def rate_bits(rate: str) -> float:
    for unit, scale in BITS.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise SystemExit(f"--rates: {rate!r}: expected a tc rate such as 10gbit, 1gbit or 250mbit")


def run_rate(a, rate: str) -> None:
    """tools/bench.py at one rate (with --analyze-only: its analysis of the earlier run again)."""
    cmd = [sys.executable, str(REPO / "tools" / "bench.py"), "--schedules", a.schedules, "--rounds", str(a.rounds),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--no-single", "--no-projection", "--rate", rate,
           "--out", str(Path(a.out, rate))] + (["--analyze-only"] if a.analyze_only else [])
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL if a.analyze_only else None)


def compute_inflation(two: dict, one: dict) -> dict[str, dict[str, float]]:
    """{stage: {op: median on two nodes / median on one node}} for the compute ops."""
    out = {}
    for stage, ops in (two.get("stage_timings_s") or {}).items():
        base = (one.get("stage_timings_s") or {}).get(stage, {})
        out[stage] = {op: ops[op] / base[op] for op in COMPUTE_OPS if ops.get(op) and base.get(op)}
    return out


def collate(a) -> dict:
    rows = []
    for rate in a.rates.split(","):
        res = json.loads(Path(a.out, rate, "results.json").read_text())
        two, one = res["runs"]["two_nodes"], res["runs"].get("one_node", {})
        for name, fig in res["summary"]["schedules"].items():
            run = two.get(name, {})
            pred = run.get("prediction") or {}
            one_thr = (one.get(name) or {}).get("throughput_samples_s")
            inflation = compute_inflation(run, one.get(name) or {})
            exposed = (run.get("exposed_allreduce_s_per_step") or {}).values()
            pred_thr = run["samples_per_step"] / pred["step_time"] if pred.get("step_time") else None
            rows.append({
                "rate": rate, "rate_bits": rate_bits(rate), "schedule": name,
                "step_s": run.get("median_step_s"), "ratio_to_1f1b": fig.get("ratio_to_1f1b"),
                "ratio_min": fig.get("ratio_to_1f1b_min"), "ratio_max": fig.get("ratio_to_1f1b_max"),
                "real_vs_1f1b": fig.get("real_vs_1f1b"), "scaling": fig.get("scaling_efficiency"),
                "predicted_step_s": pred.get("step_time"), "prediction_error": pred.get("error"),
                "predicted_scaling": pred_thr / (2 * one_thr) if pred_thr and one_thr else None,
                "schedule_params": run.get("schedule_params", {}),
                "exposed_allreduce_s": max(exposed, default=None), "core_busy": run.get("core_busy"),
                "compute_inflation": inflation,
                "max_compute_inflation": max((x for ops in inflation.values() for x in ops.values()), default=None),
            })
    return {"rates": a.rates.split(","), "schedules": a.schedules.split(","), "rows": rows}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def report(res: dict) -> str:
    lines = ["# Scaling against link speed", "", "`sudo python tools/bench.py link-sweep` (two emulated nodes x 2 "
             "ranks; ratios are throughput ratios to stock 1F1B per round: median [min, max]; real = the "
             "spread excludes 1).", ""]
    for rate in res["rates"]:
        lines += [f"## {rate}", "", "| schedule | step (s) | vs 1f1b | real | scaling 1 -> 2 nodes | simulated step (s) "
                  "| error | simulated scaling | exposed all-reduce (s/step) | core busy | compute inflation (max) | params |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in res["rows"] if r["rate"] == rate):
            ratio = f"{_f(r['ratio_to_1f1b'], '.3f')} [{_f(r['ratio_min'], '.3f')}, {_f(r['ratio_max'], '.3f')}]"
            lines.append(f"| {r['schedule']} | {_f(r['step_s'], '.3f')} | {ratio} | {r['real_vs_1f1b']} | "
                         f"{_f(r['scaling'], '.2f')} | {_f(r['predicted_step_s'], '.3f')} | "
                         f"{_f(r['prediction_error'], '+.1%')} | {_f(r['predicted_scaling'], '.2f')} | "
                         f"{_f(r.get('exposed_allreduce_s'), '.3f')} | {_f(r.get('core_busy'), '.2f')} | "
                         f"{_f(r.get('max_compute_inflation'), '.3f')} | "
                         f"{r['schedule_params'] or ''} |")
        lines.append("")
    stages = sorted({s for r in res["rows"] for s in (r.get("compute_inflation") or {})})
    lines += ["## Compute inflation per op", "", "Median duration on two nodes over one node, per stage "
              "(F forward, B backward, I/W its input and weight halves).", "",
              "| rate | schedule | " + " | ".join(f"stage {s}" for s in stages) + " |", "|---|---|" + "---|" * len(stages)]
    for r in res["rows"]:
        inflation = r.get("compute_inflation") or {}
        cells = [", ".join(f"{COMPUTE_OPS[op]} {x:.2f}" for op, x in inflation.get(s, {}).items()) for s in stages]
        lines.append(f"| {r['rate']} | {r['schedule']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(res["schedules"]):
        rows = sorted((r for r in res["rows"] if r["schedule"] == name and r["scaling"] is not None),
                      key=lambda r: r["rate_bits"])
        if not rows:
            continue
        xs = [r["rate_bits"] / 1e9 for r in rows]
        line, = ax.plot(xs, [r["scaling"] for r in rows], "o-", label=f"{name} measured")
        pred = [(x, r["predicted_scaling"]) for x, r in zip(xs, rows) if r["predicted_scaling"] is not None]
        if pred:
            ax.plot(*zip(*pred), "x--", color=line.get_color(), label=f"{name} simulated")
    ax.set_xscale("log")
    ax.set_xlabel("inter-node link (Gbit/s)")
    ax.set_ylabel("scaling efficiency, one node to two")
    ax.axhline(0.9, color="grey", lw=0.6, ls=":")
    ax.axhline(0.8, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/bench.py link-sweep",
                                description="Scaling against link speed: the cluster bench (tools/bench.py, two-node "
                                            "and one-node runs, no projection) once per inter-node tc rate, collated: "
                                            "ratio to stock 1F1B, scaling 1 -> 2 nodes, simulator error, exposed "
                                            "all-reduce, compute inflation. Writes report.md, results.json and "
                                            "scaling.png. Needs root (as tools/bench.py), except --analyze-only.",
                                epilog="example: sudo .venv/bin/python tools/bench.py link-sweep --rates 1gbit,250mbit "
                                       "--publish docs/bench/link_sweep",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="10gbit,1gbit,250mbit", help="comma list of tc rates")
    p.add_argument("--schedules", default="dp,1f1b,hippie-1f1b,zb-h1,hippie-zb")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="out/bench_link")
    p.add_argument("--publish", default=None, help="also copy report.md, results.json and scaling.png here")
    p.add_argument("--analyze-only", action="store_true", help="analyse the earlier runs in --out again (no root)")
    a = p.parse_args(argv)
    for rate in a.rates.split(","):
        rate_bits(rate)
        run_rate(a, rate)
    res = collate(a)
    out = Path(a.out)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    text = report(res)
    (out / "report.md").write_text(text)
    plot(res, out / "scaling.png")
    print(text)
    publish(a.publish, ("report.md", "results.json", "scaling.png"), base=out)
    return 0
