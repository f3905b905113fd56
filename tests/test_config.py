"""Config validation: every bad value names the key, the value and what is allowed. Pure."""
import json
from pathlib import Path

import pytest

from hippie_ds.config import ConfigError, HippieConfig, schedule_params, split_config
from hippie_ds.schedules import load_spec

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_configs_are_valid(path):
    ds_config, schedule, options = split_config(json.loads(path.read_text()))
    assert schedule == path.stem and "hippie" not in ds_config and "schedule" not in ds_config["pipeline"]
    spec = load_spec(schedule)
    schedule_params(options, spec.params)


def test_one_config_per_builtin_schedule():
    from hippie_ds.schedules import available
    assert {p.stem for p in CONFIGS.glob("*.json")} >= {"1f1b", "gpipe", "hippie", "hippie-1f1b"}
    assert set(available()) >= {"1f1b", "gpipe", "hippie", "hippie-1f1b"}


def test_defaults():
    ds_config, schedule, options = split_config({"train_batch_size": 8})
    assert schedule == "1f1b" and options == HippieConfig() and ds_config == {"train_batch_size": 8, "pipeline": {}}


@pytest.mark.parametrize("config,message", [
    ({"hippie": {"deferred_stage": [0]}}, 'config key "hippie.deferred_stage" (value [0]) is not known; allowed keys:'),
    ({"hippie": {"staleness": {"methd": "none"}}},
     'config key "hippie.staleness.methd" (value \'none\') is not known; allowed keys: method, coefficient'),
    ({"hippie": {"staleness": {"method": "predict"}}}, 'config key "hippie.staleness.method" = \'predict\''),
    ({"hippie": {"timeline_steps": 0}}, 'config key "hippie.timeline_steps" = 0'),
    ({"hippie": {"deferred_stages": "some"}}, 'config key "hippie.deferred_stages" = \'some\''),
    ({"hippie": {"deferred_stages": [-1]}}, "non-negative stage indices"),
    ({"hippie": {"placement": "across"}}, 'config key "hippie.placement" = \'across\''),
    ({"hippie": {"deferred_layers": -1}}, 'config key "hippie.deferred_layers" = -1'),
    ({"hippie": {"deferred_layers": {"0": "all"}}}, "a mapping of deferred stage to layer count"),
    ({"hippie": 3}, 'config key "hippie" = 3: must be a mapping'),
    ({"pipeline": {"schedule": 7}}, 'config key "pipeline.schedule" = 7'),
])
def test_bad_values_are_named(config, message):
    with pytest.raises(ConfigError) as info:
        split_config(config)
    assert message in str(info.value)


def test_deferred_stages_only_for_schedules_that_declare_it():
    _, _, options = split_config({"hippie": {"deferred_stages": [0]}})
    with pytest.raises(ConfigError, match="has no deferred stages"):
        schedule_params(options, load_spec("1f1b").params)
    assert schedule_params(options, load_spec("hippie").params) == {"deferred_stages": [0]}


def test_unknown_schedule_params():
    _, _, options = split_config({"hippie": {"schedule_params": {"depth": 2}}})
    with pytest.raises(ConfigError, match=r"\['depth'\], which the schedule does not declare"):
        schedule_params(options, load_spec("hippie").params)


def test_deferred_layers_checked_against_the_schedule():
    """Partial deferral (hippie.deferred_layers) names its key before any process group exists:
    a schedule without deferred stages, a stage that is not deferred, a flat-gradient optimizer."""
    from types import SimpleNamespace

    from hippie_ds.adapter.integration import deferred_layers
    from hippie_ds.schedules import compile as compile_schedule

    model = SimpleNamespace(parts=[0, 3, 6, 8, 10])  # 4 stages: 3, 3, 2 and 2 layers
    fp32 = SimpleNamespace(bfloat16_config=SimpleNamespace(enabled=False), float16_config=SimpleNamespace(enabled=False),
                           zero_optimization_stage=0)
    bf16 = SimpleNamespace(**{**vars(fp32), "bfloat16_config": SimpleNamespace(enabled=True)})
    hippie = compile_schedule("hippie", 4, 4, deferred_stages=[0, 1])

    def run(value, compiled=hippie, config=fp32):
        return deferred_layers(model, split_config({"hippie": {"deferred_layers": value}})[2], compiled, config)

    assert run(1) == {0: 1, 1: 1}
    assert run({"1": 2}) == {1: 2}
    assert run(3) == {}  # as many layers as the stages hold: all of them delayed, nothing partial
    assert deferred_layers(model, split_config({})[2], hippie, fp32) == {}
    with pytest.raises(ConfigError, match=r'"hippie.deferred_layers" = 1: schedule \'1f1b\' has no deferred stages'):
        run(1, compile_schedule("1f1b", 4, 4))
    assert run(1, compile_schedule("hippie", 4, 4, deferred_stages=[])) == {}  # 'auto' may defer none
    with pytest.raises(ConfigError, match=r"stage\(s\) \[2\] are not deferred; deferred stages: \[0, 1\]"):
        run({"2": 1})
    with pytest.raises(ConfigError, match="fp32 without ZeRO only"):
        run(1, config=bf16)


def test_split_backward_refuses_what_it_cannot_run_exactly():
    """zb-h1 sets parameter gradients itself: bf16 / fp16 / ZeRO are refused by name before any
    process group exists; DeepSpeed's activation checkpointing is not (B then runs the whole
    backward, tests/test_dropin.py)."""
    from types import SimpleNamespace

    from hippie_ds.adapter.integration import _check_split_backward
    from hippie_ds.schedules import compile as compile_schedule

    off = SimpleNamespace(enabled=False)
    fp32 = SimpleNamespace(bfloat16_config=off, float16_config=off, zero_optimization_stage=0)
    zb = compile_schedule("zb-h1", 2, 4)
    _check_split_backward(SimpleNamespace(activation_checkpoint_interval=0), zb, fp32)
    for config, shown in ((SimpleNamespace(**{**vars(fp32), "bfloat16_config": SimpleNamespace(enabled=True)}), "bf16"),
                          (SimpleNamespace(**{**vars(fp32), "float16_config": SimpleNamespace(enabled=True)}), "fp16"),
                          (SimpleNamespace(**{**vars(fp32), "zero_optimization_stage": 1}), "zero_optimization.stage = 1")):
        with pytest.raises(ConfigError, match=f"'zb-h1' splits the backward.*fp32 without ZeRO only; got {shown}"):
            _check_split_backward(SimpleNamespace(activation_checkpoint_interval=0), zb, config)
    _check_split_backward(SimpleNamespace(activation_checkpoint_interval=2), zb, fp32)  # B runs it all
