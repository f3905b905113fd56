"""Existing DeepSpeed pipeline scripts, unchanged but for ``initialize``: the client-shaped script
``tests/distributed/client_train.py`` (argparse + ``deepspeed.add_config_arguments``,
``--deepspeed_config``, DeepSpeed's default topology with data parallelism, ``partition_method=
"parameters"``, ``activation_checkpoint_interval``, ``training_data=`` a Dataset, ``train_batch()``
without an iterator, ``eval_batch``, an optimizer of two parameter groups as Megatron-DeepSpeed
builds it) on 2 stages x 2 replicas, with no ``hippie`` key in the config: under the ``deepspeed``
launcher itself for stock DeepSpeed's runs and the default schedule's (1f1b, no key at all), the
others forked as that launcher starts ranks (tests/distributed/launch.py; it saves ~7 s a launch). Checkpoints cross
between stock DeepSpeed and hippie-ds both ways, across stage layouts, and from a tensor x pipeline model; DeepSpeed's
own ``DualPipeVModule`` runs as stock. Launches are shared where one run can serve two checks.
"""

import json
from pathlib import Path

import pytest
import torch

from launch import launch

pytestmark = pytest.mark.distributed

CLIENT = Path(__file__).resolve().parents[1] / "distributed" / "client_train.py"
SCHEDULES = ["1f1b", "gpipe", "zb-h1", "hippie", "hippie-1f1b", "2bw", "pipedream"]
SYNCHRONOUS = ("1f1b", "gpipe", "zb-h1")  # bit-identical to stock DeepSpeed
IN_FLIGHT = ("hippie", "2bw")  # a deferred gradient, stashed weight versions: stock must refuse them
STEPS = 3


def _config(tmp, schedule=None):
    cfg = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
    }
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule}
    path = Path(tmp, f"config-{schedule or 'stock'}.json")
    path.write_text(json.dumps(cfg))
    return path


def run(out, config, *args, ranks=4, initialize="hippie_ds", expect_ok=True, launcher=None):
    rc, log, _ = launch(
        ranks,
        out,
        "--initialize",
        initialize,
        "--deepspeed",
        "--deepspeed_config",
        config,
        *args,
        worker=CLIENT,
        timeout=180,
        launcher=launcher,
    )
    if expect_ok:
        assert rc == 0, log[-4000:]
    return rc, log, _results(out)


def _results(out):
    records = {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(out).glob("rank*.json")}
    weights = {}
    for f in Path(out).glob("rank*.pt"):
        weights.update(torch.load(f))
    return {"records": records, "weights": weights}


def _same_weights(a, b):
    assert a.keys() == b.keys()
    for i in a:
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), f"layer {i} {k} differs by {(a[i][k] - b[i][k]).abs().max()}"


def _losses(result):
    return result["records"][0]["losses"]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """Stock DeepSpeed: trains STEPS steps and saves; resumes from that checkpoint for 2 steps."""
    tmp = tmp_path_factory.mktemp("stock")
    config = _config(tmp)
    _, _, trained = run(
        tmp / "trained", config, "--steps", STEPS, "--save", tmp / "ckpt", initialize="deepspeed", launcher="deepspeed"
    )
    _, _, resumed = run(
        tmp / "resumed", config, "--steps", 2, "--load", tmp / "ckpt", initialize="deepspeed", launcher="deepspeed"
    )
    return {"dir": tmp, "trained": trained, "resumed": resumed}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unchanged_script_trains_and_resumes_stock_checkpoint(tmp_path, stock, schedule):
    """Synchronous schedules train from scratch exactly as stock does; every schedule resumes a
    checkpoint saved by stock DeepSpeed and trains on (one launch each for the asynchronous
    ones, to keep CI short: that run both loads and trains under the schedule)."""
    config = _config(tmp_path, None if schedule == "1f1b" else schedule)  # 1f1b: no key at all
    launcher = "deepspeed" if schedule == "1f1b" else None  # the user's command line, once
    if schedule in SYNCHRONOUS:
        _, log, ours = run(tmp_path / "trained", config, "--steps", STEPS, launcher=launcher)
        records = ours["records"]
        assert len(records) == 4 and all(r["global_steps"] == STEPS for r in records.values())
        # eval_batch on the same (initial) weights: stock's loss
        assert records[0]["eval_before"] == stock["trained"]["records"][0]["eval_before"]
        assert _losses(ours) == _losses(stock["trained"])
        assert records[0]["eval_after"] == stock["trained"]["records"][0]["eval_after"]
        _same_weights(ours["weights"], stock["trained"]["weights"])
    # a checkpoint saved by stock DeepSpeed: loads, and training continues (and, for schedules
    # with in-flight state, saves it: stock DeepSpeed must refuse that checkpoint, below)
    save = ("--save", tmp_path / "ckpt") if schedule in IN_FLIGHT else ()
    _, log, resumed = run(
        tmp_path / "resumed", config, "--steps", 2, "--load", stock["dir"] / "ckpt", *save, launcher=launcher
    )
    records = resumed["records"]
    assert len(records) == 4 and all(r["global_steps"] == STEPS + 2 for r in records.values())
    # eval_batch on the loaded weights: stock's loss on the same weights
    assert records[0]["eval_before"] == stock["resumed"]["records"][0]["eval_before"]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in records.values())
    if schedule in SYNCHRONOUS:  # exactly what stock DeepSpeed does when it resumes the same checkpoint
        assert _losses(resumed) == _losses(stock["resumed"])
        _same_weights(resumed["weights"], stock["resumed"]["weights"])
    else:
        assert _losses(resumed) != _losses(stock["resumed"])  # its own update rule really ran
    if schedule in IN_FLIGHT:
        rc, log, _ = run(
            tmp_path / "stock",
            _config(tmp_path),
            "--steps",
            1,
            "--load",
            tmp_path / "ckpt",
            initialize="deepspeed",
            expect_ok=False,
        )
        assert rc != 0
        assert "hippie-ds in-flight training state" in log and "engine.drain()" in log, log[-3000:]


