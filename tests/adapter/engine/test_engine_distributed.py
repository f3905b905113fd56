"""The engine with real ranks: gloo, several processes (forked after one import, as DeepSpeed's launcher
starts them; the failed-rank tests under the `deepspeed` launcher itself).

- hippie-ds 1f1b, gpipe and zb-h1 (split backward, W in micro-batch order) give bit-identical
  parameters to DeepSpeed's stock engine;
- hippie, hippie-1f1b and hippie-zb match a single-process reference of the declared rule to 1e-6, with
  the default staleness correction and with it switched off;
- checkpoint / resume with a pending gradient is exact; crashes end the job; bad configs fail
  on every rank before any collective.
"""

import json
import os

import pytest
import torch

import reference
from launch import collect, launch

from hippie_ds.config import StalenessConfig
from hippie_ds.schedules.costs import Costs

pytestmark = pytest.mark.distributed

DEFAULT_STALENESS = StalenessConfig()  # what a config without "hippie.staleness" runs
NO_CORRECTION = StalenessConfig(method="none")

STEPS, MICRO_BATCHES = 3, 4
ENGINES = "stock,1f1b,gpipe,zb-h1,hippie,hippie-1f1b,hippie-zb"
COMM_TOLERANCE = 1e-6  # fp32 model, bf16 on the wire (communication_data_type)


def _assert_equal(a, b, what):
    for i in a:
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), f"{what}: layer {i} {k} differs by {(a[i][k] - b[i][k]).abs().max()}"


def _assert_close(a, b, what, atol=1e-6):
    for i in b:
        for k in b[i]:
            diff = (a[i][k] - b[i][k]).abs().max().item()
            assert diff <= atol, f"{what}: layer {i} {k} differs by {diff}"


def _replicas_identical(replicas):
    first = replicas[0]
    for r, state in replicas.items():
        _assert_equal(first, state, f"replica {r} vs 0")


