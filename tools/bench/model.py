"""The benchmark's model: a GPT-like stack of LayerSpecs (embedding, pre-LN blocks, untied head)
and its learnable synthetic data, identical for every schedule; the whole model as one module
for data parallelism, seeded as the pipeline seeds its layers. ``--model vgg-example``: the VGG
convergence example's network, loss and digits instead (tools/examples/vgg.py, at
tools/examples/train_vgg.py's default width); ``--model emulated:NAME``: a profiled model
(tools/bench/emulated.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hippie_ds.adapter.ds.module import LayerSpec

BASE_SEED = 4321


class Embedding(nn.Module):
    def __init__(self, vocab, seq, d):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-LN GPT block: causal self-attention and a 4x MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)  # untied: hippie schedules refuse tied modules

    def forward(self, x):
        return self.out(self.ln(x))


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


VGG_EXAMPLE = "vgg-example"  # --model: the VGG convergence example's network (tools/examples/vgg.py)


def emulated(a) -> str | None:
    """The profiled model of ``--model emulated:NAME`` (tools/bench/emulated.py), else None (the GPT)."""
    model = getattr(a, "model", "gpt") or "gpt"
    return model.split(":", 1)[1] if model.startswith("emulated:") else None


def is_vgg_example(a) -> bool:
    return getattr(a, "model", "gpt") == VGG_EXAMPLE


def vgg_example_specs():
    """The layers python -m tools.bench convergence trains as its ``vgg`` example: train_vgg.py's
    network at its default --width and --hidden (read from its own command line, not repeated here)."""
    from tools.examples import train_vgg, vgg

    example = train_vgg.parse_args([])
    return vgg.layer_specs(example.width, example.hidden)


def loss_of(a):
    """The loss function of the bench's model."""
    if emulated(a):
        from tools.bench.emulated import loss_fn as emulated_loss

        return emulated_loss
    if is_vgg_example(a):
        from tools.examples import vgg

        return vgg.loss_fn
    return loss_fn


def layer_specs(a):
    if emulated(a):
        from tools.bench.emulated import emulated_specs

        return emulated_specs(emulated(a), a.micro_batch_size, a.emulate_scale, a.emulate_speedup)
    if is_vgg_example(a):
        return vgg_example_specs()
    return (
        [LayerSpec(Embedding, a.vocab, a.seq, a.d_model)]
        + [LayerSpec(Block, a.d_model, a.heads) for _ in range(a.layers)]
        + [LayerSpec(Head, a.d_model, a.vocab)]
    )


def data_iter(a, replica):
    """Learnable synthetic sequences (arithmetic progressions mod vocab), identical for every
    schedule: micro-batch m of step s of replica r is seeded by (s, r, m). The emulated models:
    random inputs of their input size (tools/bench/emulated.py). The VGG example: micro-batches of its
    digits (fp32 8x8 images, int64 labels), replica r drawing its own order (seed r)."""
    if emulated(a):
        from tools.bench.emulated import data_iter as emulated_data

        yield from emulated_data(emulated(a), a.micro_batch_size, a.micro_batches, replica, a.emulate_scale)
        return
    if is_vgg_example(a):
        from tools.examples.vgg import Digits

        yield from Digits().global_batches(a.micro_batch_size, seed=replica)
        return
    step = 0
    while True:
        for m in range(a.micro_batches):
            g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + m)
            start = torch.randint(0, a.vocab, (a.micro_batch_size, 1), generator=g)
            stride = torch.randint(1, 9, (a.micro_batch_size, 1), generator=g)
            seq = (start + stride * torch.arange(a.seq + 1)) % a.vocab
            yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        step += 1


def stage_output_bytes(a, stage: int, parts: list[int] | None = None) -> float:
    """Bytes one micro-batch sends from ``stage`` to the next (the cost files' ``activation_bytes``):
    the GPT's (and, as before, an emulated model's) hidden state; the VGG example's: the output of its
    first ``parts[stage + 1]`` layers (``parts``: the module's boundaries; default: the uniform
    partition into ``a.stages``), found by running them on one micro-batch."""
    if not is_vgg_example(a):
        return 4.0 * a.micro_batch_size * a.seq * a.d_model
    from hippie_ds.adapter.ds.module import partition_uniform

    specs = layer_specs(a)
    parts = parts or partition_uniform(len(specs), a.stages)
    x = next(data_iter(a, 0))[0]
    with torch.no_grad():
        for spec in specs[: parts[min(stage + 1, len(parts) - 1)]]:
            x = spec.build()(x)
    return float(x.numel() * x.element_size())


class DPModel(nn.Module):
    """The whole model on one rank (for data parallelism): the same layers, seeded as
    ``PipelineModule(seed_layers=True, base_seed=BASE_SEED)`` seeds them."""

    def __init__(self, a):
        super().__init__()
        layers = []
        for i, spec in enumerate(layer_specs(a)):
            torch.manual_seed(BASE_SEED + i)
            layers.append(spec.build())
        self.layers = nn.Sequential(*layers)

        self.loss = loss_of(a)

    def forward(self, ids, labels):
        return self.loss(self.layers(ids), labels)
