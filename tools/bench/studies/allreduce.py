"""All-reduce bandwidth on the emulated two-node link: one data-parallel pair alone, and the two
pairs of a 2-stage pipeline at once (what a schedule does when both stages all-reduce together).

``sudo .venv/bin/python -m tools.bench allreduce`` (``--help``: the options). For each tc rate it
starts 2 emulated nodes x 2 ranks (tools/bench/workers/allreduce_worker.py) and reports the median time
of a gloo all-reduce of ``--megabytes`` MB and its efficiency: the bytes each rank sends across the
link (a two-rank all-reduce sends the whole buffer each way; two pairs share the link) over the
shaped rate, divided by the time. The benchmark's simulator takes one efficiency (``python -m tools.bench
--link-efficiency``); this measures whether one flow and two flows get the same. It also reports
what an all-reduce costs the CPU: each rank's process CPU seconds in it (gloo's threads included)
and the machine's busy core-seconds over it (the kernel's TCP and tc work included), i.e. the
compute time an all-reduce hidden behind compute takes from cores that compute shares. Needs root.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tools.bench import WORKERS
from tools.bench.cluster import Network, WorkerJob, cleanup_on_signals, parse_rate, preflight
from tools.bench.publish import publish

WORKER = WORKERS / "allreduce_worker.py"
NETWORK = Network(("hdsa-node0", "hdsa-node1"), ("hdsa-veth0", "hdsa-veth1"), ("10.79.0.1", "10.79.0.2"))


def parse_args(argv=None):
    what = (
        " Median time, efficiency against the shaped rate and CPU cost, per rate. Needs root (except --analyze-only)."
    )
    p = argparse.ArgumentParser(
        prog="python -m tools.bench allreduce",
        description=__doc__.split("\n\n")[0] + what,
        epilog="example: sudo .venv/bin/python -m tools.bench allreduce --rates 1gbit,250mbit "
        "--publish docs/bench/allreduce",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rates", default="10gbit,1gbit,250mbit", help="comma list of tc rates")
    p.add_argument("--megabytes", type=float, default=25.0, help="all-reduce size (the bench model's stage: 25 MB)")
    p.add_argument("--repeats", type=int, default=12, help="timed all-reduces per setting and rate")
    p.add_argument(
        "--burst",
        choices=["default", "min"],
        default="default",
        help="tbf's token bucket (tools/bench/cluster burst_for): default 1mb, min the least the kernel takes",
    )
    p.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="seconds the link idles before each timed all-reduce (tc's token bucket, --burst of the "
        "cluster, refills meanwhile, as between a pipeline step's all-reduces)",
    )
    p.add_argument("--cores", default="0,1", help="core of node 0, core of node 1")
    p.add_argument("--port", type=int, default=29710)
    p.add_argument("--out", default="out/bench_allreduce")
    p.add_argument("--publish", default=None, metavar="DIR", help="also copy results.json and report.md to DIR")
    p.add_argument("--analyze-only", action="store_true", help="summarize the rank files of an earlier run in --out")
    return p.parse_args(argv)


def report(rows: list[dict], megabytes: float) -> str:
    lines = [
        "# All-reduce on the emulated link",
        "",
        "`sudo python -m tools.bench allreduce` (2 emulated nodes x 2 "
        "ranks; median of the repeats; efficiency = bytes each rank sends across the link, per pair sharing "
        "it, over the shaped rate, divided by the time).",
        "",
        f"| rate | {megabytes:g} MB, one pair (s) | efficiency | two pairs at once (s) | efficiency |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['one_pair_s']:.3f} | {r['one_pair_efficiency']:.2f} | "
            f"{r['two_pairs_s']:.3f} | {r['two_pairs_efficiency']:.2f} |"
        )
    lines += [
        "",
        "What it costs the CPU: a rank's process CPU seconds in its all-reduce (all threads; median), and "
        "the machine's busy core-seconds over a repeat (all processes and the kernel; mean, /proc/stat "
        "counts 10 ms ticks).",
        "",
        "| rate | one pair: CPU per rank (s) | machine busy (core-s) | two pairs: CPU per rank (s) | "
        "machine busy (core-s) | per core per MB (ms): `--allreduce-cpu-per-mb` |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['one_pair_cpu_s']:.3f} | {r['one_pair_machine_busy_s']:.3f} | "
            f"{r['two_pairs_cpu_s']:.3f} | {r['two_pairs_machine_busy_s']:.3f} | "
            f"{r['cpu_per_mb'] * 1e3:.2f} |"
        )
    return "\n".join(lines) + "\n"


def summarize(records: list[dict], rate: str) -> dict:
    """Median seconds and efficiency of one pair alone and of two pairs at once."""
    n_bytes = records[0]["bytes"]
    line = parse_rate(rate)  # bytes/s
    one = statistics.median(t for r in records for t in r["one"] if t is not None)
    two = statistics.median(t for r in records for t in r["two"])
    machine = next(r for r in records if "one_machine_busy" in r)
    row = {
        "rate": rate,
        "bytes": n_bytes,
        "one_pair_s": one,
        "two_pairs_s": two,
        "one_pair_efficiency": n_bytes / line / one,
        "two_pairs_efficiency": 2 * n_bytes / line / two,
        "one_pair_cpu_s": statistics.median(t for r in records for t in r["one_cpu"] if t is not None),
        "two_pairs_cpu_s": statistics.median(t for r in records for t in r["two_cpu"]),
        # the mean: /proc/stat counts in clock ticks (10 ms), a repeat lasts 20 ms to 1.6 s
        "one_pair_machine_busy_s": statistics.fmean(machine["one_machine_busy"]),
        "two_pairs_machine_busy_s": statistics.fmean(machine["two_machine_busy"]),
    }
    # what a stage's all-reduce in flight takes from its core, per MB (python -m tools.bench
    # --allreduce-cpu-per-mb): both pairs at once, each of the 2 cores holding one rank of each
    row["cpu_per_mb"] = row["two_pairs_machine_busy_s"] / 2 / (n_bytes / 1e6)
    return row


def load_rate(a, rate: str) -> dict:
    return summarize([json.loads(f.read_text()) for f in sorted(Path(a.out, rate).glob("rank*.json"))], rate)


def run_rate(a, rate: str, i: int) -> dict:
    out = Path(a.out, rate)
    NETWORK.setup(rate, a.burst)
    job = WorkerJob(
        NETWORK,
        WORKER,
        ["--out", str(out), "--megabytes", str(a.megabytes), "--repeats", str(a.repeats), "--idle-s", str(a.idle_s)],
        out / "logs",
        2,
        2,
        a.cores.split(","),
        a.port + i,
    )
    try:
        job.run(600)  # RuntimeError with the logs' last lines if a launcher fails
    finally:
        NETWORK.teardown()
    return load_rate(a, rate)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.analyze_only:
        rows = [load_rate(a, rate) for rate in a.rates.split(",")]
    else:
        preflight("this benchmark", ("ip", "tc", "taskset"))
        with cleanup_on_signals(NETWORK.teardown):
            rows = [run_rate(a, rate, i) for i, rate in enumerate(a.rates.split(","))]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "report.md").write_text(report(rows, a.megabytes))
    print(report(rows, a.megabytes))
    publish(a.publish, ("results.json", "report.md"), base=out)
    return 0
