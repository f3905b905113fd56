"""Rank worker of tools/bench_allreduce.py: 2 nodes x 2 ranks, the two data-parallel pairs of a
2-stage pipeline ({0, 2} and {1, 3}, one rank of each per node). Times a gloo all-reduce of
``--megabytes`` MB in one pair alone, then in both pairs at once, ``--repeats`` times each, a world
barrier before every repeat. Writes OUT/rank{R}.json with the seconds of its own all-reduces."""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--megabytes", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def timed(group, tensor, active: bool) -> float | None:
    dist.barrier()
    if not active:
        return None
    t0 = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    return time.perf_counter() - t0


def main():
    a = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = rank % 2  # pair 0: ranks 0 and 2 (stage 0); pair 1: ranks 1 and 3 (stage 1)
    tensor = torch.ones(int(a.megabytes * 1e6 / 4))
    timed(pairs[mine], tensor, True)  # warm-up: connections made
    record = {"rank": rank, "pair": mine, "bytes": tensor.numel() * 4,
              "one": [timed(pairs[mine], tensor, mine == 0) for _ in range(a.repeats)],
              "two": [timed(pairs[mine], tensor, True) for _ in range(a.repeats)]}
    dist.barrier()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
