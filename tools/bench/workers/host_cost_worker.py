"""Rank worker of ``python -m tools.bench host-cost``: the engine's host time per instruction.

A model whose compute is negligible (``--layers`` Linear(``--width``) layers, micro-batch 1) on 2
stages x 1 replica, so a step's wall time is the engines' own Python and DeepSpeed's per
instruction. Engines built once each in these processes: ``stock`` (``deepspeed.initialize``,
DeepSpeed's TrainSchedule) and ``1f1b`` (``hippie_ds.initialize``, the same order compiled from
schedules/1f1b.yaml); then ``--rounds`` rounds, each running every engine for ``--steps`` steps,
the order rotated per round. Per step and rank: wall and CPU time (``time.process_time``) and the
instructions executed. Rank 0 writes OUT/host_cost.json (every rank's records)."""

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import deepspeed
import torch

import hippie_ds
from hippie_ds.adapter.ds import schedule as ds_schedule
from hippie_ds.adapter.ds.module import LayerSpec, PipelineModule


def count_stock_instructions(engine) -> int:
    sched = ds_schedule.TrainSchedule(
        micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id
    )
    return sum(len(cmds) for cmds in sched)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--engines", default="stock,1f1b")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more, untimed pass per engine under cProfile on rank 0 "
        "(OUT/profile-ENGINE.txt: the 40 functions with the most own time; Python calls per instruction)",
    )
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": args.micro_batches,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }
    engines = {}
    for name in args.engines.split(","):
        torch.manual_seed(0)
        module = PipelineModule(
            [LayerSpec(torch.nn.Linear, args.width, args.width) for _ in range(args.layers)],
            num_stages=2,
            loss_fn=lambda y, t: ((y - t) ** 2).mean(),
            partition_method="uniform",
        )
        own = dict(cfg, pipeline={"schedule": name}) if name != "stock" else cfg
        init = deepspeed.initialize if name == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, model_parameters=module.parameters(), config=own)
        count = (
            count_stock_instructions(engine)
            if name == "stock"
            else sum(1 for _ in engine.compiled_schedule.ops(engine.stage_id))
        )
        engines[name] = (engine, count)
    x = torch.randn(1, args.width)

    def data():
        while True:
            yield x, x

    it = data()
    records = {name: [] for name in engines}
    calls = {}
    names = list(engines)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            engine, count = engines[name]
            for _ in range(args.warmup):
                engine.train_batch(it)
            for _ in range(args.steps):
                torch.distributed.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                engine.train_batch(it)
                records[name].append(
                    {
                        "round": r,
                        "wall": time.perf_counter() - w0,
                        "cpu": time.process_time() - c0,
                        "instructions": count,
                    }
                )
    for name in names if args.profile else []:  # untimed: the profiler's own cost stays out of the rounds
        engine, count = engines[name]
        prof = cProfile.Profile() if rank == 0 else None
        if prof is not None:
            prof.enable()
        for _ in range(args.steps):
            engine.train_batch(it)
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            calls[name] = stats.total_calls / (args.steps * count)  # Python calls per instruction
            stats.sort_stats("tottime").print_stats(40)
            with open(os.path.join(args.out, f"profile-{name}.txt"), "w") as f:
                f.write(text.getvalue())
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, records)
    if rank == 0:
        with open(os.path.join(args.out, "host_cost.json"), "w") as f:
            json.dump({"args": vars(args), "ranks": gathered, "calls_per_instruction": calls}, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()
