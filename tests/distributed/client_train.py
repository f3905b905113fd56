"""An ordinary DeepSpeed pipeline training script, in the shape of DeepSpeedExamples'
``training/pipeline_parallelism/train.py``: argparse with ``deepspeed.add_config_arguments``,
``--deepspeed_config``, DeepSpeed's default topology (``PipelineModule(num_stages=...)``),
``partition_method="parameters"``, ``activation_checkpoint_interval``, ``training_data=`` a torch
Dataset and ``engine.train_batch()`` without an iterator, ``engine.eval_batch``, checkpoints, and
the optimizer's two parameter groups of Megatron-DeepSpeed's ``get_param_groups`` (weight decay on
the weights, off on the biases: the groups interleave the module's parameter order).

The only hippie-ds line is the choice of ``initialize`` (``--initialize hippie_ds``): that is
the one import a user changes. The rest is what a stock DeepSpeed user already has.
"""

import argparse
import json
import os

import torch
import deepspeed
from deepspeed.pipe import PipelineModule


def get_args():
    parser = argparse.ArgumentParser(description="client-shaped DeepSpeed pipeline script")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from the launcher")
    parser.add_argument("-s", "--steps", type=int, default=3)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--initialize", choices=["deepspeed", "hippie_ds"], default="deepspeed")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=1)
    parser.add_argument("--load", default=None, help="checkpoint directory to resume from")
    parser.add_argument("--save", default=None, help="checkpoint directory to save to after training")
    parser.add_argument("--drain-before-save", action="store_true")
    parser.add_argument("--restart-optimizer", action="store_true", help="load_checkpoint(load_optimizer_states=False)")
    parser.add_argument("--out", required=True, help="where each rank writes its losses and weights (JSON/pt)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class RandomDataset(torch.utils.data.Dataset):
    """Fixed random regression data (the same on every rank)."""

    def __init__(self, n=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


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


def param_groups(net):
    """Megatron-DeepSpeed's two optimizer groups: weight decay on the weights, off on the biases."""
    params = [p for p in net.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = PipelineModule(
        layers=layers(),
        loss_fn=torch.nn.MSELoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method="parameters",
        activation_checkpoint_interval=args.activation_checkpoint_interval,
    )
    if args.initialize == "hippie_ds":
        import hippie_ds as initializer
    else:
        initializer = deepspeed
    engine, _, _, _ = initializer.initialize(
        args=args, model=net, model_parameters=param_groups(net), training_data=RandomDataset()
    )
    eval_data = [RandomDataset(n=8, seed=1)[i] for i in range(8)]

    def evaluate():
        # The same 4 micro-batches cycled: the mean loss does not depend on the number of
        # micro-batches per step (4 on 2 stages x 2 replicas, 8 on 4 stages), so layouts compare.
        batch = engine.train_micro_batch_size_per_gpu()
        micro = [tuple(torch.stack(t) for t in zip(*eval_data[i : i + batch])) for i in range(0, len(eval_data), batch)]
        return float(engine.eval_batch(iter(micro * engine.micro_batches)))

    if args.load:
        engine.load_checkpoint(args.load, load_optimizer_states=not args.restart_optimizer)
    record = {"eval_before": evaluate(), "losses": []}
    for _ in range(args.steps):
        record["losses"].append(float(engine.train_batch()))
    if args.drain_before_save and hasattr(engine, "drain"):
        engine.drain()
    record["eval_after"] = evaluate()
    if args.save:
        engine.save_checkpoint(args.save)
    state = {
        int(engine.module._local_start) + i: {k: v.detach().clone() for k, v in layer.state_dict().items()}
        for i, layer in enumerate(engine.module.forward_funcs)
        if isinstance(layer, torch.nn.Module)
    }
    rank = torch.distributed.get_rank()
    os.makedirs(args.out, exist_ok=True)
    torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({**record, "stage": engine.stage_id, "global_steps": engine.global_steps}, f)
    if rank == 0:
        print(f"losses {record['losses']} eval_before {record['eval_before']} eval_after {record['eval_after']}")


if __name__ == "__main__":
    main()
    import hippie_ds

    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
