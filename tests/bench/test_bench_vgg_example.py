"""The cluster bench's ``--model vgg-example`` (tools/bench/model.py) is the VGG convergence example
as python -m tools.bench convergence trains it: the same layers (the planner's fingerprint: layer
names and parameter sizes), loss, micro-batch shape and dtype, and `make bench-vgg`'s batch is the
convergence runs'. Pure: no processes."""

import json
import re
import types
from pathlib import Path

import torch

from hippie_ds.adapter.module.pipeline_module import model_fingerprint
from tools.bench import config as bench_config
from tools.bench import convergence
from tools.bench import model as bench_model
from tools.examples import harness, train_vgg, vgg

ROOT = Path(__file__).resolve().parents[2]


def bench_args(**kw):
    return types.SimpleNamespace(
        **{"model": bench_model.VGG_EXAMPLE, "micro_batch_size": 4, "micro_batches": 4, "stages": 2, **kw}
    )


def test_the_bench_builds_the_convergence_examples_layers_and_loss():
    assert not {"--width", "--hidden"} & set(convergence.EXAMPLES["vgg"]["extra"])  # the runs take the defaults
    example = train_vgg.parse_args([])
    trained = vgg.layer_specs(example.width, example.hidden)  # what train_vgg.py's Trainer builds
    benched = bench_model.layer_specs(bench_args())
    assert model_fingerprint(benched) == model_fingerprint(trained) is not None
    assert model_fingerprint(benched) == model_fingerprint(vgg.profile_target()["layers"])  # example-costs' profile
    assert [s.typename for s in benched] == [s.typename for s in trained]
    assert bench_model.loss_of(bench_args()) is vgg.loss_fn


def test_the_bench_feeds_the_examples_micro_batches():
    """A bench micro-batch has the shape and dtype of a convergence run's (a global batch of 32 cut
    for replica 0 of 2: harness.replica_micro_batches)."""
    a = bench_args()
    ours = next(bench_model.data_iter(a, 1))
    theirs = next(harness.replica_micro_batches(vgg.Digits().global_batches(32, 0), 4, 4, 0, 2))
    assert [(t.shape, t.dtype) for t in ours] == [(t.shape, t.dtype) for t in theirs]
    assert ours[0].shape == (4, 1, 8, 8) and ours[1].dtype == torch.int64
    model = bench_model.DPModel(a)
    assert torch.isfinite(model(*ours))
    assert sum(q.numel() for q in model.parameters()) == bench_config.parameter_count(a)


def test_stage_output_bytes_are_the_layers_output_at_the_cut():
    a = bench_args()
    assert bench_model.stage_output_bytes(a, 0) == 4 * 64 * 4 * 4 * 4  # uniform [0, 4, 8]: conv 64 at 4x4
    assert bench_model.stage_output_bytes(a, 0, [0, 3, 8]) == 4 * 32 * 4 * 4 * 4  # after the first pool
    assert bench_model.stage_output_bytes(a, 1) == 4 * 10 * 4  # the logits
    gpt = types.SimpleNamespace(model="gpt", micro_batch_size=2, seq=8, d_model=16)
    assert bench_model.stage_output_bytes(gpt, 0) == 4 * 2 * 8 * 16


def test_make_bench_vgg_runs_the_convergence_batch():
    """BENCH_VGG_SHAPE: micro-batches of the configs' size, as many per replica as make up their
    global batch on 2 stages x 2 replicas (python -m tools.bench convergence's 4 ranks)."""
    text = ROOT.joinpath("Makefile").read_text().replace("\\\n", " ")
    defined = dict(re.findall(r"^(\w+) := (.*)$", text, re.M))
    shape = re.sub(r"\$\((\w+)\)", lambda m: defined[m.group(1)], defined["BENCH_VGG_SHAPE"])
    option = dict(re.findall(r"--([a-z-]+) (\S+)", shape))
    cfg = json.loads((ROOT / "configs" / "1f1b.json").read_text())
    runs = convergence.parse_args([])
    replicas = runs.ranks // runs.stages
    assert option["model"] == bench_model.VGG_EXAMPLE
    assert int(option["micro-batch-size"]) == cfg["train_micro_batch_size_per_gpu"]
    assert int(option["micro-batch-size"]) * int(option["micro-batches"]) * replicas == cfg["train_batch_size"]
    parsed = bench_config.parse_args(shape.split())
    assert parsed.stages == runs.stages and parsed.model == bench_model.VGG_EXAMPLE
