"""fp16 under the schedules that never flush: ``2bw`` and ``pipedream`` with DeepSpeed's
dynamic loss scale (FP16_UnfusedOptimizer; ``+fused``: FP16_Optimizer, DeepSpeed's fused Adam;
``+zero1``: DeepSpeedZeroOptimizer), real ranks on gloo. The loss scale moves once per batch (pipedream:
at a batch's last micro-batch update). One overflow decision per update
for the whole pipeline, voted asynchronously (hippie_ds/adapter/precision/fp16_async.py): each rank starts a
MAX all-reduce of its flag at its update op; stage 0 (its backward is the update's last) waits for
it there, every other stage holds its gradient and applies or skips the update just before the
first op that needs it. Overflows are injected (the worker's ``+ovfS.T``: stage S's first gradient
infinite in every backward it runs during call T) into the last stage (2bw: its update of batch T
skipped on every stage; pipedream: micro-batch updates) and into stage 0 (whose backwards in a
call span two batches: two updates skipped). Each run matches the single-process reference of the
rule (reference_async.run_2bw / run_pipedream with reference_fp16.Fp16Async), skips the same
updates and ends at the same loss scale on every rank; a run resumed from a checkpoint saved
mid-way too (the checkpoint carries the scaler: its scale differs from the initial one then).
"""

from pathlib import Path

import pytest
import torch

import reference_async
import reference_fp16
from launch import collect, launch

from hippie_ds import schedules
from hippie_ds.config import ConfigError, StalenessConfig

STEPS, MICRO_BATCHES, LR, CLIP = 4, 4, 0.01, 0.5
POWER, WINDOW = 20, 2  # train_worker's "+fp16": initial_scale_power 20, loss_scale_window 2
FP16_TOLERANCE = 2**-10  # how far the rules are told apart; each run equals its own rule to 0 (the reference sums
# a tied module's copies per replica before the average and clips apart with DeepSpeed's function, as the engine does)
ZERO_SCALE_GROWS = 2**-20
# engine -> {(call, stage)} overflowed (the worker's "+ovfS.T" is stage S, call T); ckpt2: saved after 2 calls
# (save_checkpoint drains first), resumed in a fresh engine
TWO_BY_TWO = {
    "2bw+fp16": set(),
    "2bw+fp16+ovf1.1": {(1, 1)},
    "2bw+fp16+ovf0.2": {(2, 0)},
    "2bw+fp16+ckpt2+ovf1.1": {(1, 1)},
    "pipedream+fp16+ovf1.1": {(1, 1)},
    "pipedream+fp16+ovf0.2": {(2, 0)},
    "pipedream+vs+fp16+ovf1.3": {(3, 1)},
    "pipedream+fp16+ckpt2+ovf0.1": {(1, 0)},
    # the tied model (stage 0's embedding tied to stage 1's head; the tie sum lags 1 update): stage 0's
    # injected gradient is the tied weight's, so it reaches the updates that apply its lagged sum
    "2bw+fp16+tied+attrs+ovf0.1": {(1, 0)},
    "pipedream+fp16+tied+attrs+ovf1.1": {(1, 1)},
    "2bw+fp16+tied+attrs+ckpt2+ovf1.2": {(2, 1)},
    # ZeRO-1 as written (DeepSpeedZeroOptimizer scales the loss), from 2**12 (doubling every 2 updates):
    # each update's gradient multiplied from the last stage's scale at its backwards to its step's
    "2bw+fp16+zero1+p12": set(),
    "2bw+fp16+zero1+p12+ovf1.1": {(1, 1)},
    "pipedream+fp16+zero1+p12+ovf0.2": {(2, 0)},
    "pipedream+vs+fp16+zero1+p12+ovf1.1": {(1, 1)},
    "2bw+fp16+zero1+p12+ckpt2": set(),
    # "optimizer": {"type": "Adam"}: DeepSpeed's fused Adam in FP16_Optimizer, tied too
    "2bw+fp16+fused+ovf1.1": {(1, 1)},
    "pipedream+fp16+fused+ovf0.2": {(2, 0)},
    "2bw+fp16+fused+tied+attrs+ckpt2+ovf0.1": {(1, 0)},
    "pipedream+fp16+fused+tied+attrs+ovf1.1": {(1, 1)},
    # ZeRO-1 with the tied model: the lagged tie sum rescaled from its update's scale to the
    # applying update's; overflows injected into the tied copies' stages (0: the embedding; 1: the head)
    "2bw+fp16+zero1+p12+tied+attrs": set(),
    "2bw+fp16+zero1+p12+tied+attrs+ovf0.1": {(1, 0)},
    "pipedream+fp16+zero1+p12+tied+attrs+ovf1.1": {(1, 1)},
    "2bw+fp16+zero1+p12+tied+attrs+ckpt2+ovf1.2": {(2, 1)},
}
# 4 stages x 1: stages 1-3 hold their gradient, resolved at their next update op
FOUR_BY_ONE = {
    "2bw+fp16+ovf3.1": {(1, 3)},
    "2bw+fp16+ovf0.2": {(2, 0)},
    "2bw+fp16+ckpt2+ovf2.1": {(1, 2)},
    "2bw+fp16+zero1+p12+ovf3.1": {(1, 3)},
    "2bw+fp16+zero1+p12+ckpt2": set(),
}
SHAPES = {(2, 2): TWO_BY_TWO, (4, 1): FOUR_BY_ONE}


