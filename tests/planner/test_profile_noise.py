"""Profiles that survive a busy machine: robust times over the timed runs, identical
layers measured as one group sharing the pooled median, the machine's load recorded, and the warning
a profile gives when its identical layers disagree by more than 25%, when written (``hippie-ds
profile``) and when planned from (``hippie-ds plan``), old profiles included. Pure (hippie_ds.planner.noise)
and the standalone profiler in this process; the job profiling itself in place:
``tests/real_clients/test_real_clients.py::test_the_job_profiles_itself_in_place_for_the_planner``."""

import time

import pytest
import torch
from deepspeed.pipe import LayerSpec

from cli_run import run
from hippie_ds.planner import LayerProfile, Profile, load_profile, save_profile
from hippie_ds.planner.noise import NOISE_MARGIN, disagreements, noise_warning, pool, time_spread
from hippie_ds.profiler import profile_layers

MS = 1e-3


def _record(fw, bw, w=0.5 * MS):
    return dict(
        name="Block",
        forward=0.0,
        backward=0.0,
        backward_weight=w,
        recompute=0.0,
        forward_runs=list(fw),
        backward_runs=list(bw),
        output_bytes=8.0,
        param_bytes=4.0,
    )


def test_identical_layers_share_the_pooled_median_and_keep_their_own_ratio():
    quiet = [1 * MS, 1.1 * MS, 0.9 * MS]
    busy = [3 * MS, 5.6 * MS, 2.9 * MS]  # one member measured while the machine was busy
    records = [
        _record(quiet, [2 * MS] * 3),
        _record(busy, [6 * MS, 7 * MS, 5 * MS]),
        _record(quiet, [2 * MS] * 3),
        _record(quiet, [2 * MS] * 3),
        dict(_record([4 * MS] * 3, [8 * MS] * 3), name="Head"),
    ]
    out, groups = pool(records, ["k", "k", "k", "k", "head"])
    assert groups == [[0, 1, 2, 3]]
    pooled = {(r["forward"], r["backward"], r["recompute"], r["spread"]) for r in out[:4]}
    # the median of 12 runs: the busy member's moves it little
    assert len(pooled) == 1 and out[0]["forward"] == pytest.approx(1.05 * MS)
    assert out[0]["backward"] == 2 * MS and out[0]["backward_weight"] == 0.5 * MS
    assert out[1]["own_ratio"] == pytest.approx((3 + 6) / (1.05 + 2)) and out[0]["own_ratio"] == pytest.approx(3 / 3.05)
    assert "own_ratio" not in out[4] and out[4]["forward"] == 4 * MS and out[4]["spread"] == 0
    assert all("forward_runs" not in r for r in out)
    alone, groups = pool(records[:2], [None, None])  # never grouped: each its own median
    assert groups == [] and alone[1]["forward"] == 3 * MS and alone[0]["spread"] > 0


def test_a_layer_with_no_input_gradient_keeps_w_equal_to_its_pooled_backward():
    """An embedding's backward is all W. Each measured step sets W to that step's median backward,
    and pooling takes the median of every run: W must be that pooled backward, not a median of
    medians a little below it (the in-place profile of a 2-replica job failed CI this way)."""
    embed = dict(_record([1 * MS] * 3, [2 * MS, 2.2 * MS, 1.9 * MS, 2.5 * MS], w=2.05 * MS), weight_is_backward=True)
    out, _ = pool([embed], [None])
    assert out[0]["backward"] == pytest.approx(2.1 * MS) and out[0]["backward_weight"] == out[0]["backward"]
    assert "weight_is_backward" not in out[0]  # never a LayerProfile field
    group = [dict(embed), dict(embed, backward_runs=[3 * MS] * 4, backward_weight=3 * MS)]
    out, groups = pool(group, ["e", "e"])
    assert groups == [[0, 1]] and out[0]["backward_weight"] == out[1]["backward_weight"] == out[0]["backward"]
    partial = [dict(embed), dict(embed, weight_is_backward=False, backward_weight=0.5 * MS)]
    out, _ = pool(partial, ["e", "e"])  # one member splits: the members' median W, as for any group
    assert out[0]["backward_weight"] < out[0]["backward"]


def _profile(times, groups=None, ratios=None, **extra):
    layers = [
        LayerProfile(
            name="Block",
            forward=t,
            backward=2 * t,
            output_bytes=8.0,
            param_bytes=4.0,
            own_ratio=None if ratios is None else ratios[i],
        )
        for i, t in enumerate(times)
    ]
    return Profile(model="gpt", batch_size=2, layers=layers, groups=groups, **extra)


