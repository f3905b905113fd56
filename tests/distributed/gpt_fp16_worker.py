"""A rank worker: a Megatron-style GPT trained in fp16 as users' configs write it.

The model is the Megatron-shaped client's (megatron_shaped.specs: a function first layer, the word
embedding a ``TiedLayerSpec`` whose last-stage copy is the output projection, blocks partitioned by
type) with Megatron's attributes on every parameter (model.megatron_attributes: an int ``stride``
among them); the data is learnable (each sequence follows a fixed next-token table from a random
first token), so the loss falls from ln(VOCAB) when training goes the right way. Each engine name
in ``--engines`` is ``SCHEDULE[+OPT...]``:

- precision: ``+fp16`` (DeepSpeed's dynamic loss scale from 2**``--power``), else fp32;
- optimizer: the client's torch AdamW with Megatron's two parameter groups (FP16_UnfusedOptimizer in
  fp16), ``+adam``: torch's Adam in those groups, its L2 weight decay 0.01 added to the gradient
  (Megatron-DeepSpeed's optimizer on CPU, without apex), or ``+fused``: ``"optimizer": {"type": "Adam"}`` in
  the config (DeepSpeed's own Adam: FP16_Optimizer in fp16), ``+zero1``: ``"zero_optimization": {"stage": 1}``
  (DeepSpeedZeroOptimizer);
- ``+ovfS.T``: stage S's first gradient (its tied word embedding's, on stage 0 and on the last stage)
  infinite in every backward of ``train_batch`` call T.

``stock`` is ``deepspeed.initialize``. Gradient clipping 1.0. Per rank and engine it writes the losses,
the skipped steps, the loss scale, the optimizer wrapper's name, this rank's layers and its tied
copies to ``OUT/NAME/rankR.pt``.
"""

import argparse
import os

import deepspeed
import torch
from deepspeed.runtime.pipe.module import PipelineModule

import hippie_ds
import megatron_shaped as gpt
import model as tiny
from tools.examples.lr_schedule import ParamScheduler


def learnable(replica, micro_batches, steps):
    """Sequences that follow NEXT from a random first token: a bigram a model learns."""
    nxt = torch.randperm(gpt.VOCAB, generator=torch.Generator().manual_seed(5))
    for step in range(steps):
        for m in range(micro_batches):
            g = torch.Generator().manual_seed(7919 * step + 104_729 * replica + m)
            ids = [torch.randint(0, gpt.VOCAB, (gpt.MICRO,), generator=g)]
            for _ in range(gpt.SEQ):
                ids.append(nxt[ids[-1]])
            seq = torch.stack(ids, dim=1)
            yield seq[:, :-1], seq[:, 1:]


def config(opts, micro_batches, dp, power, lr, args_window=1000):
    cfg = {
        "train_micro_batch_size_per_gpu": gpt.MICRO,
        "train_batch_size": gpt.MICRO * micro_batches * dp,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
    }
    if "fp16" in opts:
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": power,
            "loss_scale_window": args_window,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if "fused" in opts:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.1}}
    if "zero1" in opts:
        cfg["zero_optimization"] = {"stage": 1}
    return cfg


def inject_overflows(engine, opts):
    for opt in opts:
        if opt.startswith("ovf"):
            stage, call = map(int, opt[3:].split("."))
            if engine.stage_id == stage:
                first = next(
                    p
                    for _, layer in gpt.layers_of(engine.module)
                    if isinstance(layer, torch.nn.Module)
                    for p in layer.parameters()
                    if p.requires_grad
                )
                first.register_hook(lambda g, call=call: g * float("inf") if engine.global_steps == call else g)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--power", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--engines", required=True)
    p.add_argument(
        "--window",
        type=int,
        default=4,
        help="loss_scale_window: small, so that 20 steps see the "
        "scale grow (the loss is not scaled without ZeRO, so nothing overflows and it only grows)",
    )
    p.add_argument("--warmup", type=int, default=4, help="LR warm-up steps, then cosine (Megatron's scheduler)")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dp = world // args.stages
    for name in args.engines.split(","):
        schedule, *opts = name.split("+")
        cfg = config(opts, args.micro_batches, dp, args.power, args.lr, args.window)
        if schedule != "stock":
            cfg["pipeline"] = {"schedule": schedule}
        torch.manual_seed(1234)
        module = PipelineModule(
            layers=gpt.specs(2), num_stages=args.stages, loss_fn=gpt.loss_fn, partition_method="type:Block"
        )
        gpt.reseed(module)
        with torch.no_grad():  # Megatron's init: normal(0, 0.02) weights, zero biases (every layout alike)
            for n, q in module.named_parameters():
                if "norm" not in n:
                    torch.manual_seed(sum(map(ord, n)))
                    q.normal_(0, 0.02) if q.dim() > 1 else q.zero_()
        tiny.megatron_attributes(module)
        kw = {}
        if "fused" not in opts:  # the client's optimizer, Megatron's two groups
            decay = [p for n, p in module.named_parameters() if p.dim() > 1 and "norm" not in n]
            no_decay = [p for n, p in module.named_parameters() if not (p.dim() > 1 and "norm" not in n)]
            adam, wd = (torch.optim.Adam, 0.01) if "adam" in opts else (torch.optim.AdamW, 0.1)
            kw["optimizer"] = adam(
                [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
            )
        else:
            kw["model_parameters"] = [p for p in module.parameters() if p.requires_grad]
        if "fused" not in opts:  # Megatron's scheduler: step(increment) counts samples
            kw["lr_scheduler"] = ParamScheduler(
                kw["optimizer"],
                args.lr,
                warmup=args.warmup * cfg["train_batch_size"],
                total=2 * args.steps * cfg["train_batch_size"],
            )
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, config=cfg, **kw)
        inject_overflows(engine, opts)
        it = learnable(engine.grid.data_parallel_id, args.micro_batches, args.steps + 4)
        losses = [float(engine.train_batch(it)) for _ in range(args.steps)]
        if hasattr(engine, "drain"):
            engine.drain()
        layers, tied = gpt.snapshot(engine)
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        torch.save(
            {
                "stage": int(engine.stage_id),
                "replica": int(engine.grid.data_parallel_id),
                "losses": losses,
                "layers": layers,
                "tied": tied,
                "optimizer": type(engine.optimizer).__name__,
                "skipped_steps": engine.skipped_steps,
                "loss_scale": float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None,
            },
            os.path.join(args.out, name, f"rank{rank}.pt"),
        )
        if rank == 0:
            print(
                f"{name}: "
                f"{type(engine.optimizer).__name__}/{type(getattr(engine.optimizer, 'optimizer', None)).__name__} "
                f"scale {float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None} losses "
                f"{[round(x, 3) for x in losses]}",
                flush=True,
            )
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()
