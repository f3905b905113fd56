"""``from hippie_ds import PipelineModule`` as a drop-in base class: where a module built
without ``config=`` finds the DeepSpeed config (hippie_ds/adapter/module/config_discovery.py), and the
start-up refusals that follow from it: the module named first, where its config came
from, parameters printed readably, only schedules that run on this module suggested. Pure: stand-in
modules, no process group. The real ranks are in tests/real_clients/test_real_clients.py
(``test_drop_in_module_takes_the_config_from_sys_argv``)."""

import base64
import json
from types import SimpleNamespace

import pytest

from hippie_ds import schedules
from hippie_ds.adapter.module import config_discovery as cd
from hippie_ds.config import ConfigError
from hippie_ds.schedules import ScheduleError

CONFIG = {"train_micro_batch_size_per_gpu": 1, "pipeline": {"schedule": "interleaved-1f1b"}}


def _b64(cfg):
    return base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()


@pytest.fixture(autouse=True)
def _no_override():
    cd.set_config(None)
    yield
    cd.set_config(None)


def test_argv_forms(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    for argv in (
        ["--deepspeed_config", str(path)],
        [f"--deepspeed_config={path}"],
        ["--deepspeed-config", str(path)],
        ["--deepscale_config", str(path)],
        ["--deepspeed", "--lr", "1", "--deepspeed_config", str(path)],
    ):
        found = cd.discover(["train.py", "--num-layers", "4"] + argv)
        assert found.config == CONFIG and found.path == str(path), argv
        assert found.source == f"{argv[-1].partition('=')[0] if '=' in argv[-1] else argv[-2]} {path} (sys.argv)"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**CONFIG, "pipeline": {"schedule": "zb-v"}}))
    # the last one wins, as argparse takes it
    assert cd.discover(["--deepspeed_config", str(path), "--deepspeed_config", str(other)]).path == str(other)
    for argv in ([], ["--deepspeed"], ["--deepspeed_config"], ["--deepspeed_configs", str(path)]):
        assert cd.discover(argv) is None, argv


def test_argv_base64_decoded_as_deepspeed_does():
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = {**CONFIG, "train_batch_size": 1}
    found = cd.discover(["--deepspeed_config", _b64(cfg)])
    assert found.config == cfg and found.path is None and found.source == "--deepspeed_config <base64 JSON> (sys.argv)"
    assert DeepSpeedConfig(_b64(cfg)).train_batch_size == 1  # the same string DeepSpeed itself accepts
    with pytest.raises(ConfigError, match=r"DeepSpeed config 'no/such.json': no such file, and not the urlsafe-base64"):
        cd.discover(["--deepspeed_config", "no/such.json"])


