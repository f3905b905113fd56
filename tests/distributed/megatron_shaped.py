"""A rank worker in the shape of Megatron-DeepSpeed's GPT pipeline (``GPTModelPipe``), the client
hippie-ds is accepted against, with each of its traits that broke a schedule once:

- layer 0 is a parameterless function (Megatron's ``_to_float16``);
- the embedding is a ``TiedLayerSpec`` whose last-stage copy (the output projection) uses only
  the word embedding: its ``position_embeddings`` take no part in that stage's output;
- the client builds its own optimizer with two parameter groups (weight decay on / off) and its
  own LR scheduler whose ``step(increment)`` needs an argument (``OptimizerParamScheduler``),
  warm-up then cosine, as Megatron does;
- gradient clipping 1.0; the training loop never calls ``drain()``;
- partition by layer type (``partition_method="type:Block"``).

Each engine name in ``--engines`` (``[PRECISION:]NAME``) is trained in turn in this one launch
(``stock`` is ``deepspeed.initialize``; ``SCHEDULE+all`` sets ``hippie.deferred_layers: "all"``; ``SCHEDULE+drain``
calls ``drain()`` after the last step). Per rank and engine it writes losses, this rank's layers and
its copy of the tied word embedding to ``OUT/[PRECISION:]NAME/rankR.pt``.
"""
import argparse
import math
import os

import torch
import deepspeed
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

import hippie_ds

VOCAB, HIDDEN, SEQ, MICRO = 32, 16, 8, 2
# bf16-zero1: BF16_Optimizer (fp32 accumulation); bf16-plain-zero1: as users write it, DeepSpeedZeroOptimizer
PRECISIONS = ("fp32", "bf16", "bf16-zero1", "bf16-plain-zero1", "fp32-zero1")


def _to_float(x):
    """Megatron's first layer: a function, no parameters."""
    return x


class Embedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = torch.nn.Embedding(SEQ, HIDDEN)

    def forward(self, ids):
        return self.word_embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1]))


def _logits(embedding, x):
    """The tied output projection: only the word embedding is used on the last stage."""
    return x @ embedding.word_embeddings.weight.t()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def specs(blocks):
    tied = dict(tied_weight_attr="word_embeddings.weight")
    return ([_to_float, TiedLayerSpec("embed", Embedding, **tied)] + [LayerSpec(Block) for _ in range(blocks)] +
            [LayerSpec(torch.nn.LayerNorm, HIDDEN), TiedLayerSpec("embed", Embedding, forward_fn=_logits, **tied)])


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


class ParamScheduler:
    """Megatron's ``OptimizerParamScheduler`` in small: ``step(increment)`` takes the samples
    consumed (no default), linear warm-up then cosine decay."""

    def __init__(self, optimizer, lr, warmup, total):
        self.optimizer, self.lr, self.warmup, self.total, self.num_steps = optimizer, lr, warmup, total, 0
        self.step(0)

    def get_lr(self):
        if self.num_steps < self.warmup:
            return self.lr * (self.num_steps + 1) / self.warmup
        done = min(1.0, (self.num_steps - self.warmup) / max(1, self.total - self.warmup))
        return self.lr * 0.5 * (1 + math.cos(math.pi * done))

    def step(self, increment):
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr()

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state):
        self.num_steps = state["num_steps"]


def config(precision, schedule, opts, micro_batches, dp):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "train_batch_size": MICRO * micro_batches * dp,
           "gradient_clipping": 1.0, "steps_per_print": 10_000}
    if precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if precision.endswith("zero1"):
        cfg["zero_optimization"] = {"stage": 1}
    if precision == "bf16-zero1":  # DeepSpeed's BF16_Optimizer with ZeRO-1 (else DeepSpeedZeroOptimizer)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if schedule != "stock":
        cfg["pipeline"] = {"schedule": schedule}
        if "all" in opts:
            cfg["hippie"] = {"deferred_layers": "all"}
    return cfg


def micro_batches_of(step, replica, micro_batches):
    for m in range(micro_batches):
        g = torch.Generator().manual_seed(7919 * step + 104_729 * replica + m)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def data(replica, micro_batches):
    step = 0
    while True:
        yield from micro_batches_of(step, replica, micro_batches)
        step += 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="of engines named without PRECISION:")
    p.add_argument("--engines", default="stock,1f1b")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    kept = []
    for name in args.engines.split(","):
        precision, _, engine = name.rpartition(":")
        precision = precision or args.precision
        assert precision in PRECISIONS, f"{name}: precision {precision!r}, allowed {PRECISIONS}"
        schedule, *opts = engine.split("+")
        torch.manual_seed(1234)  # every engine starts from the same weights
        module = PipelineModule(layers=specs(args.blocks), num_stages=args.stages, loss_fn=loss_fn,
                                partition_method="type:Block")
        decay = [p for n, p in module.named_parameters() if p.dim() > 1 and "norm" not in n]
        no_decay = [p for n, p in module.named_parameters() if not (p.dim() > 1 and "norm" not in n)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
        scheduler = ParamScheduler(optimizer, 1e-2, warmup=2, total=args.steps)
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                          config=config(precision, schedule, opts, args.micro_batches, world // args.stages))
        it = data(engine.grid.data_parallel_id, args.micro_batches)
        losses = [float(engine.train_batch(it)) for _ in range(args.steps)]
        if "drain" in opts:
            engine.drain()
        layers = {int(engine.module._local_start) + i: {k: v.detach().float().clone() for k, v in f.state_dict().items()}
                  for i, f in enumerate(engine.module.forward_funcs) if isinstance(f, torch.nn.Module)}
        tied = {k: m.word_embeddings.weight.detach().float().clone() for k, m in engine.module.tied_modules.items()}
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        torch.save({"stage": int(engine.stage_id), "replica": int(engine.grid.data_parallel_id), "losses": losses,
                    "layers": layers, "tied": tied, "lr": scheduler.get_lr(), "global_steps": engine.global_steps},
                   os.path.join(args.out, name, f"rank{rank}.pt"))
        torch.distributed.barrier()
        kept.append(engine)  # alive until exit: what is in flight is warned about then


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # torn down before exit: no rank dies at teardown (rc 250)
