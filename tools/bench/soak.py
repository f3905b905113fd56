"""Soak check: a long hippie-ds run keeps its memory and handles flat.

Launches tools/bench/workers/soak_worker.py on 4 local ranks (2 stages x 2 replicas, gloo) with DeepSpeed's
launcher, trains --steps steps with per-rank timelines on, and compares each rank's samples after
the warm-up with its last one: resident memory (growth must stay under --max-rss-growth, 1%),
open file descriptors, threads and /dev/shm entries (must not grow), timeline events kept (must
stop growing once --timeline-steps steps are recorded). Prints a table, writes OUT/report.json,
exits 1 if a check fails.

    python -m tools.bench soak --steps 1000 --schedule hippie
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tools.bench import WORKERS
from tools.bench.cluster import LocalJob

WORKER = WORKERS / "soak_worker.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench soak",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="out/soak", help="output directory")
    p.add_argument("--schedule", default="hippie", help="pipeline.schedule of the run")
    p.add_argument("--steps", type=int, default=1000, help="train_batch calls")
    p.add_argument("--warmup", type=int, default=200, help="steps before the baseline sample")
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument("--timeline-steps", type=int, default=100, help="hippie.timeline_steps of the run")
    p.add_argument("--max-rss-growth", type=float, default=0.01, help="allowed RSS growth after warm-up (fraction)")
    p.add_argument("--timeout", type=int, default=1800)
    args = p.parse_args(argv)
    if args.steps <= args.warmup or args.warmup % args.sample_every:
        p.error(
            f"--warmup {args.warmup} must be a multiple of --sample-every {args.sample_every} and less "
            f"than --steps {args.steps}"
        )
    return args


def run_job(args, out: Path) -> None:
    job = LocalJob(
        WORKER,
        4,
        [
            "--out",
            out,
            "--schedule",
            args.schedule,
            "--steps",
            args.steps,
            "--sample-every",
            args.sample_every,
            "--timeline-steps",
            args.timeline_steps,
        ],
    )
    log = out / "log.txt"
    run = job.run(args.timeout, log=log)  # the ranks' output, rank 0's progress bar included, goes to the log
    if run.timed_out:
        raise SystemExit(f"soak: the job ran past --timeout {args.timeout} s; log: {log}")
    if run.returncode != 0:
        raise SystemExit(f"soak: the job failed (exit {run.returncode}); log: {log}\n" + log.read_text()[-3000:])


def analyze(args, out: Path) -> dict:
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != 4:
        raise SystemExit(f"soak: expected 4 rank files in {out}, found {len(ranks)}")
    rows, ok = [], True
    for r in ranks:
        by_step = {s["step"]: s for s in r["samples"]}
        base, last = by_step[args.warmup], r["samples"][-1]
        row = {
            "rank": r["rank"],
            "stage": r["stage"],
            "rss_base_mb": base["rss"] / 2**20,
            "rss_last_mb": last["rss"] / 2**20,
            "rss_growth": last["rss"] / base["rss"] - 1,
            **{
                f"{k}_growth": max(s[k] for s in r["samples"] if s["step"] >= args.warmup) - base[k]
                for k in ("fds", "threads", "os_threads", "shm")
            },
            "timeline_steps_kept": last["timeline_steps"],
            "timeline_events_kept": last["timeline_events"],
        }
        row["ok"] = (
            row["rss_growth"] < args.max_rss_growth
            and all(row[f"{k}_growth"] <= 0 for k in ("fds", "threads", "os_threads", "shm"))
            and row["timeline_steps_kept"] <= args.timeline_steps
        )
        ok &= row["ok"]
        rows.append(row)
    return {
        "schedule": args.schedule,
        "steps": args.steps,
        "warmup": args.warmup,
        "timeline_steps": args.timeline_steps,
        "max_rss_growth": args.max_rss_growth,
        "ok": ok,
        "ranks": rows,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    start = time.monotonic()
    print(f"soak: {args.steps} steps of {args.schedule} on 2 stages x 2 replicas; log {out / 'log.txt'}", flush=True)
    run_job(args, out)
    report = analyze(args, out)
    report["seconds"] = time.monotonic() - start
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(
        f"| rank | stage | RSS at step {args.warmup} (MiB) | at step {args.steps} | growth | fds | threads | "
        f"/dev/shm | timeline steps kept |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["ranks"]:
        print(
            f"| {r['rank']} | {r['stage']} | {r['rss_base_mb']:.1f} | {r['rss_last_mb']:.1f} | "
            f"{100 * r['rss_growth']:+.2f}% | {r['fds_growth']:+d} | {r['threads_growth']:+d}/"
            f"{r['os_threads_growth']:+d} | {r['shm_growth']:+d} | {r['timeline_steps_kept']} |"
        )
    print(f"soak: {'OK' if report['ok'] else 'FAILED'} ({report['seconds']:.0f} s); {out / 'report.json'}")
    return 0 if report["ok"] else 1