@pytest.fixture(scope="module")
def drained(tmp_path_factory):
    """hippie (a deferred stage) on 2 stages x 2 replicas, drained before saving: nothing in flight."""
    tmp = tmp_path_factory.mktemp("drained")
    _, _, ours = run(
        tmp / "hippie", _config(tmp, "hippie"), "--steps", STEPS, "--drain-before-save", "--save", tmp / "ckpt"
    )
    return {"ckpt": tmp / "ckpt", "result": ours}


def test_drained_checkpoint_loads_into_stock(tmp_path, drained):
    _, _, theirs = run(
        tmp_path / "stock", _config(tmp_path), "--steps", 1, "--load", drained["ckpt"], initialize="deepspeed"
    )
    assert theirs["records"][0]["eval_before"] == drained["result"]["records"][0]["eval_after"]
    assert theirs["records"][0]["global_steps"] == STEPS + 1


def test_replanned_resume(tmp_path, drained):
    """Saved on 2 stages x 2 replicas (DeepSpeed's 'parameters' partition), resumed on 4 stages:
    weights follow by layer; optimizer state is an explicit opt-in restart."""
    config = _config(tmp_path, "hippie")
    before = drained["result"]
    rc, log, _ = run(tmp_path / "refused", config, "-p", 4, "--load", drained["ckpt"], expect_ok=False)
    assert rc != 0 and "load_optimizer_states=False" in log and "stage boundaries" in log, log[-3000:]
    _, _, after = run(
        tmp_path / "four", config, "-p", 4, "--steps", 2, "--load", drained["ckpt"], "--restart-optimizer"
    )
    assert after["records"][0]["eval_before"] == pytest.approx(before["records"][0]["eval_after"], rel=1e-6)
    assert {r["stage"] for r in after["records"].values()} == {0, 1, 2, 3}
    assert all(r["global_steps"] == STEPS + 2 for r in after["records"].values())
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in after["records"].values())


def test_tensor_x_pipeline_stock_checkpoint(tmp_path):
    """Stock DeepSpeed's checkpoint of a tensor x pipeline model built as Megatron-DeepSpeed builds
    it (2 stages x 2 ranks of a ``model`` axis, an optimizer of two parameter groups), in fp32 and
    in bf16 + ZeRO-1, has 4 ``mp_rank_XX`` files for 2 stages: DeepSpeed numbers them stage x TP
    degree + TP rank. hippie-ds ``1f1b`` loads it and goes on bit-identically to stock DeepSpeed
    resuming the same checkpoint (tests/distributed/stock_checkpoint_worker.py: the layers are
    whole on each model-axis rank, not sliced, since the file layout is what counts; every engine
    of both precisions runs in one launch)."""
    worker = Path(__file__).resolve().parents[1] / "distributed" / "stock_checkpoint_worker.py"
    rc, log, _ = launch(4, tmp_path, "--precisions", "fp32,bf16+zero1", worker=worker, timeout=240)
    assert rc == 0, log[-4000:]
    for precision in ("fp32", "bf16+zero1"):
        ckpt = tmp_path / precision / "ckpt"
        assert len(list((ckpt / (ckpt / "latest").read_text().strip()).glob("mp_rank_*_model_states.pt"))) == 4
        runs = {
            name: [torch.load(f) for f in sorted((tmp_path / precision / name).glob("rank*.pt"))]
            for name in ("stock", "hippie_ds")
        }
        assert len(runs["hippie_ds"]) == 4 and {r["engine"] for r in runs["hippie_ds"]} == {"HippiePipelineEngine"}
        for ours, theirs in zip(runs["hippie_ds"], runs["stock"], strict=True):
            assert ours["global_steps"] == theirs["global_steps"] == 4
            assert ours["losses"] == theirs["losses"], precision
            _same_weights(ours["layers"], theirs["layers"])


def test_dualpipev_module_runs_as_stock(tmp_path):
    """DeepSpeed 0.19.8's own ``DualPipeVModule`` (two stages per pipeline rank) through
    ``hippie_ds.initialize``: DeepSpeed's ``DualPipeVEngine``, as ``deepspeed.initialize`` picks it,
    and bit-identical training; naming a hippie-ds schedule for it is refused at start-up on
    every rank, with the key, the value and what works."""
    rc, log, _ = launch(
        2,
        tmp_path,
        "--steps",
        3,
        worker=Path(__file__).resolve().parents[1] / "distributed" / "dualpipev_worker.py",
        timeout=180,
    )
    assert rc == 0, log[-4000:]
    results = [torch.load(f) for f in sorted(tmp_path.glob("rank*.pt"))]
    assert len(results) == 2
    for r in results:
        assert r["stock"]["engine"] == r["hippie_ds"]["engine"] == "DualPipeVEngine"
        assert r["hippie_ds"]["losses"] == r["stock"]["losses"]
        _same_weights(r["hippie_ds"]["layers"], r["stock"]["layers"])
        refused = r["refused"]
        assert refused is not None and 'config key "pipeline.schedule" = \'hippie\'' in refused, refused
        assert "DualPipeVModule" in refused and "DualPipeVEngine" in refused and "PipelineModule" in refused
        assert (r["refused_options"] or "").startswith(
            'config key "hippie" = {\'timeline_dir\': \'t\'}: the model is a DualPipeVModule'
        ), r["refused_options"]
    assert all(torch.isfinite(torch.tensor(r["stock"]["losses"])).all() for r in results)
