"""The examples with real ranks (gloo on CPU, started as the `deepspeed` launcher starts them): the VGG-style network
learns the digits with the hippie schedule on 2 stages x 2 replicas, and the data-parallel baseline
(stock DeepSpeedEngine) sees the same initial weights, data order and global batch as a pipeline
(it reproduces 1f1b's losses). Plus the pure parts: the data sharding, the digits split and
python -m tools.bench convergence's config and table. Nothing is downloaded (the digits ship with scikit-learn).
"""

import json
from pathlib import Path

import pytest
import torch
from launch import launch

from tools.examples import harness

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed

pytest.importorskip("sklearn", reason="the VGG example needs scikit-learn (pip install -e '.[test]')")


def run_example(script, ranks, out, *args, timeout=300):
    """Run tools/SCRIPT on RANKS local ranks; returns (returncode, output, metrics or None)."""
    rc, output, _ = launch(ranks, out, *args, timeout=timeout, worker=REPO / "tools" / "examples" / script)
    metrics = Path(out, "metrics.json")
    return rc, output, json.loads(metrics.read_text()) if metrics.exists() else None


def test_vgg_hippie_learns(tmp_path):
    """2 stages x 2 replicas, hippie with a deferred stage 0: the loss falls and the test accuracy
    is far above chance (10%) after 60 steps; metrics file and timeline picture are written."""
    rc, log, m = run_example(
        "train_vgg.py",
        4,
        tmp_path,
        "--deepspeed_config",
        REPO / "configs" / "hippie.json",
        "--stages",
        2,
        "--steps",
        60,
        "--eval-every",
        30,
        "--lr",
        2e-3,
    )
    assert rc == 0, log[-4000:]
    assert (m["schedule"], m["stages"], m["replicas"], m["global_batch"]) == ("hippie", 2, 2, 32)
    assert m["schedule_params"]["deferred_stages"] == [0]
    # deferred_layers 1: stage 0 delays its first layer's share of its gradient, stage 1 nothing
    assert 0 < m["delayed_fraction"]["0"] < 0.5 and m["delayed_fraction"]["1"] == 0.0, m["delayed_fraction"]
    losses = m["train_loss"]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10, losses
    assert [e["step"] for e in m["eval"]] == [30, 60]
    assert m["final"]["accuracy"] > 0.6, m["eval"]
    assert m["final"]["loss"] < m["eval"][0]["loss"] < 2.3
    assert m["samples_per_s"] > 0 and len(m["step_seconds"]) == 60
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "trace.json").exists()
    assert "test loss" in log and "accuracy" in log


