"""A tiny deterministic PipelineModule and data, shared by the rank workers and the
single-process references of the distributed tests."""

import random

import numpy
import torch
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.module import LayerSpec

WIDTH, DEPTH, IN, OUT = 16, 8, 8, 4
BASE_SEED = 1234
MICRO_BATCH_SIZE = 2


def layer_specs():
    specs = [LayerSpec(torch.nn.Linear, IN, WIDTH)]
    for _ in range(DEPTH - 2):
        specs += [LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, WIDTH, WIDTH)]
    specs += [LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, WIDTH, OUT)]
    return specs


def seed_cpu(seed):
    """DeepSpeed's ``set_random_seed`` for what these models draw from (Python's, NumPy's and torch's
    CPU generators), as ``PipelineModule(seed_fn=...)``: ``torch.manual_seed`` on a host without
    CUDA also queues the CUDA/XPU/MTIA seeding, each with a formatted stack (about 2 ms a call), and
    ``seed_layers`` seeds every layer of every forward. The same numbers; both engines use it."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def build_layers():
    """All layers in one process, initialised exactly as PipelineModule(seed_layers=True) does."""
    layers = []
    for idx, spec in enumerate(layer_specs()):
        ds_utils.set_random_seed(BASE_SEED + idx)
        layers.append(spec.build())
    return layers


def loss_fn(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)


def micro_batch(step, replica, index):
    g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + index)
    x = torch.randn(MICRO_BATCH_SIZE, IN, generator=g)
    y = torch.randn(MICRO_BATCH_SIZE, OUT, generator=g)
    return x, y


def data_iter(replica, micro_batches, start_step=0):
    step = start_step
    while True:
        for m in range(micro_batches):
            yield micro_batch(step, replica, m)
        step += 1


def _tied_head(module, x):
    """The tied first layer used backwards, as a head: (B, WIDTH) -> (B, IN)."""
    return x @ module.weight


def tied_layer_specs():
    """The tiny model with its first layer's weight tied to a head near the end (an embedding tied
    to the output layer, as in Megatron-DeepSpeed's GPT): the first and the last stage each hold a
    copy, DeepSpeed sums their gradients in ``reduce_tied_grads``."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    specs = [TiedLayerSpec("tied", torch.nn.Linear, IN, WIDTH, bias=False)]
    for _ in range(DEPTH - 2):
        specs += [LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, WIDTH, WIDTH)]
    specs += [
        LayerSpec(torch.nn.Tanh),
        TiedLayerSpec("tied", torch.nn.Linear, IN, WIDTH, bias=False, forward_fn=_tied_head),
        LayerSpec(torch.nn.Linear, IN, OUT),
    ]
    return specs


# ------------------------------------------------------------------ the Megatron-shaped model
# What real clients (Megatron-DeepSpeed's GPTModelPipe) do that the tiny model does not, for the
# split backward's regressions (tests/adapter/gradients/test_split_backward_clients.py): activations of
# 3 dimensions, so a Linear's output is a view (and a layer returns ``x.view(...)``); an embedding tied to the head
# whose head copy leaves a parameter unused (the position table: only the word weight projects).
SEQ = 3


class Embedding(torch.nn.Module):
    """Megatron's EmbeddingPipe in small: a word projection (float inputs, so that stage 0 also
    back-propagates to its input) plus a position table; (B, SEQ, IN) -> (B, SEQ, WIDTH)."""

    def __init__(self):
        super().__init__()
        self.word = torch.nn.Linear(IN, WIDTH, bias=False)
        self.position = torch.nn.Parameter(0.1 * torch.randn(SEQ, WIDTH))

    def forward(self, x):
        return self.word(x) + self.position


def _word_head(module, x):
    """The tied embedding as the output projection (B, SEQ, WIDTH) -> (B, SEQ, IN): the word
    weight only; the head's copy of the position table takes no part."""
    return x @ module.word.weight


