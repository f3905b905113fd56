"""The planner's memory figure against the CUDA caching allocator, on one GPU.

    python -m tools.bench cuda-plan profile --out DIR      # the job profiles itself (hippie.profile)
    hippie-ds plan --profile DIR/profile.yaml --cluster 1x1,80GB,100Gbit --global-batch G --stages 1 \\
        --schedules 1f1b --micro-batch-size B --out DIR/plan.json
    python -m tools.bench cuda-plan run --out DIR --plan DIR/plan.json

One process (rank 0 of a world of 1; MASTER_ADDR/PORT default to localhost), the GPT example's
layers at a size where the model, not the CUDA context, fills the memory (a 32,000-token vocabulary),
random token ids. ``profile`` trains with ``"hippie": {"profile": ...}`` (CUDA events); ``run`` trains
with the plan and writes DIR/run.json: ``torch.cuda.max_memory_allocated`` over the whole run and the
plan's ``memory`` of stage 0 beside it, with its parts (state, activations held for backward,
working memory) and the state factor the plan used (from the profile's precision unless given).
On a machine without CUDA it runs on the CPU (no peak then).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench cuda-plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("phase", choices=["profile", "run"])
    p.add_argument("--out", required=True, help="profile.yaml / run.json go here")
    p.add_argument("--plan", default=None, help="the plan file (run)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="train_batch calls (profile: 1 warm-up + the rest measured)")
    p.add_argument(
        "--bf16", action="store_true", help="bf16, ZeRO-1, fp32 gradient accumulation (DeepSpeed's BF16_Optimizer)"
    )
    p.add_argument(
        "--checkpoint-all",
        action="store_true",
        help="run: re-compute every layer (the plan's checkpointed layers otherwise)",
    )
    return p.parse_args(argv)


def config(args) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        # torch's Adam: DeepSpeed's FusedAdam would JIT-build a CUDA extension first
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**6,
        "hippie": {},
    }
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["zero_optimization"] = {"stage": 1}
    if args.phase == "profile":  # a run takes the plan's schedule (1f1b, or gpipe for the re-compute check)
        cfg["pipeline"] = {"schedule": "1f1b"}
        cfg["hippie"]["profile"] = {
            "out": str(Path(args.out) / "profile.yaml"),
            "steps": args.steps - 1,
            "name": f"gpt-v{args.vocab}-d{args.dim}-l{args.layers}",
        }
    else:
        cfg["hippie"]["plan"] = str(Path(args.plan).resolve())
    return cfg


def batches(args):
    import torch

    g = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def main(argv=None):
    args = parse_args(argv)
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed  # here, not at import: `python -m tools.bench cuda-plan --help` needs neither
    import torch

    import hippie_ds
    from tools.examples import gpt

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.plan is not None:  # the plan's micro-batch size and count (the config must agree with it)
        from hippie_ds.planner.plan_file import load_plan

        plan = load_plan(args.plan)
        args.micro_batch, args.micro_batches = plan.micro_batch_size, plan.micro_batches
    cfg = config(args)
    specs = gpt.layer_specs(args.vocab, args.dim, args.layers, args.heads, args.seq_len)
    model = hippie_ds.PipelineModule(
        layers=specs,
        loss_fn=gpt.lm_loss,
        num_stages=1,
        config=cfg,
        activation_checkpoint_interval=1 if args.checkpoint_all else 0,
    )
    engine, *_ = hippie_ds.initialize(
        model=model, config=cfg, model_parameters=[p for p in model.parameters() if p.requires_grad]
    )
    after_init = torch.cuda.memory_allocated() if cuda else None
    data = batches(args)
    losses = [float(engine.train_batch(data)) for _ in range(args.steps)]
    result = {
        "phase": args.phase,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "bf16": args.bf16,
        "model": {k: getattr(args, k) for k in ("vocab", "dim", "layers", "heads", "seq_len")},
        "micro_batch": args.micro_batch,
        "micro_batches": args.micro_batches,
        "losses": losses,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "allocated_after_init": after_init,
        "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }
    if args.plan is not None:
        result["plan"] = json.loads(Path(args.plan).read_text()) if args.plan.endswith(".json") else None
        result["planned_memory"] = [s.memory for s in plan.stages]
        # what the planner adds up (state factor x params + activations held + working memory)
        result["planned_parts"] = [
            {
                "state": s.memory - s.activation_memory - s.working_memory,
                "activations": s.activation_memory,
                "working": s.working_memory,
            }
            for s in plan.stages
        ]
        result["state_factor"] = plan.assumptions.get("state_factor")
        result["checkpointed_layers"] = plan.checkpointed_layers
        if cuda:
            result["measured_over_planned"] = result["max_memory_allocated"] / plan.stages[0].memory
    (Path(args.out) / f"{args.phase}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "plan"}), flush=True)
    hippie_ds.shutdown()
