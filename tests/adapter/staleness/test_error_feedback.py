"""``hippie.staleness.error_feedback`` (hippie_ds/adapter/staleness/error_feedback.py): on 2bw's stages one update
behind, the update u(t) + g (u(t) - u(t-1)) of the optimizer's own step u, applied to the values the
optimizer steps. The rule alone (pure), then real ranks in every precision and ZeRO setting 2bw runs, each
against reference_async.run_2bw with the rule written separately (reference_async.error_feedback), and
a checkpoint taken with batches in flight. fp32 (torch AdamW, with a checkpoint): test_async_schedules."""

import io
from pathlib import Path

import pytest
import torch

import reference_async
from launch import collect, launch
from rule_check import (
    BF16_TOLERANCE,
    ZERO_SCALE_GROWS,
    assert_matches_rule,
    assert_replicas_equal,
    max_diff,
    reference_precision,
)

from hippie_ds import schedules
from hippie_ds.adapter.staleness.error_feedback import STATE_KEY, ErrorFeedback, check
from hippie_ds.config import ConfigError, StalenessConfig

STEPS, MICRO_BATCHES, LR, CLIP, GAIN = 4, 4, 0.01, 0.5, 0.5


def test_the_rule_on_a_torch_optimizer_and_its_state_travels():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    plain = torch.nn.Parameter(w.detach().clone())
    opt, ref_opt = torch.optim.AdamW([w], lr=0.1), torch.optim.AdamW([plain], lr=0.1)
    ErrorFeedback(opt, GAIN)
    grads = [torch.randn(5) for _ in range(4)]
    previous = torch.zeros(5)
    for g in grads:
        w.grad, plain.grad = g.clone(), g.clone()
        before = plain.detach().clone()
        ref_opt.step()  # the optimizer's own step u, then the correction by hand
        u = before - plain.detach()
        with torch.no_grad():
            plain.sub_(u - previous, alpha=GAIN)
        previous = u
        opt.step()
        assert torch.equal(w, plain)
    assert torch.equal(opt.state[w][STATE_KEY], previous)  # u(t-1) lives in the optimizer's state
    # a fresh optimizer loading the state continues identically (what a checkpoint does)
    other = torch.nn.Parameter(w.detach().clone())
    resumed = torch.optim.AdamW([other], lr=0.1)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # as a checkpoint: no tensor shared with the running optimizer
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    ErrorFeedback(resumed, GAIN)
    w.grad, other.grad = grads[0].clone(), grads[0].clone()
    opt.step()
    resumed.step()
    assert torch.equal(w, other)
    # a parameter without a gradient is not stepped and not corrected
    idle = torch.nn.Parameter(torch.ones(3))
    opt2 = torch.optim.AdamW([idle], lr=0.1)
    ErrorFeedback(opt2, GAIN)
    opt2.step()
    assert torch.equal(idle, torch.ones(3)) and not opt2.state.get(idle)


def test_refused_where_it_is_not_built():
    on = StalenessConfig(error_feedback=GAIN)
    check(on, schedules.compile("2bw", 2, 4))
    check(StalenessConfig(), schedules.compile("1f1b", 2, 4))  # off: nothing to check
    for name in ("hippie", "pipedream", "1f1b"):
        with pytest.raises(ConfigError, match=r'"hippie.staleness.error_feedback" = 0.5: schedule .* built for 2bw'):
            check(on, schedules.compile(name, 2, 4))
    with pytest.raises(ConfigError, match=r'"hippie.staleness.method" = "none"'):
        check(StalenessConfig(method="none", error_feedback=GAIN), schedules.compile("2bw", 2, 4))


# engine -> (precision, {(call, stage)} overflowed): bf16 (BF16_Optimizer), bf16 + ZeRO-1 (its fp32 masters
# partitioned; resumed from a checkpoint saved after 2 calls, batches in flight), fp16 (FP16_UnfusedOptimizer,
# with an overflow that skips an update), fp16 with DeepSpeed's fused Adam (FP16_Optimizer), fp16 + ZeRO-1
ENGINES = {
    "2bw+bf16+ef5": ("bf16", ()),
    "2bw+bf16+zero1+ef5": ("bf16+zero1", ()),
    "2bw+bf16+zero1+ef5+ckpt2": ("bf16+zero1", ()),
    "2bw+bf16+zero1": ("bf16+zero1", ()),
    "2bw+fp16+ef5+ovf1.1": ("fp16", {(1, 1)}),
    "2bw+fp16+ef5": ("fp16", ()),
    "2bw+fp16+fused+ef5": ("fp16+fused", ()),
    "2bw+fp16+zero1+p12+ef5+ckpt2": ("fp16+zero1", ()),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("error-feedback")
    rc, log, _ = launch(
        4,
        out,
        "--stages",
        2,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        STEPS,
        "--optimizer",
        "AdamW",
        "--lr",
        LR,
        "--clip",
        CLIP,
        "--drain",
        "--engines",
        ",".join(ENGINES),
        timeout=900,
    )
    assert rc == 0, log[-4000:]
    return out


def _rule(name, parts, gain=GAIN, overflows=None):
    kind, injected = ENGINES[name]
    precision = reference_precision(kind, name, MICRO_BATCHES, injected if overflows is None else overflows)
    staleness = StalenessConfig(error_feedback=gain)
    return reference_async.run_2bw(
        parts, 2, MICRO_BATCHES, STEPS, optimizer="AdamW", lr=LR, clip=CLIP, precision=precision, staleness=staleness
    )[0], precision


@pytest.mark.fp16  # its launch builds fp16 engines too
@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in ENGINES if "+ef5" in n])
def test_error_feedback_matches_its_rule(trained, name):
    ours, _, parts, _, replicas = collect(trained, name)
    ref, precision = _rule(name, parts)
    assert_matches_rule("error feedback", name, ENGINES[name][0], ours, ref, _rule(name, parts, gain=0.0)[0])
    if ENGINES[name][1]:  # the overflow skipped an update, on every stage alike
        assert any(precision.skipped)
        assert max_diff(ours, _rule(name, parts, overflows=set())[0]) > 2**-10
    assert_replicas_equal(replicas, name)