def _max_diff(a, b):
    return max((a[i][k].float() - b[i][k].float()).abs().max().item() for i in b for k in b[i])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    outs = {}
    for (stages, dp), engines in SHAPES.items():
        out = tmp_path_factory.mktemp(f"fp16-async-{stages}x{dp}")
        rc, log, _ = launch(
            stages * dp,
            out,
            "--stages",
            stages,
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
        outs[stages, dp] = out
    return outs


class _NotRescaled(reference_fp16.Fp16AsyncZero):
    """2bw's fp16 + ZeRO-1 rule without the engine's factor S(u) / S(r(u)): batch u's gradient keeps the
    scale the last stage had at its backwards, S(u - 1), and is unscaled by S(u)'s step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scales = [self.loss_scale.scale]

    def decide(self, applies):
        skip = super().decide(applies)
        self.scales.append(self.loss_scale.scale)
        return skip

    def scale_loss(self, loss):
        return loss * self.scales[max(0, len(self.scales) - 2)]


class _TieSumNotRescaled(reference_fp16.Fp16AsyncZero):
    """fp16 + ZeRO-1 with the tied model, the lagged tie sum applied at the scale of the update that made it."""

    rescales_tie_sums = False


def _rule(name, parts, stages, dp, overflows, kind=None):
    zero = "+zero1" in name
    fused = "+fused" in name and kind is None  # DeepSpeed's FusedAdam step (a run resumed after 2 calls: see Fp16Fused)
    kind = kind or (
        reference_fp16.Fp16AsyncZero if zero else reference_fp16.Fp16AsyncFused if fused else reference_fp16.Fp16Async
    )
    precision = kind(
        reference_fp16.LossScale(12 if zero else POWER, WINDOW), stages, MICRO_BATCHES, overflow_at=overflows
    )
    if fused and "ckpt2" in name:
        precision.resumed_after = 2
    kw = dict(optimizer="AdamW", lr=LR, clip=CLIP, precision=precision, tied="+tied" in name)
    if name.startswith("2bw"):  # the config's default staleness correction (extrapolate)
        layers, losses = reference_async.run_2bw(parts, dp, MICRO_BATCHES, STEPS, staleness=StalenessConfig(), **kw)
    else:
        layers, losses = reference_async.run_pipedream(
            parts, dp, MICRO_BATCHES, STEPS, vertical_sync="+vs" in name, **kw
        )
    return layers, losses, precision


CASES = [(shape, name) for shape, engines in SHAPES.items() for name in engines]


@pytest.mark.distributed
@pytest.mark.parametrize("shape,name", CASES, ids=[f"{s[0]}x{s[1]}-{n}" for s, n in CASES])
def test_one_asynchronous_decision_per_update_matches_the_rule(trained, shape, name):
    stages, dp = shape
    overflows = SHAPES[shape][name]
    out = trained[shape]
    ours, losses, parts, _, replicas = collect(out, name)
    ref, ref_losses, precision = _rule(name, parts, stages, dp, overflows)
    scale = precision.loss_scale
    diff = _max_diff(ours, ref)
    skipped = [u for u, skip in enumerate(precision.skipped) if skip]
    print(f"{name} {stages}x{dp}: |ours - reference| = {diff:.3g}, skipped updates {skipped}, scale {scale.scale}")
    # ZeRO-1 untied: a gradient the last stage computed at half the scale of its step loses its smallest bits in fp16
    # (the rule computes it at the step's scale); measured 4.8e-7 where the scale grows, 0 elsewhere
    assert diff <= (ZERO_SCALE_GROWS if "+zero1" in name and "+tied" not in name else 0), (
        f"{name}: differs from its fp16 reference by {diff}"
    )
    if name.startswith("2bw") and "+zero1" in name and not overflows:  # the factor is seen
        unscaled = _max_diff(ours, _rule(name, parts, stages, dp, overflows, _NotRescaled)[0])
        print(f"  without the factor S(u) / S(u - 1): {unscaled:.3g}")
        assert unscaled > FP16_TOLERANCE
    per_update = 1 if name.startswith("2bw") else MICRO_BATCHES
    # an overflow in the last stage skips its updates of that call's batch; in stage 0, the backwards of one call
    # span two batches (2bw: two updates; pipedream: as many micro-batches as its backwards of that call)
    if "+tied" in name and "+zero1" in name and not overflows:  # the tie sum's rescale is seen
        plain = _rule(name, parts, stages, dp, overflows, _TieSumNotRescaled)[0]
        print(f"  tie sum not rescaled: {_max_diff(ours, plain):.3g}")
        assert _max_diff(ours, plain) > FP16_TOLERANCE
    if overflows:
        assert skipped, "the injected overflow skipped nothing"
        assert _max_diff(ours, _rule(name, parts, stages, dp, set())[0]) > FP16_TOLERANCE  # the skip is seen
    if overflows and min(s for _, s in overflows) == stages - 1:
        assert len(skipped) == per_update
    ranks = [torch.load(f) for f in sorted(Path(out, name).glob("rank*.pt"))]
    if "+tied" in name:  # every holder's copy identical
        copies = [r["tied"]["tied"]["weight"] for r in ranks]
        assert all(torch.equal(c, copies[0]) for c in copies), name
    for r in ranks:  # every rank: the same decisions, the same scale
        assert (r["skipped_steps"], r["loss_scale"]) == (len(skipped), scale.scale), (name, r["stage"], r["replica"])
        if r["losses"]:
            assert r["losses"] == pytest.approx(ref_losses, rel=2**-9)  # the loss is an fp16 value
    for i in replicas[0]:
        for k, v in replicas[0][i].items():
            assert torch.equal(replicas[1 if dp > 1 else 0][i][k], v), (name, i, k)


@pytest.mark.distributed
def test_was_step_applied_reports_only_skipped_updates(trained):
    """``engine.was_step_applied()`` after each call (Megatron-DeepSpeed counts a False as a skipped
    iteration and logs no loss for it): True on every rank and call without an overflow, though the stages
    after the first hold their update to a later call (2bw's last stage answered False after the first
    call, on Megatron-DeepSpeed's GPT too); an injected overflow shows as a False."""
    for (stages, dp), engines in SHAPES.items():
        for name, overflows in engines.items():
            ranks = [torch.load(f) for f in sorted(Path(trained[stages, dp], name).glob("rank*.pt"))]
            applied = [r["applied"] for r in ranks]
            assert all(len(a) == STEPS for a in applied), (name, applied)
            if not overflows:
                assert all(all(a) for a in applied), (name, applied)
            elif "ckpt" not in name:  # (2bw ckpt2: save_checkpoint's drain decides the skipped update)
                assert not all(all(a) for a in applied), (name, applied)


@pytest.mark.distributed
def test_checkpoint_carries_the_loss_scaler(trained):
    """The runs resumed from a checkpoint saved after 2 calls equal the runs without it (2bw, same
    overflows) and their reference (above); the saved optimizer state holds the scale reached
    then, not the initial one."""
    out = trained[2, 2]
    full, _, _, _, _ = collect(out, "2bw+fp16+ovf1.1")
    resumed, _, _, _, _ = collect(out, "2bw+fp16+ckpt2+ovf1.1")
    assert _max_diff(full, resumed) == 0
    from hippie_ds.adapter.checkpoint import state as checkpoint_state

    scales = set()
    for f in Path(out, "2bw+fp16+ckpt2+ovf1.1", "ckpt").rglob("*.pt"):
        with checkpoint_state.loading():  # the in-flight state (stashed versions) unpickles here only
            state = torch.load(f, map_location="cpu", weights_only=False)
        optimizer = state.get("optimizer") if isinstance(state, dict) else None
        if isinstance(optimizer, dict) and "cur_scale" in optimizer:
            scales.add(float(optimizer["cur_scale"]))
    # after 2 calls: update 0 applied, update 1 skipped (stage 1's overflow in call 1): 2**20 halved
    assert scales == {2.0 ** (POWER - 1)}


def _ds_config(**keys):
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, **keys}, mpu=None)


