"""A small MLP whose layers save a measurable amount for backward: the profiler / planner /
plan-consumption tests profile it, plan it, and train it from the plan."""

import torch
from deepspeed.runtime.pipe.module import LayerSpec

IN, WIDTH, OUT = 16, 256, 4
MICRO_BATCH_SIZE = 32


def layer_specs():
    return [
        LayerSpec(torch.nn.Linear, IN, WIDTH),
        LayerSpec(torch.nn.GELU),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
        LayerSpec(torch.nn.LayerNorm, WIDTH),
        LayerSpec(torch.nn.GELU),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
        LayerSpec(torch.nn.Tanh),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
        LayerSpec(torch.nn.GELU),
        LayerSpec(torch.nn.Linear, WIDTH, OUT),
    ]


def sample(batch=MICRO_BATCH_SIZE):
    return torch.randn(batch, IN, generator=torch.Generator().manual_seed(0))


def profile_target():
    """What `hippie-ds profile tests/distributed/plan_model.py:profile_target` measures."""
    return {"layers": layer_specs(), "sample": sample(), "name": "plan-mlp"}


def loss_fn(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)


def data_iter(replica, seed=0):
    step = 0
    while True:
        g = torch.Generator().manual_seed(1_000_003 * seed + 7_919 * replica + step)
        yield torch.randn(MICRO_BATCH_SIZE, IN, generator=g), torch.randn(MICRO_BATCH_SIZE, OUT, generator=g)
        step += 1
