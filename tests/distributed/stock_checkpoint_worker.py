"""Rank worker: a stock DeepSpeed checkpoint of a tensor x pipeline model, resumed by stock DeepSpeed
and by hippie-ds ``1f1b``, in one launch (three engines in turn per precision, each from a fresh
``PipelineModule``).

The model is built as Megatron-DeepSpeed builds its GPT pipeline: DeepSpeed's
``PipeModelDataParallelTopology`` (axes pipe, data, model) and an optimizer of two parameter
groups (weight decay on the weights, off on the biases, so the groups interleave the module's
parameter order). The layers are whole on each ``model``-axis rank, not sliced: what is checked is
how the checkpoint's files are laid out and read. Per precision (``--precisions``): stock trains
``--steps`` steps and saves; a fresh stock engine loads and trains ``--steps`` more; so does a
fresh hippie-ds engine (no ``hippie`` key: ``1f1b``). Writes OUT/PRECISION/{stock,hippie_ds}/rankR.pt
(losses, global steps, this rank's layers)."""

import argparse
import os

import torch
import deepspeed
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

import hippie_ds

MICRO, MICRO_BATCHES = 2, 4


def layers():
    return [
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    ]


def config(precision, dp):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": MICRO * MICRO_BATCHES * dp,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
    }
    if precision == "bf16+zero1":
        cfg.update(
            {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}
        )
    return cfg


def data(precision, replica, start):
    step = start
    while True:
        for m in range(MICRO_BATCHES):
            g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + m)
            x, y = torch.randn(MICRO, 16, generator=g), torch.randn(MICRO, 4, generator=g)
            yield (x.bfloat16(), y.bfloat16()) if precision != "fp32" else (x, y)
        step += 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--precisions", default="fp32,bf16+zero1")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dp = world // (args.stages * args.tensor_parallel)

    def build(init, precision):
        deepspeed.runtime.utils.set_random_seed(1138)
        topology = PipeModelDataParallelTopology(num_pp=args.stages, num_mp=args.tensor_parallel, num_dp=dp)
        net = PipelineModule(
            layers=layers(), loss_fn=torch.nn.MSELoss(), topology=topology, partition_method="parameters"
        )
        params = [p for p in net.parameters() if p.requires_grad]
        for p in params:  # as Megatron's tensor-parallel linears mark their weights (clipping norms count them
            p.tensor_model_parallel = p.dim() > 1  # on every TP rank; bf16's norm has nothing on TP rank 1 else)
        groups = [
            {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ]
        engine, *_ = init(model=net, model_parameters=groups, config=config(precision, dp))
        return engine

    for precision in args.precisions.split(","):
        ckpt = os.path.join(args.out, precision, "ckpt")
        engine = build(deepspeed.initialize, precision)
        it = data(precision, engine.grid.data_parallel_id, 0)
        for _ in range(args.steps):
            engine.train_batch(it)
        engine.save_checkpoint(ckpt)
        for name, init in (("stock", deepspeed.initialize), ("hippie_ds", hippie_ds.initialize)):
            engine = build(init, precision)
            engine.load_checkpoint(ckpt)
            it = data(precision, engine.grid.data_parallel_id, args.steps)
            losses = [float(engine.train_batch(it)) for _ in range(args.steps)]
            state = {
                int(engine.module._local_start) + i: {k: v.detach().float().clone() for k, v in f.state_dict().items()}
                for i, f in enumerate(engine.module.forward_funcs)
                if isinstance(f, torch.nn.Module)
            }
            os.makedirs(os.path.join(args.out, precision, name), exist_ok=True)
            torch.save(
                {
                    "engine": type(engine).__name__,
                    "losses": losses,
                    "global_steps": engine.global_steps,
                    "layers": state,
                },
                os.path.join(args.out, precision, name, f"rank{rank}.pt"),
            )
            torch.distributed.barrier()


if __name__ == "__main__":
    main()
