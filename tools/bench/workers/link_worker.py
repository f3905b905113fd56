"""Rank worker of the scaling bench's link calibration (tools/bench/studies/link_calibration.py).

NODES x RPN ranks (rank = node x RPN + local). Times, ``--repeats`` times each and alone on the
link, a gloo all-reduce of ``--stage-bytes`` bytes over one stage's data-parallel group (local
rank ``--stage`` of every node: what a pipeline stage all-reduces), every stage's at once
(``--stages-bytes``, local rank s all-reducing its entry s over its group: how a pipeline's step
ends) and one of ``--all-bytes`` bytes over every rank (what DP all-reduces), a world barrier
around every repeat. Writes OUT/rank{R}.json with the seconds of the all-reduces it took part in.
gloo on CPU tensors; NCCL on the rank's GPU where cluster.node_env set DS_ACCELERATOR=cuda."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tools.bench.workers.allreduce_worker import finish, timed  # one timed all-reduce between world barriers


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--rpn", type=int, required=True, help="ranks per node")
    p.add_argument("--stage", type=int, required=True, help="the local rank whose group is timed")
    p.add_argument("--stage-bytes", type=int, required=True)
    p.add_argument("--all-bytes", type=int, required=True)
    p.add_argument(
        "--stages-bytes",
        default="",
        help="comma-separated bytes of each stage (local rank) for the concurrent shape; empty: not timed",
    )
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def main():
    a = parse_args()
    torch.set_num_threads(1)
    cuda = os.environ.get("DS_ACCELERATOR") == "cuda"  # cluster.node_env: one GPU per rank, NCCL
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", a.local_rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    # every rank creates every group, in the same order (torch.distributed's rule)
    groups = [dist.new_group(list(range(s, world, a.rpn))) for s in range(a.rpn)]
    stage_ranks = list(range(a.stage, world, a.rpn))
    stages_bytes = [int(b) for b in a.stages_bytes.split(",") if b]
    local = rank % a.rpn
    record = {
        "rank": rank,
        "world": world,
        "stage_ranks": stage_ranks,
        "stage_bytes": a.stage_bytes,
        "stages_bytes": stages_bytes,
        "all_bytes": a.all_bytes,
    }
    shapes = [("stage", groups[a.stage], rank in stage_ranks, a.stage_bytes)]
    if stages_bytes:  # every rank runs every shape: timed's world barriers
        member = local < len(stages_bytes)
        shapes.append(("stages", groups[local], member, stages_bytes[local] if member else 4))
    shapes.append(("all", dist.group.WORLD, True, a.all_bytes))
    for name, group, member, nbytes in shapes:
        tensor = torch.ones(max(1, nbytes // 4), device=device)
        timed(group, tensor, member)  # warm-up: connections made
        times = [timed(group, tensor, member)["s"] for _ in range(a.repeats)]
        record[name] = times if member else None
    finish(a.out, rank, record)


if __name__ == "__main__":
    main()
