"""An emulated accelerator: a pipeline model built from a per-layer profile (PipeDream's published
V100 profiles of VGG-16, GNMT-8, GNMT-16), whose layers hold real parameters and compute real
gradients, but whose forward and backward take the profiled time as a wait that leaves the CPU
free, as a GPU kernel does. On this 2-core machine the compute then no longer competes with the
collectives' CPU work, so a schedule's hidden all-reduce is hidden as it would be on a GPU, and
several ranks per core are fine.

One :class:`EmulatedLayer` per profiled layer, in the profile's linear order (``read_pipedream``),
of a subclass named after the layer's kind (:func:`layer_class`: ``EmulatedConv2d``, ``EmulatedReLU``):

* parameters: the layer's ``param_bytes`` / 4 fp32 elements, times ``scale``;
* output: per sample, the bytes crossing the cut after the layer (``cut_bytes``: every tensor a
  stage boundary there would send) / 4, times ``scale``: a p2p transfer carries the profiled
  activation, scaled; scale the link by the same factor and every transfer takes its real time;
* time: forward and backward of one micro-batch = the profiled minibatch's times x
  ``micro_batch / profile batch`` / ``speedup``, slept (``time.sleep``) inside an autograd function;
  a layer with parameters spends its ``backward_weight`` (the profile's, default half its backward)
  on the parameters' branch and the rest on the input's, so a split backward (zb-h1, zb-v) moves
  the W part as on a GPU;
* the arithmetic is a few element-wise ops per element (a slice or repeat to the output size,
  a scale by ``1 + mean(weight)``), so gradients are real and every exactness test applies.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

from hippie_ds.adapter.ds.module import LayerSpec

# the vendored copies of PipeDream's profiles (tests/data/pipedream/README.md: source and licence)
PROFILES = Path(__file__).resolve().parents[2] / "tests" / "data" / "pipedream"
# the profiles' names for the paper's models
MODELS = {"vgg16": "vgg16.txt", "gnmt8": "gnmt.txt", "gnmt16": "gnmt_large.txt"}


class DeviceClock:
    """When the emulated device finishes its queued work. A GPU runs back-to-back kernels without
    gaps (the CPU launches the next one while the device runs this one); ``time.sleep`` per
    kernel instead wakes late by the scheduler's latency (several ms with several ranks on a
    core), and a model of ~40 layers x 3 waits per micro-batch would then run up to 2x its
    profiled time. So a wait asked for within ``QUEUED_S`` of the previous wait's wake-up is
    queued behind it, from the previous wait's end (a late wake-up and the launch overhead are
    paid back by the following kernels); a later one finds the device idle and starts now."""

    QUEUED_S = 0.002

    def __init__(self, clock=time.perf_counter, sleep=time.sleep):
        self.clock, self.sleep = clock, sleep
        self.busy_until = self.woke_at = float("-inf")

    def run(self, seconds: float) -> None:
        """Occupy the device for ``seconds``, leaving the CPU free (a sleep)."""
        now = self.clock()
        start = self.busy_until if now - self.woke_at < self.QUEUED_S else now
        self.busy_until = start + seconds
        if self.busy_until > now:
            self.sleep(self.busy_until - now)
        self.woke_at = self.clock()

    def idle(self) -> None:
        """Forget the queue: the next wait starts when it is asked for."""
        self.busy_until = self.woke_at = float("-inf")


DEVICE = DeviceClock()  # one emulated device per process (a rank)


class _Wait(torch.autograd.Function):
    """Identity whose forward occupies the device ``forward_s`` and whose backward ``backward_s``."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        if forward_s > 0:
            DEVICE.run(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            DEVICE.run(ctx.backward_s)
        return grad, None, None


class EmulatedLayer(nn.Module):
    """A profiled layer: ``params`` real parameters, an output of ``out_elems`` per sample, and
    the profiled times as CPU-free waits."""

    def __init__(
        self,
        params: int,
        out_elems: int,
        forward_s: float,
        backward_s: float,
        name: str = "",
        backward_weight_s: float | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(params) * 0.01) if params > 0 else None
        self.out_elems, self.forward_s, self.backward_s, self.name = max(1, out_elems), forward_s, backward_s, name
        self.backward_weight_s = (
            0.0
            if self.weight is None
            else (backward_s / 2 if backward_weight_s is None else min(backward_weight_s, backward_s))
        )

    def forward(self, x):
        x = _Wait.apply(x, self.forward_s, self.backward_s - self.backward_weight_s)
        flat = x.reshape(x.shape[0], -1)
        n = self.out_elems
        out = flat[:, :n] if flat.shape[1] >= n else flat.repeat(1, math.ceil(n / flat.shape[1]))[:, :n]
        if self.weight is not None:
            out = out * (1 + _Wait.apply(self.weight, 0.0, self.backward_weight_s).mean())
        return out.contiguous()

    def extra_repr(self) -> str:
        return (
            f"{self.name}: params={0 if self.weight is None else self.weight.numel()}, out={self.out_elems}, "
            f"forward={self.forward_s * 1e3:.3f} ms, backward={self.backward_s * 1e3:.3f} ms"
        )


_KINDS: dict[str, type] = {}


def layer_class(name: str) -> type:
    """The :class:`EmulatedLayer` subclass named after a profiled layer's kind (PipeDream's
    ``node6:MaxPool2d``: ``EmulatedMaxPool2d``), so a profile of the module keeps the layers' own
    kinds, as the in-place profiler keeps class names, and layers of one kind and shape look alike
    and no others (:mod:`hippie_ds.planner.noise`). Made once per kind, importable (picklable)."""
    kind = "Emulated" + "".join(c for c in name.rsplit(":", 1)[-1] if c.isalnum())
    if kind == "Emulated":
        return EmulatedLayer
    if kind not in _KINDS:
        _KINDS[kind] = globals()[kind] = type(kind, (EmulatedLayer,), {"__module__": __name__})
    return _KINDS[kind]


def read_profile(model: str):
    """The :class:`hippie_ds.planner.profile.Profile` of ``model`` (vgg16, gnmt8, gnmt16, or a path)."""
    from hippie_ds.planner.pipedream_profile import read_pipedream

    path = Path(model) if model not in MODELS else PROFILES / MODELS[model]
    return read_pipedream(path, model=model if model in MODELS else None)


def emulated_specs(model: str, micro_batch: int, scale: float = 1e-3, speedup: float = 1.0) -> list:
    """One ``LayerSpec(layer_class(name), ...)`` per profiled layer of ``model`` (see the module docstring)."""
    profile = read_profile(model)
    share = micro_batch / profile.batch_size / speedup  # a micro-batch's share of the profiled minibatch's time
    cuts = list(profile.cut_bytes) + [profile.layers[-1].output_bytes]
    specs = []
    for layer, cut in zip(profile.layers, cuts):
        specs.append(
            LayerSpec(
                layer_class(layer.name),
                int(round(layer.param_bytes / 4 * scale)),
                int(round(cut / 4 / profile.batch_size * scale)),
                layer.forward * share,
                layer.backward * share,
                layer.name,
                None if layer.backward_weight is None else layer.backward_weight * share,
            )
        )
    return specs


def input_elems(model: str, scale: float = 1e-3) -> int:
    """Elements per sample of the model's input (its first layer's input, scaled)."""
    profile = read_profile(model)
    first = profile.layers[0]
    return max(1, int(round((first.input_bytes or first.output_bytes) / 4 / profile.batch_size * scale)))


def loss_fn(outputs, labels):
    """A scalar with a real gradient through every output element."""
    return ((outputs - labels) ** 2).mean()


def data_iter(model: str, micro_batch: int, micro_batches: int, replica: int, scale: float = 1e-3):
    """Random inputs of the model's input size and zero labels, seeded by (step, replica, micro-batch)."""
    n = input_elems(model, scale)
    step = 0
    while True:
        for m in range(micro_batches):
            g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + m)
            yield torch.randn(micro_batch, n, generator=g), torch.zeros(micro_batch, 1)
        step += 1