# 4 stages x 2 replicas (8 ranks on the CI's 2 cores) left out for CI time: 4 stages and 2 replicas are each
# covered, and test_precision's 4x2 bf16 launch runs every schedule on that shape against its references
@pytest.mark.parametrize("stages,dp", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_schedules_exact(tmp_path, stages, dp):
    rc, log, secs = launch(
        stages * dp,
        tmp_path,
        "--stages",
        stages,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        STEPS,
        "--engines",
        ENGINES,
    )
    assert rc == 0, log[-4000:]
    stock, stock_losses, parts, _, _ = collect(tmp_path, "stock")
    for name in ("1f1b", "gpipe", "zb-h1"):
        ours, losses, _, _, replicas = collect(tmp_path, name)
        _assert_equal(stock, ours, f"{name} vs stock DeepSpeed")
        assert losses == stock_losses
        _replicas_identical(replicas)
    for name in ("hippie", "hippie-1f1b", "hippie-zb"):
        ours, losses, parts, params, replicas = collect(tmp_path, name)
        assert params["deferred_stages"] == list(range(stages // 2))
        ref, ref_losses = reference.run(
            parts, dp, MICRO_BATCHES, STEPS, deferred=params["deferred_stages"], staleness=DEFAULT_STALENESS
        )
        _assert_close(ours, ref, f"{name} vs reference")
        for rank_losses in losses.values():
            if rank_losses:
                assert rank_losses == pytest.approx(ref_losses, abs=1e-6)
        _replicas_identical(replicas)
        if stages > 1:  # the deferred rule really is in effect: differs from the synchronous result
            assert any(not torch.equal(ours[i][k], stock[i][k]) for i in ours for k in ours[i])


def test_hippie_adamw_clipping_all_deferred(tmp_path):
    args = (
        "--stages",
        2,
        "--micro-batches",
        3,
        "--steps",
        4,
        "--engines",
        "hippie,hippie-1f1b,hippie-zb",
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--clip",
        0.05,
        "--deferred",
        "0,1",
    )
    rc, log, _ = launch(4, tmp_path, *args)
    assert rc == 0, log[-4000:]
    for name in ("hippie", "hippie-1f1b", "hippie-zb"):
        ours, _, parts, params, replicas = collect(tmp_path, name)
        assert params["deferred_stages"] == [0, 1]
        ref, _ = reference.run(
            parts, 2, 3, 4, deferred=[0, 1], optimizer="AdamW", lr=0.01, clip=0.05, staleness=DEFAULT_STALENESS
        )
        _assert_close(ours, ref, f"{name} AdamW+clip vs reference")
        noclip, _ = reference.run(
            parts, 2, 3, 4, deferred=[0, 1], optimizer="AdamW", lr=0.01, staleness=DEFAULT_STALENESS
        )
        assert any((ours[i][k] - noclip[i][k]).abs().max() > 1e-4 for i in ours for k in ours[i]), (
            "clipping had no effect: the test would not catch a wrong clipping rule"
        )
        _replicas_identical(replicas)


@pytest.mark.parametrize("optimizer,lr,stages", [("SGD", 0.05, 2), ("AdamW", 0.01, 4)])
def test_staleness_correction_matches_its_rule(tmp_path, optimizer, lr, stages):
    """stages x 2 replicas, every stage deferred: extrapolation with a non-default coefficient,
    no correction and (AdamW) Adam's predicted update ("adam", same coefficient) each match the
    reference of their rule, and differ from each other."""
    deferred = list(range(stages))
    args = (
        "--stages",
        stages,
        "--micro-batches",
        3,
        "--steps",
        5,
        "--optimizer",
        optimizer,
        "--lr",
        lr,
        "--deferred",
        ",".join(map(str, deferred)),
    )
    results = {}
    # one launch (CI time): "+nostale" engines run without the correction, "+adam" with Adam's
    # prediction (AdamW only), the others extrapolate
    extrapolate = StalenessConfig(method="extrapolate", coefficient=1.5)
    adam = StalenessConfig(method="adam", coefficient=1.5)
    rules = [(extrapolate, "", ("hippie", "hippie-1f1b")), (NO_CORRECTION, "+nostale", ("hippie", "hippie-1f1b"))]
    if optimizer == "AdamW":
        rules.append((adam, "+adam", ("hippie",)))
    engines = ",".join(name + suffix for _, suffix, names in rules for name in names)
    rc, log, _ = launch(
        stages * 2,
        tmp_path,
        *args,
        "--engines",
        engines,
        "--staleness",
        f"{extrapolate.method}:{extrapolate.coefficient}",
    )
    assert rc == 0, log[-4000:]
    for staleness, suffix, names in rules:
        for name in names:
            ours, losses, parts, _, replicas = collect(tmp_path, name + suffix)
            ref, ref_losses = reference.run(
                parts, 2, 3, 5, deferred=deferred, optimizer=optimizer, lr=lr, staleness=staleness
            )
            _assert_close(ours, ref, f"{name} {staleness} vs reference")
            for rank_losses in losses.values():
                assert rank_losses == pytest.approx(ref_losses, abs=1e-6)
            _replicas_identical(replicas)
        results[staleness.method] = ours
    for method in results:
        for other in results:
            assert method == other or any(
                (results[method][i][k] - results[other][i][k]).abs().max() > 1e-4
                for i in results[other]
                for k in results[other][i]
            ), f"{method} and {other}: the same weights"


def test_partial_deferral_matches_its_rule(tmp_path):
    """2 stages x 2 replicas, stage 0 deferred but only its first 2 layers with parameters delayed
    (``hippie.deferred_layers: 2``: Linear, Tanh, Linear, the reference's first 3 layers), the rest
    of it all-reduced and applied in-step: matches the reference of that rule (AdamW, default
    correction), which differs from delaying all of stage 0."""
    args = (
        "--stages",
        2,
        "--micro-batches",
        3,
        "--steps",
        5,
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--deferred",
        "0",
        "--schedule-override",
        json.dumps({"deferred_layers": 2}),
        "--timeline",
    )
    rc, log, _ = launch(4, tmp_path, *args, "--engines", "hippie,hippie-1f1b")
    assert rc == 0, log[-4000:]
    # stage 0's synchronous part is all-reduced from inside its last backward, not after it
    timelines = [json.loads(f.read_text()) for f in sorted((tmp_path / "hippie" / "timeline").glob("rank*.json"))]
    assert len([t for t in timelines if t["stage"] == 0]) == 2
    for events in (t["events"] for t in timelines if t["stage"] == 0):
        last = max(e["step"] for e in events)
        step = [e for e in events if e["step"] == last]
        backward = max((e for e in step if e["kind"] == "BackwardPass"), key=lambda e: e["start"])
        flight = next(e for e in step if e["name"] == "allreduce(grads)")
        assert backward["start"] <= flight["start"] < backward["end"], (backward, flight)
    # the public instruction hook saw what the timeline (itself a hook) kept: every instruction
    for f in sorted((tmp_path / "hippie").glob("rank*.pt")):
        rank = torch.load(f)
        timeline = json.loads((tmp_path / "hippie" / "timeline" / f"{f.stem}.json").read_text())
        kinds = [e["kind"] for e in timeline["events"] if e["category"] != "comm"]
        assert rank["hook_counts"] == {k: kinds.count(k) for k in set(kinds)} and len(kinds) > 20
    # ... and the timelines make a cost file (hippie-ds costs --timeline)
    from hippie_ds.cli import main as cli

    assert (
        cli(
            [
                "costs",
                "--timeline",
                str(tmp_path / "hippie" / "timeline"),
                "--data-parallel",
                "2",
                "--allreduce-bandwidth",
                "125MB/s",
                "--out",
                str(tmp_path / "costs.yaml"),
            ]
        )
        == 0
    )
    costs = Costs.from_file(tmp_path / "costs.yaml")
    assert len(costs.stages) == 2 and costs.comm.data_parallel == 2 and costs.comm.allreduce_bandwidth == 125e6
    sizes = {t["stage"]: t["param_bytes"] for t in timelines}
    for s, stage in enumerate(costs.stages):
        assert stage.forward > 0 and stage.backward > 0 and stage.param_bytes == sizes[s] > 0
    assert costs.stages[0].optimizer_time > 0  # the deferred stage's buffered update and in-step part
    for name in ("hippie", "hippie-1f1b"):
        ours, losses, parts, _, replicas = collect(tmp_path, name)
        ref, ref_losses = reference.run(
            parts, 2, 3, 5, deferred=[0], optimizer="AdamW", lr=0.01, staleness=DEFAULT_STALENESS, delayed_layers={0: 3}
        )
        _assert_close(ours, ref, f"{name} partial deferral vs reference")
        for rank_losses in losses.values():
            assert rank_losses == pytest.approx(ref_losses, abs=1e-6)
        _replicas_identical(replicas)
    whole, _ = reference.run(parts, 2, 3, 5, deferred=[0], optimizer="AdamW", lr=0.01, staleness=DEFAULT_STALENESS)
    assert any((whole[i][k] - ours[i][k]).abs().max() > 1e-4 for i in whole for k in whole[i]), (
        "partial deferral changed nothing"
    )


def test_communication_data_type_is_the_wire(tmp_path):
    """DeepSpeed's ``communication_data_type`` (bf16 on an fp32 model) is the dtype of hippie's own
    all-reduces too, as of stock DeepSpeed's: 1f1b stays bit-identical to stock, and hippie with
    partial deferral (its in-step part and its buffer both cross the wire) matches the reference
    of its rule with each replica's gradient rounded to bf16 on the wire, not the fp32 one."""
    args = (
        "--stages",
        2,
        "--micro-batches",
        3,
        "--steps",
        5,
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--deferred",
        "0",
        "--deferred-layers",
        2,
        "--comm-dtype",
        "bf16",
    )  # 2 layers with parameters: the first 3 layers
    rc, log, _ = launch(4, tmp_path, *args, "--engines", "stock,1f1b,hippie")
    assert rc == 0, log[-4000:]
    stock, stock_losses, *_ = collect(tmp_path, "stock")
    ours, losses, *_ = collect(tmp_path, "1f1b")
    _assert_equal(ours, stock, "1f1b vs stock, bf16 on the wire")
    assert losses == stock_losses
    ours, losses, parts, _, replicas = collect(tmp_path, "hippie")
    rule = dict(deferred=[0], optimizer="AdamW", lr=0.01, staleness=DEFAULT_STALENESS, delayed_layers={0: 3})
    ref, ref_losses = reference.run(parts, 2, 3, 5, precision=reference.Precision(comm=torch.bfloat16), **rule)
    _assert_close(ours, ref, "hippie with bf16 on the wire vs reference", atol=COMM_TOLERANCE)
    for rank_losses in losses.values():
        assert rank_losses == pytest.approx(ref_losses, abs=1e-6)
    _replicas_identical(replicas)
    wide, _ = reference.run(parts, 2, 3, 5, **rule)  # the fp32 wire: farther than the tolerance
    assert any((wide[i][k] - ours[i][k]).abs().max() > 10 * COMM_TOLERANCE for i in wide for k in wide[i]), (
        "bf16 on the wire changed nothing"
    )


def test_auto_deferred_layers_on_a_fast_link_delays_nothing(tmp_path):
    """``hippie.deferred_layers: "auto"`` with a per-stage cost file (the layers' shares from the
    model's own layer specs): on a link fast enough to hide stage 0's all-reduce it delays 0
    layers, so stage 0 runs as an ordinary stage (no gradient buffer): synchronous training,
    equal to the reference without deferral. The first replica of stage 0 logs the choice."""
    costs = tmp_path / "costs.yaml"
    costs.write_text(
        "stages: {forward: 0.01, backward: 0.02, param_bytes: 1.0e4}\n"
        "comm: {allreduce_bandwidth: 1.0e15, data_parallel: 2}\n"
    )
    args = (
        "--stages",
        2,
        "--micro-batches",
        3,
        "--steps",
        3,
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--deferred",
        "0",
        "--schedule-override",
        json.dumps({"deferred_layers": "auto", "costs": str(costs), "deepspeed": {"log_level": "info"}}),
    )
    rc, log, _ = launch(4, tmp_path, *args, "--engines", "hippie")
    assert rc == 0, log[-4000:]
    assert "deferred_layers auto, stage 0: delays 0 of" in log, log[-4000:]
    ours, _, parts, _, replicas = collect(tmp_path, "hippie")
    ref, _ = reference.run(parts, 2, 3, 3, deferred=[], optimizer="AdamW", lr=0.01, staleness=DEFAULT_STALENESS)
    _assert_close(ours, ref, "hippie auto deferred_layers (0 layers) vs synchronous reference")
    _replicas_identical(replicas)


def test_flush_applies_pending_gradient(tmp_path):
    rc, log, _ = launch(2, tmp_path, "--stages", 2, "--steps", 3, "--engines", "hippie", "--deferred", "0", "--flush")
    assert rc == 0, log[-4000:]
    ours, _, parts, _, _ = collect(tmp_path, "hippie")
    # After the flush, stage 0 has applied g(0), g(1), g(2): the reference with one more
    # step whose gradient is never computed equals the synchronous rule for stage 0.
    ref, _ = reference.run(parts, 1, MICRO_BATCHES, 3, deferred=[0], staleness=DEFAULT_STALENESS)
    layers0 = range(*parts[0])
    assert any(not torch.equal(ours[i][k], ref[i][k]) for i in ref if i in layers0 for k in ref[i])
    _assert_close(
        {i: v for i, v in ours.items() if i not in layers0},
        {i: v for i, v in ref.items() if i not in layers0},
        "stage 1 unaffected by the flush",
    )


@pytest.mark.parametrize("name", ["hippie", "hippie-zb"])
def test_checkpoint_resume_with_pending_gradient(tmp_path, name):
    common = (
        "--stages",
        2,
        "--micro-batches",
        3,
        "--engines",
        name,
        "--deferred",
        "0",
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
    )
    rc, log, _ = launch(4, tmp_path / "full", *common, "--steps", 5)
    assert rc == 0, log[-4000:]
    unapplied = "the last step's delayed gradient not applied to the weights in memory"
    assert log.count(unapplied) == 1, log[-4000:]  # no drain: said at exit, by stage 0's first replica
    rc, log, _ = launch(4, tmp_path / "part", *common, "--steps", 5, "--checkpoint-at", 3)
    assert rc == 0, log[-4000:]
    assert unapplied not in log, log[-4000:]  # saved, then exits (Megatron's --exit-interval): the checkpoint holds it
    rc, log, _ = launch(4, tmp_path / "resumed", *common, "--steps", 5, "--resume", tmp_path / "part" / name / "ckpt")
    assert rc == 0, log[-4000:]
    full, full_losses, *_ = collect(tmp_path / "full", name)
    _, part_losses, *_ = collect(tmp_path / "part", name)
    resumed, resumed_losses, *_ = collect(tmp_path / "resumed", name)
    _assert_equal(full, resumed, "resumed vs uninterrupted")
    for rank, losses in full_losses.items():
        assert part_losses[rank] + resumed_losses[rank] == losses


@pytest.mark.parametrize("failure", ["--crash-rank", "--kill-rank"])
def test_failed_rank_ends_the_job(tmp_path, failure):
    rc, log, secs = launch(
        4, tmp_path, "--stages", 2, "--steps", 50, "--engines", "hippie", failure, 1, timeout=120, launcher="deepspeed"
    )  # as a user's job ends: under DeepSpeed's launcher
    assert rc != 0
    assert secs < 90, f"job took {secs:.0f}s to exit after a rank failed"


@pytest.mark.parametrize(
    "override,message",
    [
        ({"pipeline": {"schedule": "no-such-schedule"}}, "unknown schedule 'no-such-schedule'"),
        ({"deferred_stages": [5]}, "stage(s) [5] out of range"),
        ({"unknown_key": 1}, '"hippie.unknown_key"'),
    ],
)
def test_bad_config_fails_on_every_rank(tmp_path, override, message):
    import json

    # as test_precision's
    rc, log, secs = launch(
        2,
        tmp_path,
        "--stages",
        2,
        "--engines",
        "hippie",
        "--refusal-barrier",
        "--schedule-override",
        json.dumps(override),
        timeout=120,
    )
    assert rc != 0
    refused = {r for r in range(2) for line in log.splitlines() if f"rank {r} refused: " in line and message in line}
    assert refused == {0, 1}, log[-3000:]  # each rank's own refusal (--refusal-barrier prints it before any exits)


def test_bf16(tmp_path):
    rc, log, _ = launch(
        4, tmp_path, "--stages", 2, "--steps", STEPS, "--engines", "stock,1f1b,hippie", "--bf16", "--clip", 0.5
    )
    assert rc == 0, log[-4000:]
    stock, stock_losses, parts, _, _ = collect(tmp_path, "stock")
    ours, losses, _, _, replicas = collect(tmp_path, "1f1b")
    _assert_equal(stock, ours, "bf16 1f1b vs stock DeepSpeed")
    assert losses == stock_losses
    hippie, _, parts, params, replicas = collect(tmp_path, "hippie")
    _replicas_identical(replicas)
    # bf16 weights: compare with the fp32 reference of the deferred rule at bf16 resolution
    ref, _ = reference.run(
        parts, 2, MICRO_BATCHES, STEPS, deferred=params["deferred_stages"], clip=0.5, staleness=DEFAULT_STALENESS
    )
    _assert_close(hippie, ref, "bf16 hippie vs fp32 reference", atol=2e-2)


def test_job_leaves_no_shared_memory(tmp_path):
    # DeepSpeed's CPU comm op creates a /dev/shm segment per rank and never removes it (about
    # 64 MB each: a few hundred jobs fill the machine); hippie_ds.initialize removes its own.
    from launch import free_port
    from hippie_ds.adapter.integration import deepspeed_shm_segments

    port = free_port()
    rc, log, _ = launch(2, tmp_path, "--stages", 2, "--steps", 1, "--engines", "hippie", port=port, clean_shm=False)
    assert rc == 0, log[-3000:]
    assert deepspeed_shm_segments(port) == []
    # control: stock DeepSpeed alone leaves one segment per rank (the launcher helper removes them)
    port = free_port()
    rc, log, _ = launch(
        2, tmp_path / "stock", "--stages", 2, "--steps", 1, "--engines", "stock", port=port, clean_shm=False
    )
    leaked = deepspeed_shm_segments(port)
    for path in leaked:
        os.unlink(path)
    assert rc == 0 and len(leaked) == 2, (leaked, log[-3000:])
