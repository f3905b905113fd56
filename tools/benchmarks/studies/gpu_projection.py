"""What the simulator predicts on GPUs: scaling from one node to two against the link speed.

``.venv/bin/python tools/bench.py gpu-projection --publish docs/bench/gpu_link_scaling``
(``--help``: the options). The GPU analogue of ``tools/bench.py link-sweep``, from the PipeDream
V100 profiles (VGG-16, GNMT-8): a pipeline of 4 stages per node, one node and two, the planner
choosing micro-batches, partition, re-computation and deferred stages for throughput; the
simulator's step times. On GPUs the all-reduce runs on the device's own engines (NCCL, a side
stream), so no compute core is shared with communication as on the CPU cluster. Pure Python: no
root, no processes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from benchmarks.projection import PROJECTION_MODELS, link_scaling


def parse_args(argv=None):
    what = " The planner and simulator on PipeDream's V100 profiles; no root, no processes."
    p = argparse.ArgumentParser(prog="tools/bench.py gpu-projection", description=__doc__.split("\n\n")[0] + what,
                                epilog="example: .venv/bin/python tools/bench.py gpu-projection --publish "
                                       "docs/bench/gpu_link_scaling",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="10Gbit,1Gbit,250Mbit", help="comma list of inter-node rates")
    p.add_argument("--schedules", default="1f1b,hippie,hippie-1f1b")
    p.add_argument("--devices-per-node", type=int, default=4)
    p.add_argument("--out", default="out/gpu_link_scaling")
    p.add_argument("--publish", default=None, metavar="DIR", help="also write report.md and results.json to DIR")
    return p.parse_args(argv)


def report(rows: list[dict], devices_per_node: int) -> str:
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    lines = ["# Scaling against link speed on GPUs (simulated)", "",
             f"`python tools/bench.py gpu-projection` (PipeDream V100 profiles; {devices_per_node} pipeline stages "
             "per node; scaling = throughput(2 nodes) / (2 x throughput(1 node)); two-node step time in seconds).", "",
             "| model | rate | " + " | ".join(schedules) + " |", "|---|---|" + "---|" * len(schedules)]
    for model, rate in dict.fromkeys((r["model"], r["rate"]) for r in rows):
        cells = {r["schedule"]: f"{r['scaling']:.2f} ({r['step_two_nodes_s']:.3f} s)" for r in rows
                 if (r["model"], r["rate"]) == (model, rate)}
        lines.append(f"| {model} | {rate} | " + " | ".join(cells.get(s, "-") for s in schedules) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    rates, schedules = a.rates.split(","), a.schedules.split(",")
    with tqdm(total=len(PROJECTION_MODELS[:2]) * len(rates) * len(schedules), unit="plan") as bar:
        def progress(what):
            bar.set_description(what)
            bar.update(1)
        rows = link_scaling(rates=rates, schedules=schedules, devices_per_node=a.devices_per_node, progress=progress)
    text = report(rows, a.devices_per_node)
    for d in filter(None, (a.out, a.publish)):
        Path(d).mkdir(parents=True, exist_ok=True)
        Path(d, "results.json").write_text(json.dumps(rows, indent=1))
        Path(d, "report.md").write_text(text)
    print(text)
    return 0
