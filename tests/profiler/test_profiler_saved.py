"""What the layer profiler says a chain keeps for backward (``saved_bytes``, attributed to the layer
that made each storage) against an independent count: the chain run whole under
:class:`ActivationMeter` (every storage autograd saves, each once), its input and output held as a
stage holds them. Layers whose output is a view of their input (flatten, unflatten, the emulated
layers' slices) pass a storage on to a later layer that saves it."""

import pytest
import torch

from hippie_ds.adapter.profiling.memory import ActivationMeter
from hippie_ds.profiler import profile_layers


def _chain_count(layers, x) -> int:
    x = x.detach().requires_grad_(True)
    meter = ActivationMeter(torch.nn.Sequential(*layers))
    with meter:
        meter.hold(x)
        y = x
        for layer in layers:
            y = layer(y)
        meter.hold(y)
        return meter.current


def _stage_kept(x, layers) -> float:
    """What the planner sums for a stage of these profiled layers (hippie_ds.planner.recompute): its
    input, every layer's saved bytes and its last output where no layer saves it (the pipe buffers
    hold it until the backward)."""
    last = layers[-1]
    return (
        x.numel() * x.element_size()
        + sum(x.saved_bytes for x in layers)
        + (0 if last.output_saved else last.output_bytes)
    )


def test_a_storage_passed_on_through_views_counts_once_at_its_producer():
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(16, 64),  # its output is saved two layers on, by the second Linear
        torch.nn.Unflatten(1, (4, 16)),  # views
        torch.nn.Flatten(),
        torch.nn.Linear(64, 32),
        torch.nn.Tanh(),  # saves its output
        torch.nn.Linear(32, 8),  # saves the tanh's output (one storage)
    ]
    x = torch.randn(8, 16)
    profile = profile_layers(layers, x, repeats=1, warmup=0)
    assert profile.layers[0].output_saved and profile.layers[0].saved_bytes == 8 * 64 * 4
    assert _stage_kept(x, profile.layers) == pytest.approx(_chain_count(layers, x))


@pytest.mark.parametrize("stage", [(0, 11), (11, 21), (21, 31), (31, 41)])
def test_the_emulated_vgg16_profile_keeps_what_its_module_keeps(stage):
    from tools.bench.emulated import emulated_specs, input_elems
    from tools.bench.studies.scaling_plan import emulated_profile

    a, b = stage
    profile = emulated_profile("vgg16", 1e-3).scaled(8)
    layers = [spec.build() for spec in emulated_specs("vgg16", 8, 1e-3, speedup=float("inf"))]
    x = torch.randn(8, input_elems("vgg16", 1e-3))
    with torch.no_grad():
        for layer in layers[:a]:
            x = layer(x)
    # within 4 bytes a layer: a weighted layer's scale factor (one fp32) is measured at the profile's
    # batch and scaled with it as if it were an activation
    assert _stage_kept(x, profile.layers[a:b]) == pytest.approx(_chain_count(layers[a:b], x), abs=4 * (b - a))
