"""Benchmark: plan a synthetic 1,000-layer profile for 1,024 devices (64 nodes x 16).

Not a timed test: prints the wall time of ``make_plan`` (median of several runs) and the plan
found. Usage: ``python -m tools.bench planner [--layers 1000] [--nodes 64] [--devices-per-node 16]
[--global-batch 8192] [--runs 5] [--no-baselines]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hippie_ds.planner import Cluster, make_plan, synthetic_profile


def main(argv=None) -> int:
    what = " Prints the median wall time of make_plan and the plan found; not a test."
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench planner",
        description=__doc__.split("\n\n")[0] + what,
        epilog="example: .venv/bin/python -m tools.bench planner --layers 200 --runs 3",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--layers", type=int, default=1000, help="layers of the synthetic profile")
    ap.add_argument("--nodes", type=int, default=64, help="nodes of the cluster planned for")
    ap.add_argument("--devices-per-node", type=int, default=16, help="devices per node (80 GB each)")
    ap.add_argument("--global-batch", type=int, default=8192, help="samples per step")
    ap.add_argument("--runs", type=int, default=5, help="plans timed (the median is reported)")
    ap.add_argument("--no-baselines", action="store_true", help="plan only, without the baseline comparisons")
    args = ap.parse_args(argv)

    profile = synthetic_profile(args.layers, seed=1)
    cluster = Cluster(
        nodes=args.nodes,
        devices_per_node=args.devices_per_node,
        device_memory=80e9,
        inter_node_bandwidth=25e9,
        intra_node_bandwidth=300e9,
        latency=5e-6,
    )
    times, plan = [], None
    for _ in range(args.runs):
        t0 = time.perf_counter()
        plan = make_plan(profile, cluster, args.global_batch, baselines=not args.no_baselines)
        times.append(time.perf_counter() - t0)
    print(plan.summary())
    print()
    print(
        f"planned {args.layers} layers for {cluster.devices} devices: median {statistics.median(times):.3f} s "
        f"(min {min(times):.3f}, max {max(times):.3f}, {args.runs} runs); "
        f"{plan.search['configurations_bounded']} configurations bounded, "
        f"{plan.search['configurations_evaluated']} evaluated, {plan.search['simulated']} simulated"
    )
    return 0
