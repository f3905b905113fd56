"""``hippie.profile`` without processes: its config key (strict, errors that name the key, the value
and what is allowed) and the shared per-layer measurement in the mode the job uses (no ``.grad``
written). The job itself profiling in place: ``tests/real_clients/test_real_clients.py``
(``test_the_job_profiles_itself_in_place_for_the_planner``)."""

import pytest
import torch

from hippie_ds.adapter.profiling.layer_timing import (
    WALL_CLOCK,
    CudaClock,
    as_stage_input,
    attribute_saved,
    clock_for,
    measure_layer,
)
from hippie_ds.config import ConfigError, ProfileConfig, split_config


def _profile_options(value):
    return split_config({"hippie": {"profile": value}})[2].profile


def test_profile_key_defaults_and_values():
    assert split_config({})[2].profile is None
    assert _profile_options(None) is None
    assert _profile_options({"out": "p.yaml"}) == ProfileConfig(out="p.yaml", steps=3, repeats=3, name=None)
    got = _profile_options({"out": "p.json", "steps": 1, "repeats": 5, "name": "gpt"})
    assert (got.out, got.steps, got.repeats, got.name) == ("p.json", 1, 5, "gpt")


@pytest.mark.parametrize(
    "value,message",
    [
        ("p.yaml", 'config key "hippie.profile" = \'p.yaml\': .*allowed: null or a mapping {"out": FILE'),
        ({"steps": 2}, r'config key "hippie.profile.out" is required \(in {\'steps\': 2}\)'),
        ({"out": ""}, 'config key "hippie.profile.out" = \'\': String should have at least 1 character'),
        ({"out": 3}, 'config key "hippie.profile.out" = 3: Input should be a valid string'),
        ({"out": "p", "steps": 0}, 'config key "hippie.profile.steps" = 0: Input should be greater than or equal to 1'),
        ({"out": "p", "steps": "2"}, 'config key "hippie.profile.steps" = \'2\': Input should be a valid integer'),
        ({"out": "p", "steps": True}, 'config key "hippie.profile.steps" = True: Input should be a valid integer'),
        ({"out": "p", "repeats": 0}, 'config key "hippie.profile.repeats" = 0: Input should be greater than or equal'),
        (
            {"out": "p", "warmup": 1},
            'config key "hippie.profile.warmup" \\(value 1\\) is not known; allowed keys: out, steps, repeats, name',
        ),
    ],
)
def test_profile_key_errors_name_the_key_the_value_and_what_is_allowed(value, message):
    with pytest.raises(ConfigError, match=message):
        _profile_options(value)


def test_in_place_measurement_writes_no_grad_and_counts_what_a_layer_holds():
    """``accumulate=False`` (the job's mode): gradients towards the inputs and parameters, none
    written to ``.grad``; a parameterless function has W = 0; token ids (no gradient): W = backward."""
    torch.manual_seed(0)
    linear, embed = torch.nn.Linear(8, 8), torch.nn.Embedding(10, 8)
    before = linear.weight.grad = torch.full_like(linear.weight, 7.0)
    x = as_stage_input(torch.randn(4, 8))
    m = measure_layer(linear, x, list(linear.parameters()), 4.0 * (64 + 8), repeats=2, warmup=1, accumulate=False)
    assert linear.weight.grad is before and torch.all(before == 7.0) and linear.bias.grad is None and x.grad is None
    r = m.record
    assert r["forward"] > 0 and r["backward"] > 0 and 0 <= r["backward_weight"] <= r["backward"]
    assert r["output_bytes"] == 4 * 8 * 4 and r["param_bytes"] == 4.0 * 72
    assert r["saves_input"] and r["own_saved"] == 0  # a linear saves its input (the previous layer's), not its weight

    def double(t):
        return t * 2

    f = measure_layer(double, as_stage_input(torch.randn(4, 8)), [], 0.0, repeats=1, warmup=0, accumulate=False)
    assert f.record["backward_weight"] == 0 and f.record["param_bytes"] == 0
    ids = as_stage_input(torch.randint(0, 10, (4, 3)))
    e = measure_layer(embed, ids, list(embed.parameters()), 320.0, repeats=1, warmup=0, accumulate=False)
    assert e.record["backward_weight"] == e.record["backward"] > 0 and embed.weight.grad is None
    # the linear's output is saved by the next layer (tanh saves its result, not its input: here a
    # layer that saves its input, the linear again) -> counted with the producer
    fields = attribute_saved([dict(name="a", **r), dict(name="b", **r)])
    assert fields[0]["output_saved"] and fields[0]["saved_bytes"] == r["output_bytes"]


