"""Train the small GPT-style example with any hippie-ds schedule under the `deepspeed` launcher.

    deepspeed --num_gpus 4 tools/train_gpt.py --deepspeed_config configs/hippie.json --stages 2

Switching schedules is a change of the config's "pipeline.schedule" (or --schedule here). Rank 0
prints a progress bar with loss and throughput; at the end every rank writes its executed
instruction timeline and rank 0 draws the last steps of all ranks (PNG + Chrome trace) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import deepspeed
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "examples"))
import gpt  # noqa: E402

import hippie_ds  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (the world size must be a multiple)")
    p.add_argument("--schedule", default=None, help="override the config's pipeline.schedule")
    p.add_argument("--steps", type=int, default=40, help="training steps (train_batch calls)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches evaluated at the end")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/demo", help="timelines, trace and picture go here")
    p.add_argument("--timeline-steps", type=int, default=2, help="how many final steps the picture shows")
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def progress(step, total, loss, samples_per_s, width=30):
    done = int(width * step / total)
    print(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
          f"{samples_per_s:7.1f} samples/s", end="" if step < total else "\n", flush=True)


def draw_timeline(out: Path, schedule: str, last_steps: int):
    from hippie_ds.schedules.trace import chrome_trace, timeline_png
    ranks = [json.loads(p.read_text()) for p in sorted((out / "timeline").glob("rank*.json"))]
    t0 = min(r["t0_unix"] for r in ranks)
    events = []
    for r in ranks:
        final = max((e["step"] for e in r["events"]), default=0)
        for e in r["events"]:
            if e["step"] > final - last_steps:
                shift = r["t0_unix"] - t0
                events.append({**e, "rank": r["rank"], "stage": r["stage"], "start": e["start"] + shift,
                               "end": e["end"] + shift})
    start = min(e["start"] for e in events)
    for e in events:
        e["start"] -= start
        e["end"] -= start
    chrome_trace(events, out / "trace.json")
    timeline_png(events, out / "timeline.png", title=f"{schedule}: executed instructions, last {last_steps} steps")
    return out / "timeline.png"


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    args.deepspeed_config = None  # passed as a dict below, with the overrides applied
    if args.schedule:
        config.setdefault("pipeline", {})["schedule"] = args.schedule
    out = Path(args.out)
    config.setdefault("hippie", {})["timeline_dir"] = str(out / "timeline")
    placement = config["hippie"].get("placement", "pipeline_in_node")

    data = gpt.CharData(args.seq_len)
    torch.manual_seed(args.seed)
    model = gpt.pipeline(len(data.vocab), args.stages, hippie_ds.make_topology(args.stages, world, placement),
                         dim=args.dim, layers=args.layers, seq_len=args.seq_len)
    engine, *_ = hippie_ds.initialize(args=args, model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    replica, replicas = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    train = data.batches("train", engine.train_micro_batch_size_per_gpu(), args.seed, replica, replicas)
    schedule = engine.compiled_schedule.name
    if rank == 0:
        print(f"schedule {schedule} {engine.compiled_schedule.params}: {args.stages} stages x {replicas} replicas, "
              f"{engine.micro_batches} micro-batches of {engine.train_micro_batch_size_per_gpu()}", flush=True)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = float(engine.train_batch(train))
        if rank == 0:
            progress(step, args.steps, loss, step * engine.train_batch_size() / (time.perf_counter() - start))
    engine.flush_deferred_update()  # the last step's buffered gradient is applied, not lost

    heldout = data.batches("heldout", engine.train_micro_batch_size_per_gpu(), args.seed + 1, replica, replicas)
    losses = [float(engine.eval_batch(heldout)) for _ in range(args.eval_batches)]
    engine.write_timeline()
    torch.distributed.barrier()
    if rank == 0:
        held = sum(losses) / len(losses)
        print(f"held-out loss {held:.4f} (perplexity {gpt.perplexity(held):.2f}); "
              f"timeline picture: {draw_timeline(out, schedule, args.timeline_steps)}")


if __name__ == "__main__":
    main()
