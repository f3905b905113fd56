"""The layer profiler (hippie_ds.profiler, torch): the split backward's W per layer."""
import pytest
import torch

from hippie_ds.planner import ProfileError, load_profile, save_profile
from hippie_ds.planner.profile import LayerProfile, Profile
from hippie_ds.profiler import profile_layers

WIDTH = 512


@pytest.fixture(scope="module")
def profile():
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(1000, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
              torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))]
    tokens = torch.randint(0, 1000, (64, 16))
    return profile_layers(layers, tokens, model="tiny", repeats=5, warmup=1)


def test_backward_weight_is_the_parameter_part(profile):
    embed, linear, gelu, block = profile.layers
    for layer in profile.layers:
        assert 0 <= layer.backward_weight <= layer.backward
    # token ids need no gradient: the whole backward is W (as the engine's split runs it)
    assert embed.backward_weight == embed.backward > 0
    assert gelu.backward_weight == 0  # no parameters: all of it is the input gradient
    # layers with parameters and an input that needs a gradient: W is measured (a timing, so only
    # its bounds are asserted here: timings belong in benchmarks, not in tests on a shared machine)
    for layer in (linear, block):
        assert layer.backward_weight is not None and 0 <= layer.backward_weight <= layer.backward


def test_backward_weight_in_the_profile_file(profile, tmp_path):
    path = tmp_path / "p.yaml"
    save_profile(profile, path)
    assert "backward_weight" in path.read_text()
    assert [x.backward_weight for x in load_profile(path).layers] == [x.backward_weight for x in profile.layers]
    half = profile.scaled(profile.batch_size // 2)
    for a, b in zip(profile.layers, half.layers):
        assert b.backward_weight == pytest.approx(a.backward_weight / 2) and b.backward_weight <= b.backward
    # the default (a profile that does not say): half of the backward
    assert LayerProfile(name="x", forward=1, backward=3).weight_time == 1.5
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nbatch_size: 1\nlayers:\n  - {name: a, forward: 1, backward: 2, backward_weight: 3}\n")
    with pytest.raises(ProfileError, match="backward_weight = 3.0 exceeds backward = 2.0"):
        load_profile(bad)
    assert isinstance(load_profile(path), Profile)
