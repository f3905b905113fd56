"""The emulated accelerator (tools/bench/emulated.py): a model built from PipeDream's
per-layer V100 profiles whose compute is a CPU-free wait, with real parameters and gradients.
Checked: its layers follow the profile (parameters, output sizes, times, scaled as stated), a
wait leaves the CPU free, gradients are real (the weight branch's wait runs in a split backward's
W), and schedules are exact on it (stock 1F1B, zb-h1, interleaved-1f1b, zb-v bit-identical; with
gradient clipping off: DeepSpeed's default clips at norm 1.0, and the global norm sums the stages'
squares in an order that depends on the partition, which the virtual layouts change)."""

import time

import pytest
import torch
from launch import collect, launch

from tools.bench.emulated import DEVICE, DeviceClock, EmulatedLayer, emulated_specs, input_elems, read_profile

MODELS = ("vgg16", "gnmt8", "gnmt16")


@pytest.mark.parametrize("model", MODELS)
def test_layers_follow_the_profile(model):
    profile = read_profile(model)
    micro_batch, scale, speedup = 8, 1e-3, 2.0
    layers = [spec.build() for spec in emulated_specs(model, micro_batch, scale, speedup)]
    assert len(layers) == len(profile.layers)
    share = micro_batch / profile.batch_size / speedup
    for layer, p in zip(layers, profile.layers):
        assert layer.forward_s == pytest.approx(p.forward * share)
        assert layer.backward_s == pytest.approx(p.backward * share)
        params = 0 if layer.weight is None else layer.weight.numel()
        assert abs(params - p.param_bytes / 4 * scale) <= 0.5
    total = sum(p.param_bytes for p in profile.layers) / 4 * scale
    assert sum(0 if m.weight is None else m.weight.numel() for m in layers) == pytest.approx(total, rel=1e-3)
    cuts = list(profile.cut_bytes) + [profile.layers[-1].output_bytes]  # what crosses each stage boundary
    x = torch.randn(micro_batch, input_elems(model, scale))
    for layer, cut in zip(layers[:5], cuts):
        x = layer(x)
        assert x.shape == (micro_batch, max(1, round(cut / 4 / profile.batch_size * scale)))


def test_a_wait_leaves_the_cpu_free_and_gradients_are_real():
    DEVICE.idle()  # nothing queued from an earlier test: the wait starts now
    layer = EmulatedLayer(params=1000, out_elems=64, forward_s=0.2, backward_s=0.2)
    x = torch.randn(4, 32, requires_grad=True)
    wall, cpu = time.perf_counter(), time.process_time()
    out = layer(x)
    assert time.perf_counter() - wall >= 0.2  # the profiled time passes ...
    assert time.process_time() - cpu < 0.1  # ... without the CPU (a GPU kernel's wait)
    out.pow(2).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    assert layer.backward_weight_s == pytest.approx(0.1)  # half the backward on the weight branch (W)


@pytest.mark.distributed
def test_schedules_exact_on_the_emulated_model(tmp_path):
    engines = "stock,1f1b,zb-h1,interleaved-1f1b,zb-v"
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        4,
        "--micro-batches",
        4,
        "--steps",
        2,
        "--emulated",
        "vgg16",
        "--engines",
        engines,
        timeout=300,
    )
    assert rc == 0, log[-4000:]
    stock, stock_losses, _, _, _ = collect(tmp_path, "stock")
    assert len(stock) == len(read_profile("vgg16").layers)
    for name in engines.split(",")[1:]:
        ours, losses, _, _, _ = collect(tmp_path, name)
        assert all(torch.equal(ours[i][k], stock[i][k]) for i in stock for k in stock[i]), name
        assert losses == stock_losses, name


class _FakeTime:
    """A clock that a sleep advances by the time asked plus a late wake-up of ``late`` s."""

    def __init__(self, late: float):
        self.now, self.late = 100.0, late

    def clock(self):
        return self.now

    def sleep(self, s):
        self.now += s + self.late


def test_device_clock_pays_back_late_wakeups_of_queued_waits_but_not_idle_time():
    t = _FakeTime(late=0.004)  # every sleep wakes 4 ms late (several ranks on a core)
    dev = DeviceClock(t.clock, t.sleep)
    for _ in range(10):  # ten back-to-back 10 ms kernels: 100 ms, not 140
        dev.run(0.010)
    assert dev.busy_until == pytest.approx(100.100)
    assert t.now <= 100.100 + 0.004 + 1e-9  # at most the last wake-up's lateness
    t.now += 0.050  # the rank waits for a neighbour: the device sits idle
    dev.run(0.010)  # starts when asked, no credit for the idle time
    assert dev.busy_until == pytest.approx(t.now - 0.004)
    assert dev.busy_until - 0.010 >= 100.150
