"""Checkpoints that must resume exactly, beyond the ones ``tests/real_clients/test_dropin.py`` crosses with stock
DeepSpeed: how hippie-ds reads a stock checkpoint's layout (pure), and modules tied across stages
under the schedules that never flush, resumed under an LR schedule (real ranks)."""

import json
from pathlib import Path

import pytest
import torch

from hippie_ds.adapter.checkpoint import state as ckpt


# ---------------------------------------------------------------------------------------------
# A stock checkpoint's layout (pure)


def test_checkpoint_stages_of_tensor_parallel_files():
    """DeepSpeed names one ``mp_rank_XX`` file per stage and tensor-parallel rank (stage x TP degree
    + TP rank): 2 stages x 2 TP ranks are 4 files of 2 stages."""
    files = [f"mp_rank_{i:02d}_model_states.pt" for i in range(4)]
    layers = [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(6) for t in range(2)]
    dims = {ckpt.PARALLEL_DIMS: {"pp_degree": 2, "tp_degree": 2}}
    assert ckpt.checkpoint_stages(dims, files, layers) == 2
    assert ckpt.checkpoint_stages({}, files, layers) == 2  # without the metadata: the layer files' TP ranks
    assert ckpt.checkpoint_stages({}, files, [f"layer_{i:02d}-model_states.pt" for i in range(6)]) == 4
    assert not ckpt.layout_changed(None, ckpt.layout([0, 3, 6]), ckpt.checkpoint_stages(dims, files, layers))


def test_optimizer_state_pairs_by_parameter_group():
    """Megatron-DeepSpeed's optimizer has two groups (weight decay on / off): torch numbers its
    state group by group, not in the module's order."""
    w0, b0, w1, b1 = torch.zeros(4, 2), torch.zeros(4), torch.zeros(3, 4), torch.zeros(3)
    groups = [[w0, w1], [b0, b1]]
    saved = [{"params": [0, 1]}, {"params": [2, 3]}]
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p)} for i, p in enumerate([w0, w1, b0, b1])}
    assert ckpt.optimizer_state_fits(state, saved, groups)
    assert not ckpt.optimizer_state_fits(state, saved, [[w0, b0], [w1, b1]])  # another stage's parameters
    assert not ckpt.optimizer_state_fits(state, saved, [[w0, w1, b0, b1]])


def test_training_state_of_format_2_still_loads():
    client = {ckpt.STATE_KEY: {"format": 2, "grad_buffer": None, "weight_versions": None, "prediction": None}}
    assert ckpt.read_training_state(client) == {
        "grad_buffer": None,
        "weight_versions": None,
        "prediction": None,
        "tied_copies": None,
    }
    copies = {"tied.weight": torch.ones(2)}
    state = ckpt.training_state({"state": "empty", "buffer": None}, None, None, copies)
    assert state["format"] == 3 and ckpt.read_training_state({ckpt.STATE_KEY: state})["tied_copies"] is copies


# ---------------------------------------------------------------------------------------------
# Tied modules under an LR schedule (real ranks)

LR_SCHEDULE = {
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear"},
    }
}
TIED_ENGINES = ("2bw", "pipedream", "hippie")
RESUMED = {"2bw": ("ckpt1", "ckpt2"), "pipedream": ("ckpt2",), "hippie": ("ckpt2",)}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16+zero1"])
def test_tied_module_resumes_exactly_under_lr_schedule(tmp_path, precision):
    """A module tied across the first and the last stage, trained under a warm-up LR schedule and
    resumed from a checkpoint saved right after a ``train_batch`` (no ``drain()`` by the script):
    the resumed run is bit-identical to the uninterrupted one, losses, layers and every rank's
    tied copy. Under ``2bw`` and ``pipedream`` the last stage applies a batch's tie sum a call
    before stage 0 (at another learning rate), so the two copies differ when the checkpoint is
    saved, and DeepSpeed's load overwrites the last stage's with stage 0's: the checkpoint
    carries each copy. ``hippie`` updates both copies in the same call."""
    from launch import collect, launch

    extra = ("--bf16", "--zero", 1) if precision == "bf16+zero1" else ()
    engines = [n for n in TIED_ENGINES] + [f"{n}+{c}" for n in TIED_ENGINES for c in RESUMED[n]]
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        2,
        "--micro-batches",
        4,
        "--steps",
        4,
        "--tied",
        "--engines",
        ",".join(engines),
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--clip",
        0.05,
        "--drain",
        "--schedule-override",
        json.dumps({"deepspeed": LR_SCHEDULE}),
        *extra,
        timeout=420,
    )
    assert rc == 0, log[-4000:]

    def tied_copies(name):
        files = [torch.load(f) for f in sorted((tmp_path / name).glob("rank*.pt"))]
        return [f["tied"]["tied"]["weight"] for f in files if "tied" in f["tied"]]

    for name in TIED_ENGINES:
        full, full_losses, *_ = collect(tmp_path, name)
        for suffix in RESUMED[name]:
            resumed, resumed_losses, *_ = collect(tmp_path, f"{name}+{suffix}")
            for i in full:
                for k in full[i]:
                    diff = (full[i][k] - resumed[i][k]).abs().max()
                    assert torch.equal(full[i][k], resumed[i][k]), f"{name}+{suffix} {precision}: layer {i} {k}: {diff}"
            assert resumed_losses == full_losses, f"{name}+{suffix} {precision}: losses differ"
            for a, b in zip(tied_copies(name), tied_copies(f"{name}+{suffix}"), strict=True):
                assert torch.equal(a, b), f"{name}+{suffix} {precision}: a tied copy differs"


