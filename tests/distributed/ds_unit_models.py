"""The pipeline models of DeepSpeed's own unit tests, rebuilt small on ``hippie_ds.PipelineModule``
(DeepSpeed's tests are not installed): ``LinearStackPipe`` (tests/unit/simple_model.py: Linear
layers with identity lambdas between them) and ``AlexNetPipeSpec`` (tests/unit/alexnet_model.py:
convolutions as ``LayerSpec``s, ``F.relu`` functions and an in-place ReLU, a lambda flattening,
the classifier), each subclassing the pipeline module as DeepSpeed's do, with fewer channels and
units than DeepSpeed's so that a CPU rank trains them in a moment. megatron_shaped.py trains them
(engine option ``+linearstack`` / ``+alexnet``), built without ``config=``.
"""

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec

import hippie_ds

MICRO = 2
CLASSES = 8


class LinearStackPipe(hippie_ds.PipelineModule):
    def __init__(self, input_dim=16, hidden_dim=16, output_dim=CLASSES, num_layers=4, **kwargs):
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers

        layers = []
        layers.append(LayerSpec(torch.nn.Linear, self.input_dim, self.hidden_dim))
        for x in range(self.num_layers):
            layers.append(LayerSpec(torch.nn.Linear, self.hidden_dim, self.hidden_dim, bias=False))
            layers.append(lambda x: x)
        layers.append(LayerSpec(torch.nn.Linear, self.hidden_dim, self.output_dim))

        super().__init__(layers=layers, loss_fn=torch.nn.CrossEntropyLoss(), **kwargs)


class AlexNetPipeSpec(hippie_ds.PipelineModule):
    def __init__(self, num_classes=CLASSES, **kwargs):
        self.num_classes = num_classes
        c = (3, 8, 12, 16, 16, 16)  # DeepSpeed's: 3, 64, 192, 384, 256, 256
        specs = [
            LayerSpec(torch.nn.Conv2d, c[0], c[1], kernel_size=11, stride=4, padding=5),
            LayerSpec(torch.nn.ReLU, inplace=True),
            LayerSpec(torch.nn.MaxPool2d, kernel_size=2, stride=2),
            LayerSpec(torch.nn.Conv2d, c[1], c[2], kernel_size=5, padding=2),
            F.relu,
            LayerSpec(torch.nn.MaxPool2d, kernel_size=2, stride=2),
            LayerSpec(torch.nn.Conv2d, c[2], c[3], kernel_size=3, padding=1),
            F.relu,
            LayerSpec(torch.nn.Conv2d, c[3], c[4], kernel_size=3, padding=1),
            F.relu,
            LayerSpec(torch.nn.Conv2d, c[4], c[5], kernel_size=3, padding=1),
            F.relu,
            LayerSpec(torch.nn.MaxPool2d, kernel_size=2, stride=2),
            lambda x: x.view(x.size(0), -1),
            LayerSpec(torch.nn.Linear, c[5], self.num_classes),
        ]
        super().__init__(layers=specs, loss_fn=torch.nn.CrossEntropyLoss(), **kwargs)


MODELS = {"linearstack": LinearStackPipe, "alexnet": AlexNetPipeSpec}


def build(kind, num_stages):
    """The model, built as DeepSpeed's tests build it: no config (the script's sys.argv names it)."""
    return MODELS[kind](num_stages=num_stages)


def data(kind, replica, micro_batches):
    """(inputs, labels) micro-batches: each step's from its own seed, per replica."""
    step = 0
    while True:
        for m in range(micro_batches):
            g = torch.Generator().manual_seed(7919 * step + 104_729 * replica + m)
            shape = (MICRO, 16) if kind == "linearstack" else (MICRO, 3, 32, 32)
            yield torch.randn(shape, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g)
        step += 1
