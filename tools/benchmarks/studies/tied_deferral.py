"""Which layer a deferred stage should delay by default when its first layer with parameters is a
word embedding tied to the output head (Megatron-DeepSpeed's ``GPTModelPipe``): a GPT in that shape
(tools/workers/tied_deferral_worker.py), byte-level on Python's own documentation, 2 stages x 2
replicas, every engine trained in turn from the same weights and data, one launch per seed.

    tools/bench.py tied-deferral                       # 3 seeds x 300 steps, 4 engines
    tools/bench.py tied-deferral --seeds 0 --steps 50  # a quick look
    tools/bench.py tied-deferral --report-only --out DIR

Engines: ``stock`` (``deepspeed.initialize``, the synchronous baseline) and ``hippie@L``
(``hippie.deferred_layers`` = L): ``1`` delays stage 0's first layer with parameters, the tied
embedding, and so the output head's copy too (one rule per tied module); ``untied`` its first
layer with parameters that is not tied to another stage (the first transformer block);
``all`` the whole stage. Writes OUT/seedS/{log.txt,ENGINE.json} and OUT/results.{json,md}: per
engine the held-out loss after the last step (``drain()`` first), the mean training loss of
the last 50 steps and of steps 16-25, mean and spread over seeds, and the per-seed ratio to stock.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.study_report import run_and_report
from cluster import LocalJob

REPO = Path(__file__).resolve().parents[3]
WORKER = REPO / "tools" / "workers" / "tied_deferral_worker.py"
ENGINES = "stock,hippie@1,hippie@untied,hippie@all"
LAST = 50  # training steps averaged at the end
EARLY = slice(15, 25)  # steps 16-25: around the 20 iterations of docs/megatron.md's matrix


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools/bench.py tied-deferral", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="out/tied-deferral")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warm-up 5%%, cosine to 10%%)")
    p.add_argument("--engines", default=ENGINES, help=f"comma-separated (default {ENGINES})")
    p.add_argument("--worker-args", default="", help="more worker options, e.g. '--blocks 4 --dim 64'")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per seed's launch")
    p.add_argument("--report-only", action="store_true", help="summarise the runs under --out")
    return p.parse_args(argv)


def run(args) -> None:
    out = Path(args.out)
    for seed in [int(s) for s in args.seeds.split(",")]:
        d = out / f"seed{seed}"
        d.mkdir(parents=True, exist_ok=True)
        start = time.time()
        print(f"[tied-deferral] seed {seed}: {args.engines}, {args.steps} steps -> {d}/log.txt", flush=True)
        job = LocalJob(WORKER, 4, ["--out", d, "--seed", seed, "--steps", args.steps, "--lr", args.lr,
                                   "--engines", args.engines, *args.worker_args.split()])
        res = job.run(args.timeout, log=d / "log.txt")
        print(f"[tied-deferral] seed {seed}: rc {res.returncode}{' (timed out)' if res.timed_out else ''}, "
              f"{time.time() - start:.0f} s", flush=True)


def summarize(out: Path) -> dict:
    """{engine: {heldout, last, ratio_heldout, ratio_last: [per seed], seeds}} from OUT/seed*/*.json."""
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(out.glob("seed*/*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["engine"], {})[r["seed"]] = r
    stock = runs.get("stock", {})
    table = {}
    for name, by_seed in runs.items():
        seeds = sorted(s for s in by_seed if s in stock)
        last = {s: statistics.fmean(by_seed[s]["losses"][-LAST:]) for s in seeds}
        stock_last = {s: statistics.fmean(stock[s]["losses"][-LAST:]) for s in seeds}
        table[name] = {"seeds": seeds, "heldout": [by_seed[s]["heldout"] for s in seeds],
                       "last": [last[s] for s in seeds],
                       "ratio_heldout": [by_seed[s]["heldout"] / stock[s]["heldout"] - 1 for s in seeds],
                       "ratio_last": [last[s] / stock_last[s] - 1 for s in seeds],
                       "ratio_early": [statistics.fmean(by_seed[s]["losses"][EARLY]) /
                                       statistics.fmean(stock[s]["losses"][EARLY]) - 1 for s in seeds],
                       "steps": by_seed[seeds[0]]["args"]["steps"] if seeds else None}
    return table


def _spread(xs: list[float], pct: bool = False) -> str:
    f = (lambda x: f"{100 * x:+.2f}%") if pct else (lambda x: f"{x:.4f}")
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{f(statistics.fmean(xs))} (sd {100 * sd:.2f}%)" if pct else f"{f(statistics.fmean(xs))} (sd {sd:.4f})"


def markdown(table: dict) -> str:
    lines = ["| engine | seeds | held-out loss | vs stock (per seed, mean) | last-50 train loss | vs stock | "
             "train loss at steps 16-25 vs stock |", "|---|---|---|---|---|---|---|"]
    order = sorted(table, key=lambda n: (n != "stock", ENGINES.split(",").index(n) if n in ENGINES.split(",") else 9))
    for name in order:
        t = table[name]
        per = ", ".join(f"{100 * x:+.2f}%" for x in t["ratio_heldout"])
        lines.append(f"| {name} | {len(t['seeds'])} | {_spread(t['heldout'])} | {_spread(t['ratio_heldout'], True)} "
                     f"({per}) | {_spread(t['last'])} | {_spread(t['ratio_last'], True)} | "
                     f"{_spread(t['ratio_early'], True)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_and_report(parse_args(sys.argv[1:] if argv is None else argv), run, summarize, markdown)


if __name__ == "__main__":
    sys.exit(main())