# ---------------------------------------------------------------------------------------------
# A checkpoint saved before the adapter moved into packages

BEFORE_THE_MOVE = Path(__file__).resolve().parents[2] / "data" / "checkpoint_before_issue59"


def test_a_checkpoint_saved_before_the_move_pickles_the_old_path():
    """The files hold the reducer by the path of the day (``hippie_ds.adapter.checkpoint_state``, now
    an alias module), and unpickle, inside hippie-ds's load, to today's ``InFlightState``."""
    for name in ("hippie", "2bw"):
        own = BEFORE_THE_MOVE / name / "global_step3" / "mp_rank_00_model_states.pt"
        with ckpt.loading():
            saved = torch.load(own, map_location="cpu", weights_only=False)
        state = ckpt.read_training_state(saved)
        assert state["grad_buffer"] is not None or state["weight_versions"] is not None, name
        with pytest.raises(Exception, match="stock DeepSpeed would drop"):
            torch.load(own, map_location="cpu", weights_only=False)


def _same(a, b, where):
    """Every tensor equal (dtype and values), every other leaf equal, the same keys: what a save
    of a loaded state must give back."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# what a checkpoint holds of the training: the rest (ds_config, ds_version) names the code that wrote it
TRAINED = ("module", "optimizer", "skipped_steps", "global_steps", "global_samples", "next_step", "hippie_ds_layout")


def _checkpoint(folder):
    """{file: what it holds of the training}, the in-flight state read as hippie-ds reads it."""
    files = {}
    for path in sorted(Path(folder).glob("global_step*/*.pt")):
        with ckpt.loading():
            saved = torch.load(path, map_location="cpu", weights_only=False)
        if path.name.startswith("mp_rank_"):
            saved = {**{k: saved[k] for k in TRAINED if k in saved}, "in_flight": ckpt.read_training_state(saved)}
        files[path.name] = saved
    return files


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["hippie", "2bw"])
def test_a_checkpoint_saved_before_the_move_resumes_exactly(tmp_path, name):
    """Saved by the code before the adapter moved into packages (``tests/data/checkpoint_before_issue59``: 2 ranks, 2
    stages, 3 micro-batches, AdamW at 0.01, after 3 of 5 steps; hippie with stage 0 deferred: a buffered
    gradient in flight; 2bw: weight versions), on another machine: its first 3 steps rounded on that
    CPU, so no run here reproduces them bit for bit. What holds on any CPU: today's code loads every
    piece of it exactly (loaded, then saved in today's format, it is the same state, file by file),
    and the 2 steps resumed from the old files equal the 2 steps resumed from today's save of the same
    state, bit for bit, both run here."""
    import shutil

    from launch import collect, launch

    common = (
        "--stages",
        2,
        "--micro-batches",
        3,
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--engines",
        name,
        *(("--deferred", "0") if name == "hippie" else ()),
        "--steps",
        5,
    )
    saved = shutil.copytree(BEFORE_THE_MOVE / name, tmp_path / "saved")
    today = tmp_path / "today"
    rc, log, _ = launch(2, tmp_path / "from_old", *common, "--resume", saved, "--resave", today)
    assert rc == 0, log[-4000:]
    old_files, today_files = _checkpoint(saved), _checkpoint(today)
    assert set(old_files) == set(today_files)
    in_flight = [f["in_flight"] for f in old_files.values() if "in_flight" in f]
    assert any(s["grad_buffer"] is not None or s["weight_versions"] is not None for s in in_flight), name
    for file in old_files:
        _same(old_files[file], today_files[file], f"{name}/{file}")
    rc, log, _ = launch(2, tmp_path / "from_today", *common, "--resume", today)
    assert rc == 0, log[-4000:]
    from_old, old_losses, *_ = collect(tmp_path / "from_old", name)
    from_today, today_losses, *_ = collect(tmp_path / "from_today", name)
    assert len(old_losses["rank0"]) == 2 and old_losses == today_losses, name
    _same(from_old, from_today, f"{name}: the layers after the resume")