def test_a_noisy_profile_is_named_with_its_layers_and_the_margin():
    assert NOISE_MARGIN == 0.25
    grouped = _profile(
        [2 * MS] * 4,
        groups=[[0, 1, 2, 3]],
        ratios=[0.6, 1.0, 1.0, 1.9],
        load={"cpus": 2, "load_before": 3.5, "cpu_share": 0.6},
    )
    text = noise_warning(grouped)
    assert text.startswith(
        "warning: profile 'gpt' is noisy: identical layers disagree by more than 25%: layers 0, 1, "
        "2, 3 (Block) measured 3.6-11.4 ms forward+backward (x3.17); load average 3.50 on 2 cores, "
        "CPU/wall 0.60. Their times are pooled"
    ), text
    assert noise_warning(_profile([2 * MS] * 4, groups=[[0, 1, 2, 3]], ratios=[0.9, 1.0, 1.0, 1.1])) is None
    # an older profile (no groups): identical layers found by name and sizes, their own times compared
    old = _profile([1.7 * MS, 5.6 * MS, 2 * MS, 2 * MS])
    assert disagreements(old) == [([0, 1, 2, 3], pytest.approx(5.1 * MS), pytest.approx(16.8 * MS))]
    assert "this profile predates pooling" in noise_warning(old).lower()
    assert noise_warning(_profile([2 * MS, 2.2 * MS])) is None


def test_the_profiles_spread():
    spread = _profile([1 * MS, 3 * MS]).model_copy(
        update={
            "layers": [
                LayerProfile(name="a", forward=1 * MS, backward=0.0, spread=0.4),
                LayerProfile(name="b", forward=3 * MS, backward=0.0, spread=0.0),
            ]
        }
    )
    assert time_spread(spread) == pytest.approx(0.1)  # time-weighted
    # older: the step-weighted median of the members' distances from their median (0 at 2 ms, 0.5 at 1 and 3 ms)
    assert time_spread(_profile([1 * MS, 2 * MS, 3 * MS])) == pytest.approx(0.5)
    assert time_spread(Profile(model="m", batch_size=1, layers=[LayerProfile(name="a", forward=1, backward=1)])) is None


class Block(torch.nn.Module):
    """The same work whatever ``delay`` says (same class, parameter shapes, input): a delay stands
    for a machine that was busy while this one block was measured."""

    def __init__(self, delay=0.0):
        super().__init__()
        self.fc, self.delay = torch.nn.Linear(16, 16), delay

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return torch.tanh(self.fc(x))


def target():
    return [LayerSpec(Block) for _ in range(3)] + [
        LayerSpec(Block, delay=0.004),
        LayerSpec(torch.nn.Linear, 16, 4),
    ], torch.randn(8, 16)


def test_the_profiler_groups_identical_layers_records_the_load_and_warns_when_written(capsys, tmp_path):
    layers, sample = target()
    profile = profile_layers(layers[:3] + layers[4:], sample, repeats=3, warmup=1)  # the quiet blocks
    assert profile.groups == [[0, 1, 2]]
    assert len({(x.forward, x.backward, x.backward_weight) for x in profile.layers[:3]}) == 1
    assert profile.layers[3].own_ratio is None and profile.layers[3].spread >= 0
    assert profile.load.cpus >= 1 and profile.load.wall_seconds > 0 and profile.load.cpu_share > 0
    out = tmp_path / "p.yaml"
    code, stdout, err = run(capsys, "profile", f"{__file__}:target", "--out", out, "--no-progress", "--repeats", 3)
    assert code == 0 and f"wrote {out}" in stdout
    noisy = load_profile(out)
    assert noisy.groups == [[0, 1, 2, 3]] and noisy.layers[3].own_ratio > 1.25
    assert "warning: profile" in err and "layers 0, 1, 2, 3 (Block)" in err
    code, stdout, err = run(capsys, "plan", "--profile", out, "--cluster", "1x2,1GB,10Gbit", "--global-batch", 16)
    assert code == 0 and "layers 0, 1, 2, 3 (Block)" in err  # and when planned from


def test_old_profiles_load_and_plan(capsys, tmp_path):
    """A profile written before spreads, groups, load and the job shape: it loads, plans, and its
    identical layers are still checked."""
    path = tmp_path / "old.yaml"
    path.write_text(
        "model: old\nbatch_size: 2\nlayers:\n"
        + "".join(
            f"- {{name: Block, forward: {t}, backward: {2 * t}, output_bytes: 8, param_bytes: 4}}\n"
            for t in (0.0017, 0.0056, 0.002, 0.002)
        )
    )
    profile = load_profile(path)
    assert profile.groups is None and profile.job is None and profile.load is None
    code, stdout, err = run(capsys, "plan", "--profile", path, "--cluster", "1x2,1GB,10Gbit", "--global-batch", 8)
    assert code == 0 and "plan for old" in stdout and "predates pooling" in err
    save_profile(profile, tmp_path / "again.yaml")
    assert "groups" not in (tmp_path / "again.yaml").read_text()
