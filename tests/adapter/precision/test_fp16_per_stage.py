"""fp16 under per-stage updates: the hippie family with DeepSpeed's dynamic loss scale
(FP16_UnfusedOptimizer; ``+fused``: FP16_Optimizer, DeepSpeed's fused Adam; ``+zero1``:
DeepSpeedZeroOptimizer), 2 stages x 2 replicas, real ranks. One overflow decision per update for
the whole pipeline (hippie_ds/adapter/precision/fp16_stage.py): overflows are injected into one stage's
gradient at a chosen step (the worker's ``+ovfS.T``): into the in-step stage 1 (its update of that
batch is skipped, and so is the deferred stage's update that goes with it) or into the deferred
stage 0's delayed layer (its buffered gradient overflows; the next update is skipped on every stage).
Each run equals the single-process reference of the rule in fp16 bit for bit (reference_fp16.Fp16;
Fp16Fused: DeepSpeed's own FusedAdam step on flat masters, as FP16_Optimizer takes it), skips the
same updates and ends at the same loss scale on every rank; a run resumed from a checkpoint saved
mid-way (the loss scaler's state and the buffered gradient in it) too, and ``drain()``'s update
(``+flush``: every rank votes; the deferred stage applies its last buffer, its in-step layers unmoved).
"""

import pytest
import torch

import reference
import reference_fp16
from launch import collect, launch

from hippie_ds.config import StalenessConfig

pytestmark = pytest.mark.distributed

STEPS, MICRO_BATCHES, LR, CLIP = 4, 4, 0.01, 0.5
POWER, WINDOW = 20, 2  # train_worker's "+fp16": initial_scale_power 20, loss_scale_window 2
# (engine, {(batch, stage)} overflowed); ckpt2: saved after 2 steps, resumed in a fresh engine
ENGINES = {
    "hippie+fp16": (),
    "hippie+fp16+ovf1.1": {(1, 1)},
    "hippie+fp16+ovf0.1": {(1, 0)},
    "hippie-1f1b+fp16+ovf1.2": {(2, 1)},
    "hippie-zb+fp16+ovf0.2": {(2, 0)},
    "hippie+fp16+ckpt2+ovf1.2": {(2, 1)},
    "hippie+fp16+flush": (),
    "hippie-1f1b+fp16+flush+ovf0.3": {(3, 0)},
    # "optimizer": {"type": "Adam"}: DeepSpeed's fused Adam in FP16_Optimizer
    "hippie+fp16+fused+ovf1.1": {(1, 1)},
    "hippie-zb+fp16+fused+flush+ovf0.2": {(2, 0)},
    "hippie+fp16+fused+ckpt2": (),
}
INTERLEAVED = "hippie-interleaved+fp16+ovf1.1"
# ZeRO-1 as written (DeepSpeedZeroOptimizer), which scales the loss: from 2**12 (no overflow of the scaled
# loss, the scale doubles every 2 updates) a deferred stage's buffer is applied after the scale changed,
# multiplied by S(now)/S(then) (GradStore.rescale); engine -> overflows
ZERO = {
    "hippie+fp16+zero1+p12": (),
    "hippie+fp16+zero1+p12+ovf1.1": {(1, 1)},
    "hippie-zb+fp16+zero1+p12+ovf0.2": {(2, 0)},
    "hippie+fp16+zero1+p12+ckpt2": (),
}
# the tied model (an embedding on stage 0 tied to the head on stage 1): engine -> (deferred stages, their
# delayed layers, "untied" rule, overflows). "+dl1" delays the tied weight (stage 1 then delays its copy
# only); the default ("untied") delays stage 0's first untied layer. The holders clip by their joint norm,
# reduced once (fp16_stage.Fp16Votes.joint_norm).
TIED = {
    "hippie+fp16+tied+attrs+dl1": ([0, 1], {0: 1, 1: 0}, False, ()),
    "hippie+fp16+tied+attrs": ([0], {0: 3}, True, ()),
    "hippie-zb+fp16+tied+attrs+dl1+ovf1.1": ([0, 1], {0: 1, 1: 0}, False, {(1, 1)}),
    "hippie+fp16+fused+tied+attrs+dl1+ovf0.1": ([0, 1], {0: 1, 1: 0}, False, {(1, 0)}),
    # fp16 + ZeRO-1 (from 2**12) with the tied module, both holders deferring it: the buffers rescaled
    "hippie+fp16+zero1+p12+tied+attrs+dl1+ovf0.2": ([0, 1], {0: 1, 1: 0}, False, {(2, 0)}),
}
# how far the rules are told apart (one fp16 unit at |w| < 1 is 2**-11); each run equals its own rule to 0
FP16_TOLERANCE = 2**-10


