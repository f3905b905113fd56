"""One rank of python -m tools.bench soak: a tiny PipelineModule trained for many steps with hippie_ds.initialize
(timelines on), sampling what a long run could leak: resident memory, open file descriptors,
threads, /dev/shm entries and the number of timeline events kept. Writes OUT/rank{R}.json."""

import argparse
import json
import os
import threading

import deepspeed
import psutil
import torch
from deepspeed.pipe import PipelineModule

import hippie_ds
from hippie_ds.adapter.integration import deepspeed_shm_segments


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--schedule", default="hippie")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument("--timeline-steps", type=int, default=100)
    return p.parse_args()


def sample(engine, step):
    _, events = engine.timeline()
    return {
        "step": step,
        "rss": psutil.Process().memory_info().rss,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": psutil.Process().num_threads(),
        # this job's segments only: another job on the machine may make its own meanwhile
        "shm": len(deepspeed_shm_segments(os.environ.get("MASTER_PORT", "*"))),
        "timeline_events": len(events),
        "timeline_steps": len({e["step"] for e in events}),
    }


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    ]
    net = PipelineModule(layers=layers, loss_fn=torch.nn.MSELoss(), num_stages=2, partition_method="uniform")
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "pipeline": {"schedule": args.schedule},
        "hippie": {"timeline_dir": os.path.join(args.out, "timeline"), "timeline_steps": args.timeline_steps},
    }
    engine, _, _, _ = hippie_ds.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 16, generator=g), torch.randn(2, 4, generator=g)) for _ in range(64)]

    def batches():
        while True:
            yield from data

    it = batches()
    rank = torch.distributed.get_rank()
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc=f"soak {args.schedule}", unit="step")
    samples = [sample(engine, 0)]
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(it)
        if step % args.sample_every == 0 or step == args.steps:
            samples.append(sample(engine, step))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
    if bar is not None:
        bar.close()
    engine.write_timeline()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "stage": engine.stage_id, "samples": samples}, f)


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
