"""A small VGG-style convolutional network as a DeepSpeed ``PipelineModule`` layer list, and its
data: scikit-learn's handwritten digits (``sklearn.datasets.load_digits``: 1797 grey-scale 8x8
images of the digits 0-9, a file shipped inside scikit-learn; nothing is downloaded).

The network follows VGG's pattern at the digits' scale: blocks of 3x3 convolutions with ReLU, each
block closed by a 2x2 max-pool, then a fully connected classifier.

    8x8x1 -> conv 32, conv 32, pool -> 4x4x32 -> conv 64, conv 64, pool -> 2x2x64
          -> flatten, linear 256->128, ReLU -> linear 128->10

Every convolution, pool and classifier layer is its own ``LayerSpec``, so a partitioner or planner
can cut between any two of them. No batch norm or dropout: the result does not depend on how a
global batch is cut into micro-batches or which rank draws which random numbers.
"""

from __future__ import annotations

from typing import Iterator

import torch
from deepspeed.runtime.pipe.module import LayerSpec
from torch import nn

TEST_SIZE = 448  # 25% of 1797; a multiple of 32 (the shipped configs' global batch), 1 image = 0.22 points
SPLIT_SEED = 0  # the test split is fixed, whatever --seed says


class Digits:
    """The digits as float images in [0, 1] (N, 1, 8, 8) and int64 labels, with a fixed,
    class-stratified test split of ``test_size`` images."""

    def __init__(self, test_size: int = TEST_SIZE):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        train_idx, test_idx = train_test_split(
            torch.arange(len(labels)).numpy(), test_size=test_size, random_state=SPLIT_SEED, stratify=labels.numpy()
        )
        self.train = (images[train_idx], labels[train_idx])
        self.test = (images[test_idx], labels[test_idx])
        self.classes = 10

    def global_batches(self, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless training batches of ``batch`` images: epoch e is a permutation of the training
        split drawn from ``seed``; the incomplete last batch of an epoch is dropped."""
        x, y = self.train
        g = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(y), generator=g)
            for lo in range(0, len(y) - batch + 1, batch):
                idx = order[lo : lo + batch]
                yield x[idx], y[idx]

    def test_batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test split in order, in batches of ``batch`` (an incomplete last one is left out)."""
        x, y = self.test
        for lo in range(0, len(y) - batch + 1, batch):
            yield x[lo : lo + batch], y[lo : lo + batch]

    def num_test_batches(self, batch: int) -> int:
        return len(self.test[1]) // batch


class ConvReLU(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size=3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Hidden(nn.Module):
    """Flatten and the first fully connected layer of the classifier."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(features, hidden)

    def forward(self, x):
        return torch.relu(self.fc(x.flatten(1)))


def layer_specs(width: int = 32, hidden: int = 128, classes: int = 10, image: int = 8) -> list[LayerSpec]:
    """conv(w), conv(w), pool, conv(2w), conv(2w), pool, flatten+linear+ReLU, linear: 8 layers."""
    w2 = 2 * width
    return [
        LayerSpec(ConvReLU, 1, width),
        LayerSpec(ConvReLU, width, width),
        LayerSpec(nn.MaxPool2d, 2),
        LayerSpec(ConvReLU, width, w2),
        LayerSpec(ConvReLU, w2, w2),
        LayerSpec(nn.MaxPool2d, 2),
        LayerSpec(Hidden, w2 * (image // 4) ** 2, hidden),
        LayerSpec(nn.Linear, hidden, classes),
    ]


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.float(), labels)


def accuracy(logits, labels):
    return (logits.argmax(-1) == labels).float().mean()


def pipeline(num_stages, topology, width=32, hidden=128, partition_method="uniform", plan=None):
    """The network as a ``PipelineModule`` (``hippie_ds.PipelineModule`` where this hippie-ds has
    it, which takes a planner ``plan`` file; DeepSpeed's otherwise)."""
    from tools.examples.harness import pipeline_module

    return pipeline_module(
        layer_specs(width, hidden), loss_fn, num_stages, topology, plan=plan, partition_method=partition_method
    )


def profile_target(width: int = 32, hidden: int = 128, micro_batch: int = 4):
    """What `hippie-ds profile tools/examples/vgg.py:profile_target` measures: the layer list of
    tools/examples/train_vgg.py's default network, one micro-batch of digits (the shipped configs' 4) and its
    loss on their labels (the profile's ``loss`` entry)."""
    images, labels = (t[:micro_batch] for t in Digits().train)
    return {
        "layers": layer_specs(width, hidden),
        "sample": images,
        "name": f"vgg-digits-w{width}-h{hidden}",
        "loss_fn": loss_fn,
        "labels": labels,
    }
