"""Identical means identical: a profile that records no groups is grouped by name,
parameter bytes and input and output bytes, and warns only of disagreements that could move a cut;
the emulated models keep their layers' own kinds (EmulatedConv2d, EmulatedReLU, EmulatedMaxPool2d)
while the plan's fingerprint stays the module's. Pure (hippie_ds.planner.noise) and the profiler in
this process (a measured profile of repeated blocks still warns and pools)."""

import time

import pytest
import torch
from deepspeed.pipe import LayerSpec

from hippie_ds.planner import LayerProfile, Profile
from hippie_ds.planner.noise import MATERIAL, disagreements, noise_warning, pool

MS = 1e-3


def test_the_emulated_vgg16_profile_as_the_bench_builds_it_is_not_noisy():
    from hippie_ds.adapter.module.pipeline_module import model_fingerprint
    from tools.bench.emulated import emulated_specs
    from tools.bench.studies.scaling_plan import emulated_profile

    profile = emulated_profile("vgg16", 1e-3)
    assert profile.groups is None and noise_warning(profile) is None
    names = [x.name for x in profile.layers]
    # PipeDream's kinds: layer 5 a max-pool, 12, 14 and 16 ReLUs (the "identical" layers)
    assert names[5] == "EmulatedMaxPool2d" and {names[i] for i in (12, 14, 16)} == {"EmulatedReLU"}
    assert names[1] == "EmulatedConv2d" and names[-1] == "EmulatedLinear"
    assert profile.fingerprint() == model_fingerprint(emulated_specs("vgg16", 8, 1e-3))  # a plan fits the module


def _layer(name, t, inp, out=8.0, params=0.0):
    return LayerProfile(name=name, forward=t, backward=2 * t, input_bytes=inp, output_bytes=out, param_bytes=params)


def test_inferred_groups_tell_layers_apart_by_their_input():
    """The issue's case: a max-pool and ReLUs under one name, no parameters, one output size; the
    max-pool's input is 4x larger (and so is its time): not one group, no warning."""
    layers = [
        _layer("Emulated", 4 * MS, 32.0),
        _layer("Emulated", 1 * MS, 8.0),
        _layer("Emulated", 1.1 * MS, 8.0),
        _layer("Emulated", 1 * MS, 8.0),
    ]
    profile = Profile(model="m", batch_size=1, layers=layers)
    assert noise_warning(profile) is None
    same_input = profile.model_copy(update={"layers": [layers[0].model_copy(update={"input_bytes": 8.0})] + layers[1:]})
    assert disagreements(same_input) == [([0, 1, 2, 3], pytest.approx(3 * MS), pytest.approx(12 * MS))]
    # a first layer whose input the profile does not size (the loaded data) joins the group it matches
    unsized = profile.model_copy(
        update={
            "layers": [layers[0].model_copy(update={"input_bytes": None})]
            + [x.model_copy(update={"input_bytes": None}) for x in layers[1:]]
        }
    )
    assert disagreements(unsized)[0][0] == [0, 1, 2, 3]


def test_only_disagreements_that_could_move_a_cut_warn():
    """PipeDream's VGG-16 ReLUs 26, 28, 30 are identical by every size and part by x1.67, 0.4 ms in
    a model of 700 ms: no warning; the same ratio on layers that make up the model does."""
    big = [_layer("Conv", 100 * MS, 8.0, params=4.0) for _ in range(3)]
    small = [_layer("ReLU", t, 8.0) for t in (0.35 * MS, 0.21 * MS, 0.21 * MS)]
    quiet = Profile(model="m", batch_size=1, layers=big + small)
    assert disagreements(quiet, margin=0.25) == [] and MATERIAL == 0.01
    loud = Profile(model="m", batch_size=1, layers=[_layer("ReLU", t, 8.0) for t in (35 * MS, 21 * MS, 21 * MS)] + big)
    assert disagreements(loud)[0][0] == [0, 1, 2]


def _record(fw, bw):
    return dict(
        name="Block",
        forward=0.0,
        backward=0.0,
        backward_weight=0.5 * MS,
        split_extra=0.1 * MS,
        recompute=0.0,
        forward_runs=list(fw),
        backward_runs=list(bw),
        output_bytes=8.0,
        param_bytes=4.0,
    )


def test_a_measured_profile_of_repeated_blocks_still_warns_and_pools():
    quiet, busy = [1 * MS, 1.1 * MS, 0.9 * MS], [3 * MS, 5.6 * MS, 2.9 * MS]
    records, groups = pool(
        [_record(quiet, [2 * MS] * 3), _record(busy, [6 * MS] * 3), _record(quiet, [2 * MS] * 3)], ["k", "k", "k"]
    )
    assert groups == [[0, 1, 2]] and len({(r["forward"], r["backward"], r["split_extra"]) for r in records}) == 1
    profile = Profile(model="gpt", batch_size=2, groups=groups, layers=[LayerProfile(**r) for r in records])
    assert "layers 0, 1, 2 (Block)" in noise_warning(profile) and "pooled" in noise_warning(profile)


class Block(torch.nn.Module):
    def __init__(self, delay=0.0):
        super().__init__()
        self.fc, self.delay = torch.nn.Linear(16, 16), delay

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return torch.tanh(self.fc(x))


def test_the_profiler_still_groups_and_warns_on_repeated_blocks():
    from hippie_ds.profiler import profile_layers

    layers = [LayerSpec(Block) for _ in range(3)] + [LayerSpec(Block, delay=0.004), LayerSpec(torch.nn.Linear, 16, 4)]
    profile = profile_layers(layers, torch.randn(8, 16), repeats=3, warmup=1)
    assert profile.groups == [[0, 1, 2, 3]] and profile.layers[3].own_ratio > 1.25
    assert "layers 0, 1, 2, 3 (Block)" in noise_warning(profile)
    assert all(x.split_extra is not None for x in profile.layers)  # each block's split was timed
