"""One rank of the tied-deferral study (``tools/bench.py tied-deferral``,
benchmarks/studies/tied_deferral.py): a GPT in Megatron-DeepSpeed's shape (a parameterless first
layer, a word embedding tied to the output head, causal-attention blocks, two parameter groups,
warm-up + cosine, clipping 1.0 unless ``--clip``; tests/distributed/megatron_shaped.py is its test-sized twin),
byte-level on Python's own documentation text (examples/gpt.py's corpus), trained under each
engine in turn from the same weights and data.

Engines: ``stock`` (``deepspeed.initialize``) and ``hippie@L`` (``hippie.deferred_layers`` = L: a
count, "untied" or "all"). Per engine, rank 0 writes OUT/NAME.json: the training losses, the
held-out loss after the last step (``drain()`` first, so every gradient is applied) and seconds."""
import argparse
import json
import os
import time

import torch
import deepspeed
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

import hippie_ds
from examples import gpt
from examples.lr_schedule import ParamScheduler

VOCAB = 256  # bytes


def _to_float(x):
    """Megatron's first layer: a function, no parameters."""
    return x


class Embedding(torch.nn.Module):
    def __init__(self, dim, seq):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB, dim)
        self.position_embeddings = torch.nn.Embedding(seq, dim)
        torch.nn.init.normal_(self.word_embeddings.weight, std=0.02)
        torch.nn.init.normal_(self.position_embeddings.weight, std=0.02)

    def forward(self, ids):
        return self.word_embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1]))


def _logits(embedding, x):
    """The tied output projection (the word embedding alone)."""
    return x @ embedding.word_embeddings.weight.t()


def specs(blocks, dim, heads, seq):
    tied = dict(tied_weight_attr="word_embeddings.weight")
    return ([_to_float, TiedLayerSpec("embed", Embedding, dim, seq, **tied)] +
            [LayerSpec(gpt.Block, dim, heads) for _ in range(blocks)] +
            [LayerSpec(torch.nn.LayerNorm, dim),
             TiedLayerSpec("embed", Embedding, dim, seq, forward_fn=_logits, **tied)])


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


class Bytes:
    """The corpus as bytes; the last 10% held out."""

    def __init__(self, seq):
        ids = torch.tensor(list(gpt.corpus().encode()), dtype=torch.long)
        cut = int(len(ids) * 0.9)
        self.train, self.heldout, self.seq = ids[:cut], ids[cut:], seq

    def windows(self, data, g, n):
        starts = torch.randint(0, len(data) - self.seq - 1, (n,), generator=g)
        x = torch.stack([data[s:s + self.seq + 1] for s in starts])
        return x[:, :-1], x[:, 1:]

    def train_batches(self, seed, replica, micro, micro_batches):
        g = torch.Generator().manual_seed(1_000_003 * seed + replica)
        while True:
            for _ in range(micro_batches):
                yield self.windows(self.train, g, micro)

    def heldout_batches(self, replica, micro):
        g = torch.Generator().manual_seed(99_991 + replica)  # the same windows for every engine and seed
        while True:
            yield self.windows(self.heldout, g, micro)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--engines", default="stock,hippie@1,hippie@untied,hippie@all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches per replica")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (Megatron's 1.0; 0: none)")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    data = Bytes(args.seq)
    os.makedirs(args.out, exist_ok=True)
    for name in args.engines.split(","):
        schedule, _, layers = name.partition("@")
        torch.manual_seed(args.seed)
        module = PipelineModule(layers=specs(args.blocks, args.dim, args.heads, args.seq), num_stages=2,
                                loss_fn=loss_fn, partition_method="type:Block")
        decay = [q for n, q in module.named_parameters() if q.dim() > 1 and "norm" not in n and "ln" not in n]
        no_decay = [q for n, q in module.named_parameters() if not any(q is d for d in decay)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
        scheduler = ParamScheduler(optimizer, args.lr, warmup=max(1, args.steps // 20), total=args.steps, floor=0.1)
        cfg = {"train_micro_batch_size_per_gpu": args.micro,
               "train_batch_size": args.micro * args.micro_batches * (world // 2),
               "gradient_clipping": args.clip, "steps_per_print": 10 ** 9}
        if schedule != "stock":
            cfg["pipeline"] = {"schedule": schedule}
            cfg["hippie"] = {"deferred_layers": int(layers) if layers.isdigit() else layers}
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        replica = engine.grid.data_parallel_id
        it = data.train_batches(args.seed, replica, args.micro, args.micro_batches)
        start = time.time()
        losses = []
        for step in range(args.steps):
            losses.append(float(engine.train_batch(it)))
            if rank == 0 and (step + 1) % 50 == 0:
                print(f"[tied-deferral] seed {args.seed} {name} step {step + 1} loss {losses[-1]:.4f}", flush=True)
        seconds = time.time() - start
        if schedule != "stock":
            engine.drain()
        held = data.heldout_batches(replica, args.micro)
        total = sum(float(engine.eval_batch(held)) for _ in range(max(1, args.eval_batches // args.micro_batches)))
        heldout = torch.tensor(total / max(1, args.eval_batches // args.micro_batches))
        torch.distributed.all_reduce(heldout)  # every rank holds its replica's loss
        if rank == 0:
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump({"engine": name, "seed": args.seed, "losses": losses, "heldout": float(heldout) / world,
                           "seconds": seconds, "args": vars(args)}, f)
            print(f"[tied-deferral] seed {args.seed} {name} done: held-out {float(heldout) / world:.4f}, "
                  f"{seconds:.0f} s", flush=True)
        torch.distributed.barrier()
        del engine


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()