@pytest.mark.fp16  # its launch builds fp16 engines too
@pytest.mark.distributed
def test_checkpoint_with_batches_in_flight_resumes_exactly(trained):
    """Saved after 2 calls (save_checkpoint drains the batches in flight) and resumed in a fresh engine:
    u(t-1) travels in DeepSpeed's optimizer state, per rank and ZeRO partition."""
    for full, resumed in (("2bw+bf16+zero1+ef5", "2bw+bf16+zero1+ef5+ckpt2"),):
        a, b = collect(trained, full)[0], collect(trained, resumed)[0]
        assert max_diff(a, b) == 0, f"{resumed}: differs from the run without a checkpoint"
        assert any(Path(trained, resumed, "ckpt").iterdir())
    # fp16 + ZeRO-1, resumed, against its rule (ZeRO's partitioned masters, the loss scale in flight)
    ours, _, parts, _, _ = collect(trained, "2bw+fp16+zero1+p12+ef5+ckpt2")
    assert max_diff(ours, _rule("2bw+fp16+zero1+p12+ef5+ckpt2", parts)[0]) <= ZERO_SCALE_GROWS
    # the run without error feedback is another run
    plain = collect(trained, "2bw+bf16+zero1")[0]
    assert max_diff(plain, collect(trained, "2bw+bf16+zero1+ef5")[0]) > 2 * BF16_TOLERANCE


@pytest.mark.fp16  # its launch builds fp16 engines too
@pytest.mark.distributed
def test_nesterov_as_the_configs_optimizer(tmp_path):
    """The Nesterov method's recipe (Ajanthan et al., ICML 2025: NAdam(W) on the delayed stages) is a
    config, not a method: "optimizer": {"type": "NAdam"} (DeepSpeed builds torch.optim.NAdam by name) with
    2bw's default correction, alone and with error feedback, in fp32, bf16, bf16 + ZeRO-1 and fp16
    (FP16_UnfusedOptimizer around torch's NAdam); each equals its rule."""
    engines = {"2bw": 0.0, "2bw+ef5": GAIN, "2bw+bf16+ef5": GAIN, "2bw+bf16+zero1+ef5": GAIN, "2bw+fp16+ef5": GAIN}
    rc, log, _ = launch(
        2,
        tmp_path,
        "--stages",
        2,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        STEPS,
        "--optimizer",
        "NAdam",
        "--lr",
        LR,
        "--drain",
        "--engines",
        ",".join(engines),
        timeout=300,
    )
    assert rc == 0, log[-4000:]
    runs = {}
    for name, gain in engines.items():
        ours, _, parts, _, _ = collect(tmp_path, name)
        bf16 = "+bf16" in name
        kind = ("bf16+zero1" if "+zero1" in name else "bf16") if bf16 else "fp16" if "+fp16" in name else "fp32"

        def nadam_rule(gain):
            return reference_async.run_2bw(
                parts,
                1,
                MICRO_BATCHES,
                STEPS,
                optimizer="NAdam",
                lr=LR,
                precision=reference_precision(kind, name, MICRO_BATCHES),
                staleness=StalenessConfig(error_feedback=gain),
            )[0]

        assert max_diff(ours, nadam_rule(gain)) <= (BF16_TOLERANCE if bf16 else 1e-6), name
        if kind == "fp16":  # its rule without error feedback is another run
            assert max_diff(ours, nadam_rule(0.0)) > 1e-4, name
        runs[name] = ours
    adam, _ = reference_async.run_2bw(
        parts, 1, MICRO_BATCHES, STEPS, optimizer="AdamW", lr=LR, staleness=StalenessConfig()
    )
    assert max_diff(runs["2bw"], adam) > 1e-4 and max_diff(runs["2bw+ef5"], runs["2bw"]) > 1e-4
