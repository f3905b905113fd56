"""The training state per rank that ZeRO-1 saves, on each optimizer path hippie-ds runs: the GPT
example at 2 stages x 2 replicas (tools/workers/zero_memory_worker.py), one launch per engine (a
fresh process: nothing of another engine is still alive when a rank counts its tensors).

    tools/bench.py zero-memory                     # 4 precisions x stock, 1f1b, hippie
    tools/bench.py zero-memory --report-only --out DIR

Counted after ``--steps`` steps, between steps: every live tensor storage once, as parameters,
their ``.grad`` and the rest (optimizer state, fp32 masters, flat partitions and accumulators,
hippie's gradient buffer). Exact byte counts, not timings: one run suffices. Writes
OUT/ENGINE/rankR.json, OUT/log-ENGINE.txt and OUT/results.{json,md} (per engine and stage, bytes
per rank, mean over the stage's replicas, and the ratio to the same schedule without ZeRO).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.study_report import run_and_report
from cluster import LocalJob

REPO = Path(__file__).resolve().parents[3]
WORKER = REPO / "tools" / "workers" / "zero_memory_worker.py"
PRECISIONS = ("fp32", "fp32-zero1", "bf16-zero1", "bf16-plain-zero1")
SCHEDULES = ("stock", "1f1b", "hippie")
# the same schedule without ZeRO: the reference of each precision's ratio
BASE = {"fp32": "fp32", "fp32-zero1": "fp32", "bf16-zero1": "fp32", "bf16-plain-zero1": "fp32"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools/bench.py zero-memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="out/zero-memory")
    p.add_argument("--engines", default=",".join(f"{p}:{s}" for p in PRECISIONS for s in SCHEDULES),
                   help="PRECISION:SCHEDULE,... (precisions: " + ", ".join(PRECISIONS) + ")")
    p.add_argument("--worker-args", default="", help="more worker options, e.g. '--dim 512 --layers 8'")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--report-only", action="store_true", help="summarise the runs under --out")
    return p.parse_args(argv)


def run(args) -> None:
    from tqdm import tqdm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for engine in tqdm(args.engines.split(","), desc="zero-memory", unit="engine"):
        res = LocalJob(WORKER, 4, ["--out", out, "--engines", engine, *args.worker_args.split()]).run(
            args.timeout, log=out / f"log-{engine.replace(':', '-')}.txt")
        if res.returncode != 0:
            print(f"[zero-memory] {engine}: rc {res.returncode}; see {out}/log-{engine.replace(':', '-')}.txt")


def summarize(out: Path) -> dict:
    """{engine: {stage: {params, grads, other, total (mean bytes per rank), optimizer, ranks}}}."""
    table: dict = {}
    for f in sorted(out.glob("*/rank*.json")):
        r = json.loads(f.read_text())
        table.setdefault(r["engine"], {}).setdefault(r["stage"], []).append(r)
    return {engine: {stage: {k: statistics.fmean(r[k] for r in rs) for k in ("params", "grads", "other", "total")}
                     | {"optimizer": rs[0]["optimizer"], "ranks": len(rs), "parameters": rs[0]["parameters"],
                        "largest_other": rs[0].get("largest_other")}
                     for stage, rs in sorted(stages.items())} for engine, stages in table.items()}


def markdown(table: dict) -> str:
    lines = ["| engine | optimizer | stage | parameters | params MB | grads MB | other MB | total MB | "
             "vs same schedule fp32 without ZeRO |", "|---|---|---|---|---|---|---|---|---|"]
    for engine in sorted(table, key=lambda e: (PRECISIONS.index(e.split(":")[0]) if e.split(":")[0] in PRECISIONS
                                               else 9, e.split(":")[1])):
        precision, schedule = engine.split(":")
        base = table.get(f"{BASE.get(precision, 'fp32')}:{schedule}", {})
        for stage, t in table[engine].items():
            ref = base.get(stage, {}).get("total")
            ratio = f"{t['total'] / ref:.3f}x" if ref else "-"
            lines.append(f"| {engine} | {t['optimizer']} | {stage} | {t['parameters']:,} | {t['params'] / 1e6:.2f} | "
                         f"{t['grads'] / 1e6:.2f} | {t['other'] / 1e6:.2f} | {t['total'] / 1e6:.2f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_and_report(parse_args(sys.argv[1:] if argv is None else argv), run, summarize, markdown)


if __name__ == "__main__":
    sys.exit(main())
