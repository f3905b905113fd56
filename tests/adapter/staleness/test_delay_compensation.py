"""``hippie.staleness.delay_compensation`` (hippie_ds/adapter/staleness/delay_compensation.py): on 2bw's stages
one update behind (``method: "none"``), DC-ASGD-a's gradient g + L g g (W - W_g) / (sqrt(v_hat) + eps) stepped
by the config's optimizer. The rule alone (pure; against AdamW's own second moment, the staleness study's
rule), the start-up refusals, then real ranks in every precision and ZeRO setting 2bw runs, each against
reference_async.run_2bw with the rule written separately (reference_async.delay_compensation), and
checkpoints taken with batches in flight."""

import io
from pathlib import Path

import pytest
import torch

import reference_async
from launch import collect, launch
from rule_check import assert_matches_rule, assert_replicas_equal, max_diff, reference_precision

from hippie_ds import schedules
from hippie_ds.adapter.staleness import error_feedback
from hippie_ds.adapter.staleness.delay_compensation import (
    COMPUTED_ON_KEY,
    COUNT_KEY,
    SECOND_MOMENT_KEY,
    DelayCompensation,
    check,
)
from hippie_ds.config import ConfigError, StalenessConfig, split_config

STEPS, MICRO_BATCHES, LR, CLIP, STRENGTH = 4, 4, 0.01, 0.5, 30


def test_the_rule_is_the_studys_on_adamw_and_its_state_travels():
    """Under AdamW (betas[1] = 0.999, eps 1e-8) v is Adam's exp_avg_sq bit for bit and n its step, so the
    gradient stepped is the study's (tools/bench/studies/staleness_stage.py, _apply), read from Adam's state;
    W_g is the values the step before started from; the first step takes g as it is."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([w], lr=0.1, foreach=False)
    DelayCompensation(opt, STRENGTH)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(w.grad.clone()))  # after the correction's: what steps
    grads = [torch.randn(5) for _ in range(5)]
    computed_on = None
    for g in grads:
        w.grad = g.clone()
        state = opt.state.get(w)
        expected = g
        if state:
            assert torch.equal(state[SECOND_MOMENT_KEY], state["exp_avg_sq"]) and state[COUNT_KEY] == state["step"]
            v_hat = state["exp_avg_sq"] / (1 - 0.999 ** float(state["step"]))  # the study's rule
            expected = g + STRENGTH * g * g * (w.detach() - computed_on) / (v_hat.sqrt() + 1e-8)
            assert not torch.allclose(expected, g, rtol=1e-3)  # the correction is visible
        computed_on = w.detach().clone()
        opt.step()
        torch.testing.assert_close(seen[-1], expected, rtol=1e-6, atol=0)
        assert torch.equal(w.grad, g)  # the optimizer's gradient buffer as it was
        assert torch.equal(opt.state[w][COMPUTED_ON_KEY], computed_on)
    # a fresh optimizer loading the state continues identically (what a checkpoint does)
    other = torch.nn.Parameter(w.detach().clone())
    resumed = torch.optim.AdamW([other], lr=0.1, foreach=False)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # as a checkpoint: no tensor shared with the running optimizer
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    DelayCompensation(resumed, STRENGTH)
    w.grad, other.grad = grads[0].clone(), grads[0].clone()
    opt.step()
    resumed.step()
    assert torch.equal(w, other)
    # a parameter without a gradient is not stepped and not corrected; SGD (no state of its own) is
    idle, sgd_w = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt2 = torch.optim.SGD([idle, sgd_w], lr=0.1)
    DelayCompensation(opt2, STRENGTH)
    for g in grads[:2]:
        sgd_w.grad = g[:3].clone()
        opt2.step()
    assert torch.equal(idle, torch.ones(3)) and not opt2.state.get(idle) and opt2.state[sgd_w][COUNT_KEY] == 2
    with pytest.raises(ValueError):
        DelayCompensation(opt2, 0.0)
    with pytest.raises(RuntimeError, match="legacy_fusion"):  # gradients passed to step(), not in .grad
        opt2.step(grads=[[grads[0][:3]]])


def test_refused_where_it_is_not_built():
    on = StalenessConfig(method="none", delay_compensation=STRENGTH)
    check(on, schedules.compile("2bw", 2, 4))
    check(StalenessConfig(), schedules.compile("1f1b", 2, 4))  # off: nothing to check
    for name in ("hippie", "pipedream", "1f1b"):
        with pytest.raises(
            ConfigError, match=r'"hippie.staleness.delay_compensation" = 30.0: schedule .* built for 2bw'
        ):
            check(on, schedules.compile(name, 2, 4))
    for method in ("extrapolate-made", "extrapolate", "adam"):  # the default included: predicted compute weights
        with pytest.raises(
            ConfigError,
            match=rf'"hippie.staleness.delay_compensation" = 30.0 with "hippie.staleness.'
            rf'method" = "{method}".*allowed with "none" only',
        ):
            check(StalenessConfig(method=method, delay_compensation=STRENGTH), schedules.compile("2bw", 2, 4))
    # not with error feedback, which corrects the updates of predicted compute weights only
    with pytest.raises(
        ConfigError,
        match=r'"hippie.staleness.error_feedback" = 0.5 with "hippie.staleness.method" = '
        r'"none"',
    ):
        error_feedback.check(
            StalenessConfig(method="none", delay_compensation=STRENGTH, error_feedback=0.5),
            schedules.compile("2bw", 2, 4),
        )
    for bad in (-1, float("inf")):
        with pytest.raises(ConfigError, match=r'config key "hippie.staleness.delay_compensation"'):
            split_config({"hippie": {"staleness": {"method": "none", "delay_compensation": bad}}})


# engine -> (precision, {(call, stage)} overflowed): fp32 (torch AdamW, one replica: exact; resumed from a
# checkpoint saved after 2 calls, batches in flight), bf16 (BF16_Optimizer), bf16 + ZeRO-1 (its fp32 masters
# partitioned over 2 replicas), fp16 (FP16_UnfusedOptimizer, with an overflow that skips an update), fp16 with
# DeepSpeed's fused Adam (FP16_Optimizer), fp16 + ZeRO-1 resumed
FP32 = {"2bw+nostale+dc30": ("fp32", ()), "2bw+nostale+dc30+ckpt2": ("fp32", ())}
ENGINES = {
    **FP32,
    "2bw+bf16+nostale+dc30": ("bf16", ()),
    "2bw+bf16+zero1+nostale+dc30": ("bf16+zero1", ()),
    "2bw+fp16+nostale+dc30+ovf1.1": ("fp16", {(1, 1)}),
    "2bw+fp16+fused+p12+nostale+dc30": ("fp16+fused", ()),
    "2bw+fp16+zero1+p12+nostale+dc30+ckpt2": ("fp16+zero1", ()),
}


def _launch(out, dp, engines):
    rc, log, _ = launch(
        2 * dp,
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
        ",".join(engines),
        timeout=900,
    )
    assert rc == 0, log[-4000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{engine: its output folder}: fp32 on one replica, the others on two."""
    fp32 = _launch(tmp_path_factory.mktemp("delay-compensation-fp32"), 1, FP32)
    others = _launch(tmp_path_factory.mktemp("delay-compensation"), 2, [n for n in ENGINES if n not in FP32])
    return {n: fp32 if n in FP32 else others for n in ENGINES}