def test_where_the_vote_can_be_waited_for():
    """2bw runs in fp16 at every shape; pipedream at 2 stages (with and without vertical sync), refused
    at 3 stages or more, naming the stage that would wait for a later decision; ZeRO-1 as written runs,
    with overlap_comm refused."""
    from hippie_ds.adapter.precision.fp16_async import vote_problem, waits_at_update
    from hippie_ds.adapter.precision.paths import check_precision

    fp16 = {"fp16": {"enabled": True}}
    for stages in (2, 3, 4, 6):
        for micro_batches in (stages, 8):
            c = schedules.compile("2bw", stages, micro_batches)
            assert vote_problem(c) is None
            assert [waits_at_update(c, s) for s in range(stages)] == [True] + [False] * (stages - 1)
            check_precision(c, _ds_config(**fp16))
    for params in ({}, {"vertical_sync": True}):
        assert vote_problem(schedules.compile("pipedream", 2, 4, **params)) is None
        for stages in (3, 4):
            c = schedules.compile("pipedream", stages, 8, **params)
            assert "stage 2 needs the overflow decision" in vote_problem(
                c
            ) or "stage 3 needs the overflow decision" in vote_problem(c)
            with pytest.raises(
                ConfigError,
                match=r"schedule 'pipedream'.*cannot be waited for in time: stage \d "
                r"needs the overflow decision.*runs with fp16: 1f1b, 2bw, gpipe",
            ):
                check_precision(c, _ds_config(**fp16))
    check_precision(schedules.compile("2bw", 2, 4), _ds_config(**fp16, zero_optimization={"stage": 1}))  # as written
    with pytest.raises(
        ConfigError,
        match=r"schedule '2bw'.*built on ZeRO stage 0 and on ZeRO stage 1 without "
        r"overlap_comm",
    ):
        check_precision(
            schedules.compile("2bw", 2, 4), _ds_config(**fp16, zero_optimization={"stage": 1, "overlap_comm": True})
        )
    # the last stage's resolved updates at its backwards
    from hippie_ds.adapter.precision.fp16_async import loss_scale_updates

    assert loss_scale_updates(schedules.compile("2bw", 4, 8))[1] == 1  # r(u) = u - 1
    assert loss_scale_updates(schedules.compile("pipedream", 2, 4))[1] == 0  # r(u) = u
