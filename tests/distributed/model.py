"""A tiny deterministic PipelineModule and data, shared by the rank workers and the
single-process references of the distributed tests."""
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
    specs += [LayerSpec(torch.nn.Tanh), TiedLayerSpec("tied", torch.nn.Linear, IN, WIDTH, bias=False, forward_fn=_tied_head),
              LayerSpec(torch.nn.Linear, IN, OUT)]
    return specs