def _rule(name, parts, strength=STRENGTH, overflows=None):
    kind, injected = ENGINES[name]
    precision = reference_precision(kind, name, MICRO_BATCHES, injected if overflows is None else overflows)
    staleness = StalenessConfig(method="none", delay_compensation=strength)
    dp = 1 if name in FP32 else 2
    return reference_async.run_2bw(
        parts, dp, MICRO_BATCHES, STEPS, optimizer="AdamW", lr=LR, clip=CLIP, precision=precision, staleness=staleness
    )[0], precision


@pytest.mark.fp16  # its launch builds fp16 engines too
@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in ENGINES if "ckpt" not in n or "fp16" in n])
def test_delay_compensation_matches_its_rule(trained, name):
    ours, _, parts, _, replicas = collect(trained[name], name)
    ref, precision = _rule(name, parts)
    assert_matches_rule("delay compensation", name, ENGINES[name][0], ours, ref, _rule(name, parts, strength=0.0)[0])
    if ENGINES[name][1]:  # the overflow skipped an update, on every stage alike
        assert any(precision.skipped)
        assert max_diff(ours, _rule(name, parts, overflows=set())[0]) > 2**-10
    if name not in FP32:  # fp32 runs one replica
        assert_replicas_equal(replicas, name)


@pytest.mark.fp16  # its launch builds fp16 engines too
@pytest.mark.distributed
def test_checkpoint_with_batches_in_flight_resumes_exactly(trained):
    """Saved after 2 calls (save_checkpoint drains the batches in flight) and resumed in a fresh engine:
    W_g, v and n travel in DeepSpeed's optimizer state (fp16 + ZeRO-1: per partition, checked against
    its rule in test_delay_compensation_matches_its_rule)."""
    a, b = (collect(trained[n], n)[0] for n in ("2bw+nostale+dc30", "2bw+nostale+dc30+ckpt2"))
    assert max_diff(a, b) == 0, "fp32: resumed differs from the run without a checkpoint"
    assert any(Path(trained["2bw+nostale+dc30+ckpt2"], "2bw+nostale+dc30+ckpt2", "ckpt").iterdir())