class Fold(torch.nn.Module):
    """(B, SEQ, WIDTH) <-> (B, SEQ * WIDTH) by ``view``: a layer whose output is a view."""

    def __init__(self, unfold=False):
        super().__init__()
        self.unfold = unfold

    def forward(self, x):
        return x.view(x.shape[0], SEQ, WIDTH) if self.unfold else x.view(x.shape[0], SEQ * WIDTH)


def megatron_layer_specs():
    """8 layers; on 2 stages: [embedding, Tanh, Linear (a view of 3-D), Fold (x.view)] and
    [Fold back, Linear, head tied to the embedding, Linear]."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    return [
        TiedLayerSpec("embed", Embedding, tied_weight_attr=["word.weight"]),
        LayerSpec(torch.nn.Tanh),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
        LayerSpec(Fold),
        LayerSpec(Fold, unfold=True),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("embed", Embedding, forward_fn=_word_head, tied_weight_attr=["word.weight"]),
        LayerSpec(torch.nn.Linear, IN, OUT),
    ]


def megatron_data_iter(replica, micro_batches, start_step=0):
    """The tiny model's data with a sequence dimension: (B, SEQ, IN), (B, SEQ, OUT)."""
    step = start_step
    while True:
        for m in range(micro_batches):
            g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + m)
            yield (
                torch.randn(MICRO_BATCH_SIZE, SEQ, IN, generator=g),
                torch.randn(MICRO_BATCH_SIZE, SEQ, OUT, generator=g),
            )
        step += 1


# ------------------------------------------------------------------ sequence-first activations
# Megatron-style stacks hand on (SEQ, B, WIDTH) activations made by ``x.transpose(0, 1).contiguous()``
# and transpose them back inside each layer: the input gradient autograd.grad returns (the split
# backward's) then has the transposed strides, where a full backward's AccumulateGrad gives a
# contiguous one (DeepSpeed sends it; gloo and NCCL refuse non-contiguous tensors).


class SeqFirstEmbedding(torch.nn.Module):
    """(B, SEQ, IN) -> (SEQ, B, WIDTH), contiguous."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(IN, WIDTH)

    def forward(self, x):
        return self.fc(x).transpose(0, 1).contiguous()


class SeqFirstBlock(SeqFirstEmbedding):
    """(SEQ, B, WIDTH) -> (SEQ, B, WIDTH): transposed back to batch-first, a layer, sequence-first again."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fc(x.transpose(0, 1))).transpose(0, 1).contiguous()


class SeqFirstHead(torch.nn.Module):
    """(SEQ, B, WIDTH) -> (B, SEQ, OUT), the labels' layout."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, OUT)

    def forward(self, x):
        return self.fc(x.transpose(0, 1))


def seqfirst_layer_specs():
    """8 layers, every boundary of a uniform partition into 2, 4 or 8 parts sequence-first; the data
    is :func:`megatron_data_iter`'s."""
    return (
        [LayerSpec(SeqFirstEmbedding)]
        + [LayerSpec(SeqFirstBlock) for _ in range(DEPTH - 2)]
        + [LayerSpec(SeqFirstHead)]
    )


# ------------------------------------------------------------------ Megatron's parameter attributes
def megatron_attributes(module):
    """Set on every parameter of ``module`` the plain attributes Megatron-family model code sets
    (``ColumnParallelLinear``'s ``bias.stride = stride``, ``set_tensor_model_parallel_attributes``,
    sequence parallelism's flag, the tied embedding's ``shared``, DeepSpeed MoE's ``allreduce``,
    Megatron DDP's ``main_grad``). An int ``stride`` hides ``Tensor.stride()`` on that object;
    ``allreduce`` is True (False would make DeepSpeed treat it as an expert parameter)."""
    for p in module.parameters():
        p.stride = 1
        p.partition_dim = 0
        p.partition_stride = 1
        p.model_parallel = False
        p.tensor_model_parallel = False
        p.sequence_parallel = False
        p.allreduce = True
        p.shared = False
        p.main_grad = None
    return module
