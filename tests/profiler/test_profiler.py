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
    layers = [
        torch.nn.Embedding(1000, WIDTH),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(),
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)),
    ]
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


def lm_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_the_loss_is_profiled_apart_from_the_layers(tmp_path):
    """A target's loss_fn and labels: measured on the last layer's output like a layer (the CPU:
    wall clock, no allocator statistic, so no working_bytes), not a layer of the profile."""
    torch.manual_seed(0)
    vocab, tokens = 100, torch.randint(0, 100, (8, 16))
    layers = [torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab)]
    labels = torch.randint(0, vocab, (8, 16))
    plain = profile_layers(layers, tokens, model="lm", repeats=2, warmup=1)
    got = profile_layers(layers, tokens, model="lm", repeats=2, warmup=1, loss_fn=lm_loss, labels=labels)
    assert plain.loss is None and got.num_layers == 2 and got.fingerprint() == plain.fingerprint()
    loss, logits = got.loss, got.layers[-1]
    assert loss.name == "lm_loss" and loss.forward > 0 and loss.backward > 0
    assert loss.backward_weight == 0 and loss.param_bytes == 0  # no parameters: the backward is the input's
    # log_softmax saves its fp32 result, as large as the logits; the logits themselves and the
    # labels are its inputs (the last layer's output, counted there)
    assert loss.saved_bytes >= logits.output_bytes == 8 * 16 * vocab * 4
    assert loss.input_bytes == logits.output_bytes + labels.numel() * 8
    assert loss.working_bytes is None and got.loss_working() == loss.input_bytes + loss.output_bytes
    assert got.param_dtype == "float32" and got.state_factor() == 4.0
    save_profile(got, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").loss == loss


def test_a_target_gives_loss_fn_and_labels_together(tmp_path):
    from hippie_ds.profiler import load_target, load_target_spec

    target = tmp_path / "t.py"
    target.write_text(
        "import torch\n"
        "def full():\n    return {'layers': [torch.nn.Linear(4, 4)], 'sample': torch.zeros(2, 4),\n"
        "            'loss_fn': lambda out, y: (out - y).pow(2).mean(), 'labels': torch.zeros(2, 4)}\n"
        "def half():\n    return {'layers': [torch.nn.Linear(4, 4)], 'sample': torch.zeros(2, 4),\n"
        "            'loss_fn': lambda out, y: out.sum()}\n"
    )
    spec = load_target_spec(f"{target}:full")
    assert callable(spec["loss_fn"]) and spec["labels"].shape == (2, 4)
    assert len(load_target(f"{target}:full")) == 3  # (layers, sample, name) as before
    with pytest.raises(ProfileError, match="'loss_fn' .* and 'labels' .* come together; .*labels missing"):
        load_target_spec(f"{target}:half")


class _Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(50, 8))

    def forward(self, tokens):
        return self.weight[tokens]


def _head(embed, x):
    return x @ embed.weight.t()


def test_a_tied_module_is_counted_where_each_copy_is_held():
    """Megatron's tied embedding and head: the profile names the tie key on both uses and gives
    the parameters at the first; the planner counts them on every stage that holds a copy (the
    last stage keeps its own with gradient and optimizer state), once on a stage holding both."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from hippie_ds.planner import parse_cluster
    from hippie_ds.planner.model import _Model

    torch.manual_seed(0)
    layers = [
        TiedLayerSpec("embed", _Embed),
        LayerSpec(torch.nn.Linear, 8, 8),
        LayerSpec(torch.nn.Linear, 8, 8),
        TiedLayerSpec("embed", _Embed, forward_fn=_head),
    ]
    profile = profile_layers(layers, torch.randint(0, 50, (4, 6)), model="tied", repeats=1, warmup=0)
    assert [x.tied_key for x in profile.layers] == ["embed", None, None, "embed"]
    embed, linear = 50 * 8 * 4, (8 * 8 + 8) * 4
    assert [x.param_bytes for x in profile.layers] == [embed, linear, linear, 0]
    model = _Model(profile, parse_cluster("1x2,1GB,10Gbit"), 8, 4.0, "mean", None)
    assert model.layout(2, [0, 2, 4]).params == [embed + linear, linear + embed]
    assert model.layout(1, [0, 4]).params == [embed + 2 * linear]
