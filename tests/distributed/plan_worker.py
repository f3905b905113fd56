"""Rank worker for the plan tests: builds ``hippie_ds.PipelineModule`` from the plan the config
names (``hippie.plan``), trains a few steps while an ActivationMeter measures the bytes held
for backward, and writes per-rank results (boundaries, checkpointed layers, peak bytes, losses,
local layer states)."""

import argparse
import os

import torch
import deepspeed

import plan_model

import hippie_ds
from hippie_ds.adapter.profiling.memory import ActivationMeter, hold_stage_io


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--configs", required=True, help="comma-separated DeepSpeed config files, trained in turn")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    for i, cfg in enumerate(args.configs.split(",")):
        torch.manual_seed(1234)
        module = hippie_ds.PipelineModule(
            plan_model.layer_specs(),
            loss_fn=plan_model.loss_fn,
            config=cfg,
            partition_method="uniform",
            seed_layers=True,
        )
        engine, *_ = hippie_ds.initialize(model=module, config=cfg)
        meter = ActivationMeter(engine.module)
        hold_stage_io(engine.module, meter)
        it = plan_model.data_iter(engine.grid.get_data_parallel_rank())
        losses, peaks = [], []
        for _ in range(args.steps):
            meter.reset_peak()
            with meter:
                loss = engine.train_batch(it)
            losses.append(float(loss))
            peaks.append(meter.peak)
        states = {
            str(engine.module._local_start + j): {k: v.clone() for k, v in layer.state_dict().items()}
            for j, layer in enumerate(engine.module.forward_funcs)
            if isinstance(layer, torch.nn.Module)
        }
        torch.save(
            {
                "stage": engine.stage_id,
                "parts": list(engine.module.parts),
                "checkpointed": engine.module.checkpointed_layers,
                "micro_batches": engine.micro_batches,
                "schedule": engine.compiled_schedule.name,
                "losses": losses,
                "peaks": peaks,
                "states": states,
            },
            os.path.join(args.out, f"run{i}_rank{rank}.pt"),
        )
        meter = None
        torch.distributed.barrier()  # no rank tears gloo down while another still talks to it
    print("plan worker done", flush=True)


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
