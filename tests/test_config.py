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