def _fp16(name, power=POWER, overflows=()):
    """The reference's precision of engine ``name``: ``+fused``: DeepSpeed's FusedAdam step (Fp16Fused; a run
    resumed after 2 steps takes the kernel's beta powers by ``pow`` from there, as the resumed engine does)."""
    scale = reference_fp16.LossScale(power, WINDOW)
    if "+fused" in name:
        return reference_fp16.Fp16Fused(scale, overflow_at=overflows, resumed_after=2 if "ckpt2" in name else None)
    return reference_fp16.Fp16(scale, overflow_at=overflows)


def _max_diff(a, b):
    return max((a[i][k].float() - b[i][k].float()).abs().max().item() for i in b for k in b[i])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16-per-stage")
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
        "--deferred-layers",
        "default",
        "--engines",
        ",".join([*ENGINES, INTERLEAVED, *TIED, *ZERO]),
        timeout=900,
    )
    assert rc == 0, log[-4000:]
    return out


def _ranks(out, name):
    return [torch.load(f) for f in sorted((out / name).glob("rank*.pt"))]


@pytest.mark.parametrize("name", list(ENGINES))
def test_one_overflow_decision_per_update_matches_the_rule(trained, name):
    ours, losses, parts, params, replicas = collect(trained, name)
    deferred = params["deferred_stages"]
    assert deferred == [0]

    def rule(deferred_stages):
        precision = _fp16(name, overflows=ENGINES[name])
        layers, ref_losses = reference.run(
            parts,
            2,
            MICRO_BATCHES,
            STEPS,
            deferred=deferred_stages,
            delayed_layers={s: 1 for s in deferred_stages},
            staleness=StalenessConfig(),
            optimizer="AdamW",
            lr=LR,
            clip=CLIP,
            precision=precision,
            flush="flush" in name,
        )
        return layers, ref_losses, precision.loss_scale

    ref, ref_losses, scale = rule(deferred)
    sync, _, _ = rule(())
    diff = _max_diff(ours, ref)
    print(
        f"{name}: |ours - reference| = {diff:.3g}, synchronous rule {_max_diff(sync, ref):.3g}, "
        f"skipped {[u for u, skip in scale.history if skip]}, scale {scale.scale}"
    )
    assert diff == 0, f"{name}: differs from its fp16 reference by {diff}"
    assert _max_diff(sync, ref) > FP16_TOLERANCE  # the rule is told apart (after a drain: 1.5x)
    assert sum(skip for _, skip in scale.history) == len(ENGINES[name])  # an overflow skips one update
    skipped = sum(skip for update, skip in scale.history if update < STEPS)  # drain()'s counts no step
    for r in _ranks(trained, name):  # every rank: the same decisions, the same scale
        assert (r["skipped_steps"], r["loss_scale"]) == (skipped, scale.scale), (r["stage"], r["replica"])
        if r["losses"]:
            assert r["losses"] == pytest.approx(ref_losses, rel=2**-9)  # the loss is an fp16 value
    for i in replicas[0]:
        for k, v in replicas[0][i].items():
            assert torch.equal(replicas[1][i][k], v), (name, i, k)


def test_virtual_stages_take_the_same_decision_on_every_rank(trained):
    """hippie-interleaved: an overflow in stage 1's chunk skips the update on every rank."""
    ranks = _ranks(trained, INTERLEAVED)
    assert {(r["skipped_steps"], r["loss_scale"]) for r in ranks} == {(1, 2.0**POWER / 2)}
    assert all(all(torch.isfinite(torch.tensor(r["losses"]))) for r in ranks if r["losses"])