def test_clock_follows_the_device():
    assert clock_for("cpu") is WALL_CLOCK and WALL_CLOCK.name == "wall clock"
    assert isinstance(clock_for("cuda:0"), CudaClock)


def lm_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _loss_stage(loss_fn):
    """An InPlaceProfiler on a stand-in for the stage holding the last layer (no engine: the
    job itself is tests/real_clients/test_real_clients.py's)."""
    from types import SimpleNamespace

    from hippie_ds.adapter.profiling.profile_in_place import InPlaceProfiler

    head = torch.nn.Linear(8, 10)
    module = torch.nn.Module()
    module.loss_fn, module._local_start, module.forward_funcs = loss_fn, 0, [head]
    profiler = InPlaceProfiler.__new__(InPlaceProfiler)
    profiler.module, profiler.specs, profiler.options = module, [head], SimpleNamespace(repeats=2)
    profiler.clock, profiler.labels, profiler.loss_records = WALL_CLOCK, None, []
    return profiler, head


@pytest.mark.parametrize("loss_fn", [lm_loss, torch.nn.CrossEntropyLoss()], ids=["function", "module"])
def test_in_place_loss_keeps_the_first_labels_and_is_measured_like_a_layer(loss_fn):
    from hippie_ds.adapter.profiling.profile_in_place import _combine
    from hippie_ds.planner.profile import LayerProfile

    torch.manual_seed(0)
    profiler, head = _loss_stage(loss_fn)
    first, second = torch.randint(0, 10, (6,)), torch.randint(0, 10, (6,))
    out = head(torch.randn(6, 8))
    restore = profiler._capture_labels()
    for labels in (first, second):  # as the engine calls it, micro-batch by micro-batch
        profiler.module.loss_fn(out, labels)
    restore()
    assert profiler.module.loss_fn is loss_fn and torch.equal(profiler.labels, first)
    assert not getattr(loss_fn, "_forward_pre_hooks", {})  # the module's hook is gone
    profiler._measure_loss(out.detach())
    assert profiler.labels is None and len(profiler.loss_records) == 1
    record = _combine([(0, profiler.loss_records)])
    loss = LayerProfile(**attribute_saved([dict(record, name="lm_loss")])[0])
    assert loss.forward > 0 and loss.backward > 0 and loss.backward_weight == 0
    assert loss.saved_bytes >= 6 * 10 * 4  # log_softmax's result
    assert loss.input_bytes == 6 * 10 * 4 + 6 * 8 and loss.working_bytes is None  # the CPU: no allocator peak


def test_working_bytes_is_the_peak_less_what_the_layer_keeps(monkeypatch):
    """The allocator's figure (CUDA) less the layer's saved tensors and output; faked here, so
    that the arithmetic is checked on any machine (the real allocator: the CUDA test below)."""
    from hippie_ds.adapter.profiling import layer_timing

    linear = torch.nn.Linear(8, 8)
    monkeypatch.setattr(layer_timing, "_cuda_device", lambda obj: "fake")
    monkeypatch.setattr(layer_timing, "peak_above", lambda run, device: (run(), 10_000.0)[1])
    m = measure_layer(torch.tanh, as_stage_input(torch.randn(4, 8)), [], 0.0, repeats=1, warmup=0, accumulate=False)
    assert m.record["working_bytes"] == 10_000 - 4 * 8 * 4  # tanh keeps its output (saved) only
    monkeypatch.setattr(layer_timing, "peak_above", lambda run, device: 1.0)
    m = measure_layer(
        linear,
        as_stage_input(torch.randn(4, 8)),
        list(linear.parameters()),
        288.0,
        repeats=1,
        warmup=0,
        accumulate=False,
    )
    assert m.record["working_bytes"] == 0  # never negative


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the allocator statistic)")
def test_working_bytes_on_cuda_counts_the_gradients():
    x = as_stage_input(torch.randn(256, 1024, device="cuda"))
    m = measure_layer(lambda t: t * 2, x, [], 0.0, repeats=1, warmup=1, accumulate=False, clock=CudaClock())
    # the incoming gradient (ones) and the input gradient at least, each as large as the input
    assert m.record["working_bytes"] >= 2 * 256 * 1024 * 4
