"""Megatron's ``OptimizerParamScheduler`` in small, for the Megatron-shaped clients (the test workers
tests/distributed/megatron_shaped.py and tests/distributed/gpt_fp16_worker.py): ``step(increment)``
takes the samples consumed (no default; DeepSpeed's pipeline engine passes the batch size), linear
warm-up then cosine decay to ``floor`` x the peak."""

import math


class ParamScheduler:
    def __init__(self, optimizer, lr, warmup, total, floor=0.0):
        self.optimizer, self.lr, self.warmup, self.total, self.floor = optimizer, lr, warmup, total, floor
        self.num_steps = 0
        self.step(0)

    def get_lr(self):
        if self.num_steps < self.warmup:
            return self.lr * (self.num_steps + 1) / self.warmup
        done = min(1.0, (self.num_steps - self.warmup) / max(1, self.total - self.warmup))
        return self.lr * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * done)))

    def step(self, increment):
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr()

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state):
        self.num_steps = state["num_steps"]