@pytest.mark.parametrize("name", list(TIED))
def test_tied_module_under_one_overflow_decision(trained, name):
    """A module tied across stages in fp16: every copy stays identical, the run matches its rule
    bit for bit (each replica sums the copies' fp16 gradients over the tie group, then the replicas
    average, as the engine does; the holders clip by their joint norm, which ZeRO-1 takes with the
    last stage's ``ds_pipe_replicated`` copy left out), and an overflow skips the update on every rank."""
    deferred, layers, untied, overflows = TIED[name]
    ours, losses, parts, params, replicas = collect(trained, name)
    assert params["deferred_stages"] == deferred
    ranks = _ranks(trained, name)
    copies = [r["tied"]["tied"]["weight"] for r in ranks]
    assert all(torch.equal(c, copies[0]) for c in copies)
    zero = "+zero1" in name
    precision = (
        reference_fp16.Fp16Zero(reference_fp16.LossScale(12, WINDOW), overflow_at=overflows)
        if zero
        else _fp16(name, overflows=overflows)
    )
    ref, _ = reference.run(
        parts,
        2,
        MICRO_BATCHES,
        STEPS,
        deferred=deferred,
        delayed_layers=layers,
        tied=True,
        untied=untied,
        staleness=StalenessConfig(),
        optimizer="AdamW",
        lr=LR,
        clip=CLIP,
        precision=precision,
    )
    diff = _max_diff(ours, ref)
    assert diff == 0, f"{name}: differs from its fp16 reference by {diff}"
    assert torch.equal(copies[0], ref[0]["weight"].float())
    skipped = sum(skip for _, skip in precision.loss_scale.history)
    assert skipped == len(overflows)
    assert {(r["skipped_steps"], r["loss_scale"]) for r in ranks} == {(skipped, precision.loss_scale.scale)}


@pytest.mark.parametrize("name", list(ZERO))
def test_zero1_scales_the_loss_and_the_buffer(trained, name):
    """fp16 + ZeRO-1: the same one decision per update, with the loss scaled; each run equals its
    rule's reference (reference_fp16.Fp16Zero), which differs from the rule that would not rescale the
    buffer and from the synchronous rule; a checkpoint resumed mid-way carries the buffer's scale."""
    ours, _, parts, params, replicas = collect(trained, name)
    deferred = params["deferred_stages"]

    def rule(zero_class, deferred_stages):
        precision = zero_class(reference_fp16.LossScale(12, WINDOW), overflow_at=ZERO[name])
        layers, _ = reference.run(
            parts,
            2,
            MICRO_BATCHES,
            STEPS,
            deferred=deferred_stages,
            delayed_layers={s: 1 for s in deferred_stages},
            staleness=StalenessConfig(),
            optimizer="AdamW",
            lr=LR,
            clip=CLIP,
            precision=precision,
        )
        return layers, precision.loss_scale

    class NoRescale(reference_fp16.Fp16Zero):
        def rescaled(self, grads, made_at):
            return grads

    ref, scale = rule(reference_fp16.Fp16Zero, deferred)
    diff = _max_diff(ours, ref)
    print(
        f"{name}: |ours - reference| = {diff:.3g}, without the rescale "
        f"{_max_diff(rule(NoRescale, deferred)[0], ref):.3g}, synchronous "
        f"{_max_diff(rule(reference_fp16.Fp16Zero, ())[0], ref):.3g}, history {scale.history}"
    )
    assert diff == 0, f"{name}: differs from its fp16 + ZeRO-1 reference by {diff}"
    if name != "hippie-zb+fp16+zero1+p12+ovf0.2":  # there the rescaled buffer is the skipped update's
        assert _max_diff(rule(NoRescale, deferred)[0], ref) > FP16_TOLERANCE
    assert _max_diff(rule(reference_fp16.Fp16Zero, ())[0], ref) > FP16_TOLERANCE
    skipped = sum(skip for _, skip in scale.history)
    assert skipped == len(ZERO[name])
    for r in _ranks(trained, name):
        assert (r["skipped_steps"], r["loss_scale"]) == (skipped, scale.scale), (r["stage"], r["replica"])
    for i in replicas[0]:
        for k, v in replicas[0][i].items():
            assert torch.equal(replicas[1][i][k], v), (name, i, k)
