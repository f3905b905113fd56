"""The rank script of python -m tools.bench multinode: an ordinary DeepSpeed pipeline script, started on every
node by DeepSpeed's own launcher, with ``hippie_ds.initialize`` in place of ``deepspeed.initialize``.

    deepspeed --hostfile H --no_ssh --node_rank N --master_addr A --master_port P \\
        tools/bench/workers/multinode_worker.py --deepspeed_config configs/hippie.json --out DIR --steps 3

A tiny ``PipelineModule`` (5 layers, about 500 parameters) in 2 stages, placed with
``hippie_ds.make_topology`` (the pipeline inside a node, data parallelism across nodes), trained
for ``--steps`` ``train_batch`` calls on synthetic data (the same on every run: drawn from the
step, replica and micro-batch). Every rank writes ``DIR/rank{R}.json``: where it ran (node, local
rank, stage, replica, gloo's interface, network namespace) and the loss ``train_batch`` returned
at every step; the driver checks that all ranks agree. Rank 0 prints one line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule

import hippie_ds

IN, WIDTH, OUT = 8, 16, 4


def layer_specs():
    return [
        LayerSpec(torch.nn.Linear, IN, WIDTH),
        LayerSpec(torch.nn.Tanh),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
        LayerSpec(torch.nn.Tanh),
        LayerSpec(torch.nn.Linear, WIDTH, OUT),
    ]


def batches(replica: int, micro_batch: int, micro_batches: int):
    """This replica's micro-batches, step after step: y = tanh(x A) for a fixed A, plus noise."""
    a = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    step = 0
    while True:
        for m in range(micro_batches):
            g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + m)
            x = torch.randn(micro_batch, IN, generator=g)
            yield x, torch.tanh(x @ a) + 0.01 * torch.randn(micro_batch, OUT, generator=g)
        step += 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--out", required=True, help="directory for rank{R}.json")
    p.add_argument("--steps", type=int, default=3, help="train_batch calls")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (inside a node)")
    p.add_argument("--schedule", help="override the config's pipeline.schedule")
    deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    args.deepspeed_config = None  # passed as a dict below
    config["steps_per_print"] = 10**9  # this script prints its own lines
    if args.schedule:
        config.setdefault("pipeline", {})["schedule"] = args.schedule

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = PipelineModule(
        layers=layer_specs(),
        num_stages=args.stages,
        loss_fn=torch.nn.functional.mse_loss,
        topology=hippie_ds.make_topology(args.stages, world),
        partition_method="uniform",
        seed_layers=True,
        base_seed=1234,
    )
    engine, _, _, _ = hippie_ds.initialize(
        args=args, model=model, config=config, model_parameters=[q for q in model.parameters() if q.requires_grad]
    )
    data = batches(engine.grid.data_parallel_id, engine.train_micro_batch_size_per_gpu(), engine.micro_batches)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        losses.append(float(engine.train_batch(data)))
        if rank == 0:
            print(
                f"[multinode] step {step}/{args.steps}: loss {losses[-1]:.6f} ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    finish = getattr(engine, "drain", None)
    if finish is not None:
        finish()  # a deferred stage's last buffered gradient is applied, not lost

    record = {
        "rank": rank,
        "world_size": world,
        "node": int(os.environ.get("CROSS_RANK", -1)),
        "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "stage": engine.stage_id,
        "replica": engine.grid.data_parallel_id,
        "schedule": engine.compiled_schedule.name,
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "netns": os.readlink("/proc/self/ns/net"),
        "losses": losses,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    print(
        f"[multinode] rank {rank}: node {record['node']}, stage {record['stage']}, replica {record['replica']}, "
        f"gloo on {record['gloo_socket_ifname']}: done",
        flush=True,
    )
    dist.barrier()


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
