"""Rank worker of ``python -m tools.bench allreduce`` (tools/bench/studies/allreduce.py): 2 nodes x 2 ranks,
the two data-parallel pairs of a 2-stage pipeline ({0, 2} and {1, 3}, one rank of each per node).
Times a gloo all-reduce of ``--megabytes`` MB in one pair alone, then in both pairs at once,
``--repeats`` times each, a world barrier before every repeat. Writes OUT/rank{R}.json with the
seconds of its own all-reduces, the CPU seconds its process spent in them (all threads: gloo's
included) and, on rank 0, the machine's busy core-seconds over each repeat (/proc/stat: what the
all-reduces take from compute on a shared machine, the kernel's network work included)."""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tools.bench.cluster import core_ticks  # the repository root is on PYTHONPATH (cluster.local_env)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--megabytes", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=0.0)
    return p.parse_args()


def timed(group, tensor, active: bool, idle_s: float = 0.0) -> dict:
    """One repeat between two world barriers: this rank's wall and CPU seconds in its all-reduce
    (None when it sits this one out) and the machine's busy core-seconds over the whole repeat.
    ``idle_s``: the link idles that long first (tc's token bucket refills, as between a
    pipeline step's all-reduces)."""
    dist.barrier()
    time.sleep(idle_s)
    busy0 = core_ticks()[0]
    wall = cpu = None
    if active:
        t0, c0 = time.perf_counter(), time.process_time()
        dist.all_reduce(tensor, group=group)
        if tensor.is_cuda:
            torch.cuda.synchronize()  # NCCL returns once the kernel is queued
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    dist.barrier()
    return {"s": wall, "cpu_s": cpu, "machine_busy_s": (core_ticks()[0] - busy0) / os.sysconf("SC_CLK_TCK")}


def main():
    a = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = rank % 2  # pair 0: ranks 0 and 2 (stage 0); pair 1: ranks 1 and 3 (stage 1)
    tensor = torch.ones(int(a.megabytes * 1e6 / 4))
    timed(pairs[mine], tensor, True)  # warm-up: connections made
    one = [timed(pairs[mine], tensor, mine == 0, a.idle_s) for _ in range(a.repeats)]
    two = [timed(pairs[mine], tensor, True, a.idle_s) for _ in range(a.repeats)]
    record = {
        "rank": rank,
        "pair": mine,
        "bytes": tensor.numel() * 4,
        "one": [r["s"] for r in one],
        "two": [r["s"] for r in two],
        "one_cpu": [r["cpu_s"] for r in one],
        "two_cpu": [r["cpu_s"] for r in two],
    }
    if rank == 0:  # the same machine for every rank: one reading is enough
        record["one_machine_busy"] = [r["machine_busy_s"] for r in one]
        record["two_machine_busy"] = [r["machine_busy_s"] for r in two]
    finish(a.out, rank, record)


def finish(out: str, rank: int, record: dict):
    """After every rank is done: OUT/rank{R}.json, and the process group torn down."""
    dist.barrier()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