def test_set_config_comes_first(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    cd.set_config({"pipeline": {"schedule": "zb-v"}})
    found = cd.discover(["--deepspeed_config", str(path)])
    assert found.source == "hippie_ds.set_config(<dict>)" and found.config["pipeline"]["schedule"] == "zb-v"
    import hippie_ds

    hippie_ds.set_config(path)
    assert cd.discover([]).path == str(path) and cd.discover([]).source == f"hippie_ds.set_config({str(path)!r})"
    hippie_ds.set_config(None)
    assert cd.discover([]) is None
    with pytest.raises(TypeError):
        hippie_ds.set_config(3)


def test_the_module_reads_what_it_found(tmp_path):
    """What the module takes from a found config: the chunks of its schedule, and its plan relative
    to the config file (virtual_stages_of / resolve_plan, which PipelineModule.__init__ calls)."""
    from hippie_ds.adapter.module.pipeline_module import virtual_stages_of

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    found = cd.discover(["--deepspeed_config", str(path)])
    assert virtual_stages_of(found.path or found.config, 2) == (2, "interleaved")
    found = cd.discover(["--deepspeed_config", _b64({"pipeline": {"schedule": "zb-v"}})])
    assert virtual_stages_of(found.path or found.config, 2) == (2, "v")
    assert virtual_stages_of(None, 2) == (1, "interleaved")  # nothing found: DeepSpeed's module


# ---------------------------------------------------------------------------------------------
# start-up refusals (startup.checks.prepare on stand-in modules)


def _model(stages=2, **attrs):
    """What prepare reads of a PipelineModule; without ``virtual_stages`` it is DeepSpeed's own."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    return SimpleNamespace(
        num_stages=stages,
        _topo=ProcessTopology(axes=["data", "pipe"], dims=[1, stages]),
        mpu=lambda: None,
        tied_comms={},
        parts=list(range(stages + 1)),
        **attrs,
    )


def _config(schedule, micro_batches, **extra):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batches,
        "pipeline": {"schedule": schedule},
        **extra,
    }


def _refusal(model, config):
    from hippie_ds.adapter.startup.checks import prepare

    with pytest.raises((ConfigError, ScheduleError)) as info:
        prepare(model, config)
    return str(info.value)


def test_the_module_is_named_first():
    """2 stages x 1 micro-batch of interleaved-1f1b on DeepSpeed's module: the module refusal comes
    first (a user who fixes the micro-batch count would meet it next), without 'with {}'."""
    text = _refusal(_model(), _config("interleaved-1f1b", 1))
    assert text.startswith(
        'config key "pipeline.schedule" = \'interleaved-1f1b\' runs 2 model chunks per stage '
        "(interleaved layout), but the PipelineModule holds 1 model chunk per stage; the model is "
        "DeepSpeed's PipelineModule (SimpleNamespace)"
    ), text
    assert "build it with hippie_ds.PipelineModule" in text and "--deepspeed_config in sys.argv" in text
    assert "{}" not in text and "built with 1 (interleaved)" not in text
    # the module right: then the micro-batch rule, readably
    text = _refusal(
        _model(virtual_stages=2, layout_kind="interleaved", hippie_config_source="config="),
        _config("interleaved-1f1b", 1),
    )
    assert text == (
        "schedule 'interleaved-1f1b' cannot run 2 stages x 1 micro-batch, 2 model chunks per stage: "
        "micro_batches must be a multiple of stages (Megatron's interleaved order takes them in groups "
        "of `stages`) (micro_batches % stages == 0)"
    ), text


def test_the_refusal_names_where_the_module_took_its_config():
    text = _refusal(_model(virtual_stages=1, layout_kind="interleaved", hippie_config_source=None), _config("zb-v", 2))
    assert (
        "runs 2 model chunks per stage (v layout), but the PipelineModule holds 1 model chunk per stage; the "
        "hippie_ds.PipelineModule was built without a DeepSpeed config (no config=, no hippie_ds.set_config(), "
        "no --deepspeed_config in sys.argv)" in text
    ), text
    source = "--deepspeed_config /job/ds.json (sys.argv)"
    text = _refusal(
        _model(virtual_stages=2, layout_kind="interleaved", hippie_config_source=source), _config("zb-v", 2)
    )
    assert (
        f"holds 2 model chunks per stage (interleaved layout); the hippie_ds.PipelineModule took its layout from "
        f"the DeepSpeed config {source}, which differs: give the module and hippie_ds.initialize the same" in text
    )
    text = _refusal(_model(virtual_stages=2, layout_kind="v", hippie_config_source=source), _config("1f1b", 2))
    assert text.startswith(
        "config key \"pipeline.schedule\" = '1f1b' runs 1 model chunk per stage, but the "
        "PipelineModule holds 2 model chunks per stage (v layout)"
    ), text
    text = _refusal(
        _model(virtual_stages=3, layout_kind="interleaved", hippie_config_source=None), _config("interleaved-1f1b", 2)
    )
    assert (
        "was built with virtual_stages=3, layout='interleaved'; build it with virtual_stages=2, "
        "layout='interleaved', or with config=<this config>" in text
    ), text


def test_precision_refusal_names_only_schedules_this_module_runs():
    """fp16 with a schedule whose overflow vote cannot be waited for in time (pipedream at 3
    stages), or on a ZeRO configuration the vote does not run on: the schedules suggested are
    those that run on this configuration and this module (DeepSpeed's: no virtual stages)."""
    text = _refusal(_model(3), _config("pipedream", 4, fp16={"enabled": True}))
    assert text.endswith(
        "a schedule that runs with fp16 and this module (one model chunk per stage): 1f1b, 2bw, "
        "gpipe, hippie, hippie-1f1b, hippie-zb, zb-h1"
    ), text
    chunked = _model(virtual_stages=2, layout_kind="interleaved", hippie_config_source="config=")
    overlap = {"stage": 1, "overlap_comm": True}
    text = _refusal(chunked, _config("hippie-interleaved", 2, fp16={"enabled": True}, zero_optimization=overlap))
    assert text.endswith("and this module (2 model chunks per stage, interleaved layout): interleaved-1f1b"), text


def test_builtins_where_on_a_module():
    def every(c):
        return True

    plain = schedules.builtins_where(every, 2, 4, (1, "interleaved"))
    assert "1f1b" in plain and not {"interleaved-1f1b", "zb-v", "hippie-interleaved"} & set(plain)
    assert set(schedules.builtins_where(every, 2, 4, (2, "v"))) == {"zb-v"}
    assert set(schedules.builtins_where(every, 2, 4, (3, "interleaved"))) == {"interleaved-1f1b", "hippie-interleaved"}
    assert "zb-v" in schedules.builtins_where(every, 2, 4)  # no module given: every built-in at its defaults


def test_a_plan_the_module_found_must_reach_initialize():
    source = "--deepspeed_config /job/ds.json (sys.argv)"
    model = _model(
        virtual_stages=1,
        layout_kind="interleaved",
        hippie_config_source=source,
        hippie_plan_source=source,
        hippie_plan=SimpleNamespace(model="gpt"),
    )
    assert _refusal(model, _config("1f1b", 2)) == (
        "config key \"hippie.plan\" is not set, but the hippie_ds.PipelineModule took the plan for 'gpt' from the "
        f"DeepSpeed config {source}: give the module and hippie_ds.initialize the same config"
    )