def test_data_parallel_matches_pipeline(tmp_path):
    """--data-parallel-only (stock DeepSpeedEngine, 2 replicas x 4 micro-batches) and 1f1b (2 stages
    x 1 replica x 8 micro-batches) compute the same update from the same 32 samples each step: same
    losses and test metrics up to float summation order. (Without clipping: DeepSpeed 0.19's fp32
    pipeline step clips by stage 0's gradient norm only, data parallelism by the whole model's.)"""
    config = json.loads((REPO / "configs" / "1f1b.json").read_text())
    config["gradient_clipping"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    common = ("--deepspeed_config", tmp_path / "config.json", "--steps", 12, "--eval-every", 6, "--lr", 2e-3)
    rc, log, dp = run_example("train_vgg.py", 2, tmp_path / "dp", *common, "--data-parallel-only")
    assert rc == 0, log[-4000:]
    assert (dp["mode"], dp["schedule"], dp["replicas"], dp["micro_batches"]) == ("data-parallel", "data-parallel", 2, 4)
    assert not (tmp_path / "dp" / "timeline.png").exists()
    rc, log, pipe = run_example("train_vgg.py", 2, tmp_path / "pipe", *common, "--stages", 2)
    assert rc == 0, log[-4000:]
    assert (pipe["mode"], pipe["stages"], pipe["replicas"], pipe["micro_batches"]) == ("pipeline", 2, 1, 8)
    assert pipe["delayed_fraction"] == {"0": 0.0, "1": 0.0} and "delayed_fraction" not in dp
    assert dp["train_loss"] == pytest.approx(pipe["train_loss"], abs=1e-4)
    assert dp["train_loss"][-1] < dp["train_loss"][0]
    for a, b in zip(dp["eval"], pipe["eval"], strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1.5 / 448)  # at most one image apart


# ------------------------------------------------------------------------------------ pure parts
def test_replica_micro_batches_partition_the_global_batch():
    batch = (torch.arange(32), torch.arange(32) * 10)
    pieces = {}
    for replicas, micro_batches in ((1, 8), (2, 4), (4, 2)):
        rows = []
        for r in range(replicas):
            for x, y in harness.replica_micro_batches([batch], 4, micro_batches, r, replicas):
                assert x.shape == (4,) and torch.equal(y, x * 10)
                rows.append(x)
        pieces[replicas] = torch.cat(rows)
        assert torch.equal(pieces[replicas], batch[0])
    with pytest.raises(ValueError):
        list(harness.replica_micro_batches([batch], 4, 4, 0, 4))


def test_digits_split_and_order():
    from tools.examples import vgg

    d = vgg.Digits()
    assert len(d.train[1]) + len(d.test[1]) == 1797 and len(d.test[1]) == vgg.TEST_SIZE
    assert d.train[0].shape[1:] == (1, 8, 8) and 0 <= float(d.train[0].min()) and float(d.train[0].max()) <= 1
    assert torch.bincount(d.test[1], minlength=10).min() >= 40  # stratified
    a, b = vgg.Digits(), vgg.Digits()
    assert torch.equal(a.test[0], b.test[0])
    first = [y for _, y in zip(range(3), a.global_batches(32, seed=5))]
    again = [y for _, y in zip(range(3), b.global_batches(32, seed=5))]
    assert all(torch.equal(x[1], y[1]) for x, y in zip(first, again))
    other = next(a.global_batches(32, seed=6))
    assert not torch.equal(first[0][1], other[1])
    assert d.num_test_batches(32) == 14
    model = torch.nn.Sequential(*[spec.build() for spec in vgg.layer_specs()])
    assert model(d.test[0][:5]).shape == (5, 10)


def test_convergence_config_and_table(tmp_path):
    from tools.bench import convergence

    configs = REPO / "configs"
    cfg = convergence.make_config("hippie", configs, 1e-3, "decay", 400)
    assert cfg["pipeline"]["schedule"] == "hippie" and cfg["hippie"]["deferred_stages"] == "auto"
    assert cfg["optimizer"]["params"]["lr"] == 1e-3 and cfg["scheduler"]["params"]["total_num_steps"] == 400
    assert (
        convergence.make_config("2bw-not-shipped", configs, 1e-3, "constant", 10)["pipeline"]["schedule"]
        == "2bw-not-shipped"
    )
    assert "scheduler" not in convergence.make_config("dp", configs, 1e-3, "constant", 10)
    assert cfg["gradient_clipping"] == 1.0  # the config's
    assert convergence.make_config("1f1b", configs, 1e-3, "decay", 10, "0")["gradient_clipping"] == 0.0
    muon = convergence.make_config("2bw", configs, 1e-3, "decay", 10, "0", muon_lr=0.02)
    assert muon["optimizer"]["type"] == "Muon" and muon["optimizer"]["params"]["muon_lr"] == 0.02
    assert muon["optimizer"]["params"]["adam_lr"] == 1e-3
    assert muon["scheduler"]["params"]["warmup_max_lr"] == [0.02, 1e-3]  # DeepSpeed's Muon half, then AdamW half
    run = {
        "final": {"loss": 1.0, "accuracy": 0.9},
        "steps": 10,
        "mode": "data-parallel",
        "replicas": 4,
        "stages": 1,
        "global_batch": 32,
        "seed": 0,
        "train_loss": [2.0, 1.0],
        "eval": [{"step": 10, "loss": 1.0, "accuracy": 0.9}],
    }
    other = {**run, "final": {"loss": 1.02, "accuracy": 0.897}, "mode": "pipeline", "replicas": 2, "stages": 2}
    results = convergence.summarize({"vgg": {"dp": [run], "hippie": [other]}})
    row = results["vgg"]["runs"]["hippie"]
    assert row["loss_diff_pct"] == pytest.approx(2.0) and not row["loss_within_target"]
    assert row["accuracy_diff_points"] == pytest.approx(-0.3) and row["accuracy_within_target"]
    table = convergence.markdown(results, "off")
    assert "Gradient clipping: off." in table
    assert "| vgg | `hippie` | 2 stages x 2 replicas | 10 | 1.0200 | +2.00% (!) | 89.70% | -0.30 pt |" in table
    assert convergence.plot("vgg", results["vgg"], tmp_path / "vgg.png").stat().st_size > 0
    two = convergence.summarize({"vgg": {"dp": [run, {**run, "seed": 1, "final": {"loss": 1.2, "accuracy": 0.8}}]}})
    row = two["vgg"]["runs"]["dp"]
    assert (row["loss"], row["accuracy"], row["seeds"]) == (pytest.approx(1.1), pytest.approx(0.85), [0, 1])
    assert "1.1000 (1.0000-1.2000)" in convergence.markdown(two)


def test_gpt_example_gives_muon_its_hidden_matrices_only():
    # DeepSpeed's "Muon" tags parameters by name (deepspeed.set_optimizer_flags): the GPT example's
    # embeddings and output head keep AdamW, as Muon's recipes have it.
    from types import SimpleNamespace

    import deepspeed

    from tools.examples import gpt

    model = torch.nn.Sequential(*[spec.build() for spec in gpt.layer_specs(vocab=50)])  # names as PipelineModule's
    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params={}), model)
    adamw = {n for n, p in model.named_parameters() if not p.use_muon}
    assert {"0.embed.weight", "0.pos_embed", "5.lm_head.weight"} <= adamw
    assert all(
        p.ndim == 1
        for n, p in model.named_parameters()
        if n in adamw - {"0.embed.weight", "0.pos_embed", "5.lm_head.weight"}
    )
    assert {n for n, p in model.named_parameters() if p.use_muon} >= {"1.mlp.0.weight", "4.attn.out_proj.weight"}
