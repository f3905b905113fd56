"""Rank worker: DeepSpeed 0.19.8's own ``DualPipeVModule`` (each pipeline rank holds two stages,
``2 * num_stages`` in all) trained in turn by ``deepspeed.initialize`` and by
``hippie_ds.initialize`` (which must hand it to DeepSpeed's ``DualPipeVEngine`` as stock does),
from the same initial weights and data; then ``hippie_ds.initialize`` with a hippie-ds schedule
named, or hippie-ds options, which must refuse before any collective. Writes OUT/rankR.pt: per
initializer the losses and this rank's layers of both phases, and the refusals' messages."""

import argparse
import os

import torch
import deepspeed
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.pipe.module import LayerSpec

import hippie_ds
from hippie_ds.config import ConfigError

MICRO, WIDTH, MICRO_BATCHES = 2, 8, 4


def layer_specs():
    specs = []
    for _ in range(4):  # one Linear + Tanh per stage: 4 stages on 2 ranks
        specs += [LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.Tanh)]
    return specs


def config(schedule=None):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": MICRO * MICRO_BATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
    }
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule}
    return cfg


def data():
    g = torch.Generator().manual_seed(7)
    while True:
        yield torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)


def build(stages):
    return DualPipeVModule(
        layers=layer_specs(),
        num_stages=stages,
        loss_fn=torch.nn.functional.mse_loss,
        partition_method="uniform",
        seed_layers=True,
        base_seed=1234,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    stages = torch.distributed.get_world_size()
    result = {}
    for name, init in (("stock", deepspeed.initialize), ("hippie_ds", hippie_ds.initialize)):
        module = build(stages)
        engine, *_ = init(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=config()
        )
        it = data()
        losses = [float(engine.train_batch(it)) for _ in range(args.steps)]
        layers = {
            start + i: {k: v.detach().clone() for k, v in f.state_dict().items()}
            for (start, _), funcs in zip(module.phase_bounds, module.phase_funcs)
            for i, f in enumerate(funcs)
            if isinstance(f, torch.nn.Module)
        }
        result[name] = {"engine": type(engine).__name__, "losses": losses, "layers": layers}
        torch.distributed.barrier()
    module = build(stages)
    for key, cfg in (("refused", config("hippie")), ("refused_options", {**config(), "hippie": {"timeline_dir": "t"}})):
        try:
            hippie_ds.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
            result[key] = None
        except ConfigError as exc:
            result[key] = str(exc)
    os.makedirs(args.out, exist_ok=True)
    torch.save(result, os.path.join(args.out, f"rank{torch.distributed.get_rank()}.pt"))


if __name__ == "__main__":
    main()
