"""A small GPT-style language model as a DeepSpeed ``PipelineModule``, and its corpus: the
documentation text that ships with Python (``pydoc_data/topics.py``), character-level, with a
held-out split. Nothing is downloaded."""

from __future__ import annotations

import math

import torch
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
from torch import nn

import hippie_ds


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class CharData:
    """Character-level tokens; the last 10% of the text is held out."""

    def __init__(self, seq_len: int):
        text = corpus()
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * 0.9)
        self.train, self.heldout, self.seq_len = ids[:cut], ids[cut:], seq_len

    def batches(self, split: str, micro_batch: int, seed: int, replica: int = 0, replicas: int = 1):
        """Endless (inputs, targets) micro-batches; each replica draws its own windows."""
        data = self.train if split == "train" else self.heldout
        g = torch.Generator().manual_seed(seed * 1000 + replica)
        while True:
            starts = torch.randint(0, len(data) - self.seq_len - 1, (micro_batch,), generator=g)
            x = torch.stack([data[s : s + self.seq_len] for s in starts])
            y = torch.stack([data[s + 1 : s + 1 + self.seq_len] for s in starts])
            yield x, y

    def global_batches(self, split: str, batch: int, seed: int):
        """Endless global batches of ``batch`` (inputs, targets) windows drawn from ``seed`` alone,
        the same whatever the parallel layout; ``harness.replica_micro_batches`` cuts a replica's
        share into micro-batches."""
        data = self.train if split == "train" else self.heldout
        g = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(0, len(data) - self.seq_len - 1, (batch,), generator=g)
            x = torch.stack([data[s : s + self.seq_len] for s in starts])
            y = torch.stack([data[s + 1 : s + 1 + self.seq_len] for s in starts])
            yield x, y


class Embedding(nn.Module):
    def __init__(self, vocab, dim, seq_len):
        super().__init__()
        # "embed" / "lm_head" in the names: DeepSpeed's Muon leaves these to its AdamW half
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Parameter(torch.zeros(seq_len, dim))
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, ids):
        return self.embed(ids) + self.pos_embed[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device, dtype=x.dtype), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.lm_head(self.ln(x))


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def layer_specs(vocab: int, dim: int = 128, layers: int = 4, heads: int = 4, seq_len: int = 64):
    return (
        [LayerSpec(Embedding, vocab, dim, seq_len)]
        + [LayerSpec(Block, dim, heads) for _ in range(layers)]
        + [LayerSpec(Head, dim, vocab)]
    )


def pipeline(
    vocab, num_stages, topology, dim=128, layers=4, heads=4, seq_len=64, partition_method="uniform", plan=None
):
    """The model as a ``PipelineModule``; ``plan`` (a planner plan file) needs
    ``hippie_ds.PipelineModule``, which is used whenever this hippie-ds has it."""
    if plan is not None or hasattr(hippie_ds, "PipelineModule"):
        from tools.examples.harness import pipeline_module

        return pipeline_module(
            layer_specs(vocab, dim, layers, heads, seq_len),
            lm_loss,
            num_stages,
            topology,
            plan=plan,
            partition_method=partition_method,
        )
    # (DeepSpeed 0.19: partition_method="parameters" with seed_layers=True hands random.seed a
    # numpy integer, which Python 3.11 rejects.)
    return PipelineModule(
        layers=layer_specs(vocab, dim, layers, heads, seq_len),
        num_stages=num_stages,
        topology=topology,
        loss_fn=lm_loss,
        partition_method=partition_method,
        seed_layers=True,
        base_seed=1234,
    )


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def profile_target(dim: int = 128, layers: int = 4, seq_len: int = 64, micro_batch: int = 4):
    """What `hippie-ds profile tools/examples/gpt.py:profile_target` measures: the layer list of
    tools/examples/train_gpt.py's default model, one micro-batch of its corpus (the shipped configs' 4) and
    its loss on that micro-batch's targets (the profile's ``loss`` entry)."""
    data = CharData(seq_len)
    sample, targets = next(data.global_batches("train", micro_batch, 0))
    return {
        "layers": layer_specs(len(data.vocab), dim, layers, seq_len=seq_len),
        "sample": sample,
        "name": f"gpt-d{dim}-l{layers}-s{seq_len}",
        "loss_fn": lm_loss,
        "labels": targets,
    }
