"""Config validation: every bad value names the key, the value and what is allowed. Pure."""

import json
from pathlib import Path

import pytest

from hippie_ds.config import ConfigError, HippieConfig, schedule_params, split_config
from hippie_ds.schedules import load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"hippie": {"deferred_stage": [0]}},
            'config key "hippie.deferred_stage" (value [0]) is not known; allowed keys:',
        ),
        (
            {"hippie": {"staleness": {"methd": "none"}}},
            'config key "hippie.staleness.methd" (value \'none\') is not known; allowed keys: method, coefficient',
        ),
        ({"hippie": {"staleness": {"method": "predict"}}}, 'config key "hippie.staleness.method" = \'predict\''),
        ({"hippie": {"timeline_steps": 0}}, 'config key "hippie.timeline_steps" = 0'),
        ({"hippie": {"deferred_stages": "some"}}, 'config key "hippie.deferred_stages" = \'some\''),
        ({"hippie": {"deferred_stages": [-1]}}, "non-negative stage indices"),
        ({"hippie": {"placement": "across"}}, 'config key "hippie.placement" = \'across\''),
        ({"hippie": {"deferred_layers": -1}}, 'config key "hippie.deferred_layers" = -1'),
        ({"hippie": {"deferred_layers": {"0": "all"}}}, "a mapping of deferred stage to layer count"),
        ({"hippie": 3}, 'config key "hippie" = 3: must be a mapping'),
        ({"pipeline": {"schedule": 7}}, 'config key "pipeline.schedule" = 7'),
    ],
)
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
    """Partial deferral (hippie.deferred_layers) names its key at start-up: a schedule without
    deferred stages, a stage that is not deferred. The default ("untied": on this stand-in,
    without built layers or ties, the first layer) applies to schedules with deferred stages and
    is ignored by the others; "all" delays whole stages; 0 leaves a stage in-step."""
    from types import SimpleNamespace

    from hippie_ds.adapter.module.deferred_layers import resolve_for_module
    from hippie_ds.schedules import compile as compile_schedule, load_spec
    from hippie_ds.schedules.resolve import Shape

    model = SimpleNamespace(parts=[0, 3, 6, 8, 10])  # 4 stages: 3, 3, 2 and 2 layers
    hippie = compile_schedule("hippie", 4, 4, deferred_stages=[0, 1])

    def decided(options, compiled):
        deferral = resolve_for_module(
            model,
            options,
            load_spec(compiled.name),
            Shape(compiled.stages, compiled.micro_batches),
            dict(compiled.params),
        ).deferral
        return {s: "whole" if d.whole else d.layers for s, d in deferral.stages.items()}

    def run(value, compiled=hippie):
        return decided(split_config({"hippie": {"deferred_layers": value}})[2], compiled)

    assert run(1) == {0: (0,), 1: (3,)}  # global layer indices
    assert run({"1": 2}) == {0: "whole", 1: (3, 4)}  # a stage the mapping leaves out: whole
    assert run(3) == {0: "whole", 1: "whole"}  # as many layers as the stages hold
    assert run("all") == {0: "whole", 1: "whole"}
    assert run(0) == {} and run({"0": 0}) == {1: "whole"}  # 0: not deferred
    assert decided(split_config({})[2], hippie) == {0: (0,), 1: (3,)}  # the default rule
    assert decided(split_config({})[2], compile_schedule("1f1b", 4, 4)) == {}
    with pytest.raises(
        ConfigError,
        match=r'"hippie.deferred_layers" = 1: schedule \'1f1b\' has no deferred stages '
        r"\(partial deferral applies to the deferred stages of hippie, hippie-1f1b, hippie-interleaved, "
        r"hippie-zb\)",
    ):
        run(1, compile_schedule("1f1b", 4, 4))
    assert run(1, compile_schedule("hippie", 4, 4, deferred_stages=[])) == {}  # 'auto' may defer none
    with pytest.raises(ConfigError, match=r"stage\(s\) \[2\] are not deferred; deferred stages: \[0, 1\]"):
        run({"2": 1})


def _ds_config(**keys):
    """A DeepSpeedConfig of the tiny shape (2 stages x 1 replica, 4 micro-batches) with ``keys``."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, **keys}, mpu=_OneReplica())


class _OneReplica:
    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return 0


def test_precision_paths_and_refusals():
    """Which optimizer path DeepSpeed takes for a config (hippie_ds.adapter.precision.paths), and what
    each schedule refuses on it, by key, value and what is allowed, before any process group."""
    from hippie_ds.adapter.precision.paths import check_precision, optimizer_path
    from hippie_ds.schedules import compile as compile_schedule

    bf16 = {"bf16": {"enabled": True}}
    fp32_accumulation = {"data_types": {"grad_accum_dtype": "fp32"}}
    zero1 = {"zero_optimization": {"stage": 1}}
    assert optimizer_path(_ds_config()) == "fp32"
    assert optimizer_path(_ds_config(**bf16)) == "bf16"
    assert optimizer_path(_ds_config(**bf16, **zero1, **fp32_accumulation)) == "bf16"
    assert optimizer_path(_ds_config(**bf16, **zero1)) == "zero"  # accumulated in bf16: DeepSpeedZeroOptimizer
    assert optimizer_path(_ds_config(**zero1)) == "zero"
    assert optimizer_path(_ds_config(fp16={"enabled": True})) == "fp16"
    schedules = {
        name: compile_schedule(name, 2, 4)
        for name in ("1f1b", "gpipe", "zb-h1", "hippie", "hippie-1f1b", "hippie-zb", "2bw", "pipedream")
    }
    for config in (_ds_config(), _ds_config(**bf16), _ds_config(**bf16, **zero1, **fp32_accumulation)):
        for compiled in schedules.values():
            check_precision(compiled, config)  # every schedule runs on the fp32 and bf16 paths
    for config in (_ds_config(**zero1), _ds_config(fp16={"enabled": True})):
        for name in ("1f1b", "gpipe"):  # DeepSpeed's own gradient path: stock behaviour
            check_precision(schedules[name], config)
    for config in (_ds_config(**zero1), _ds_config(**bf16, **zero1)):  # DeepSpeedZeroOptimizer: .grad until its reduce
        for compiled in schedules.values():  # hippie-ds reduces .grad and hands ZeRO its partition (ds/zero.py)
            check_precision(compiled, config)
    offload = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    check_precision(schedules["zb-h1"], _ds_config(**offload))  # a split backward alone: .grad until ZeRO's reduce
    with pytest.raises(ConfigError, match=r"schedule 'zb-h1'.*this configuration: 1f1b, gpipe, interleaved-1f1b$"):
        check_precision(schedules["zb-h1"], _ds_config(**bf16, zero_optimization={"stage": 1, "overlap_comm": True}))
    with pytest.raises(
        ConfigError,
        match=r'^config key "zero_optimization.stage" = 1 with "data_types.grad_accum_dtype" '
        r"= None: schedule 'hippie' handles gradients itself .*whole pipeline inside its own step.* set "
        r'\"bf16\": \{\"enabled\": true\} and "data_types": \{"grad_accum_dtype": "fp32"\}.*this '
        r"configuration: 1f1b, gpipe, interleaved-1f1b$",
    ):
        check_precision(schedules["hippie"], _ds_config(**bf16, zero_optimization={"stage": 1, "overlap_comm": True}))
    with pytest.raises(
        ConfigError,
        match=r'"zero_optimization.stage" = 1 without bf16: schedule \'2bw\'.*'
        r"configuration: 1f1b, gpipe, interleaved-1f1b, zb-h1, zb-v$",
    ):
        check_precision(schedules["2bw"], _ds_config(**offload))
    fp16 = {"fp16": {"enabled": True}}
    for config in (_ds_config(**fp16), _ds_config(**fp16, **zero1)):  # a split backward scales the loss as stock does
        check_precision(schedules["zb-h1"], config)
    with pytest.raises(
        ConfigError,
        match=r'"fp16.enabled" = true: schedule \'zb-h1\'.*ZeRO reduces the gradients '
        r"inside its own machinery.*a schedule that runs with fp16: 1f1b, gpipe, interleaved-1f1b, "
        r"zb-h1, zb-v$",
    ):
        check_precision(schedules["zb-h1"], _ds_config(**fp16, zero_optimization={"stage": 1, "overlap_comm": True}))
    for name in ("hippie", "hippie-1f1b", "hippie-zb"):  # one pipeline-wide overflow vote per update (fp16_stage.py)
        check_precision(schedules[name], _ds_config(**fp16))
        check_precision(schedules[name], _ds_config(**fp16, **zero1))  # ZeRO-1 as written: .grad, ZeRO's own scaler
        with pytest.raises(
            ConfigError,
            match=rf"schedule '{name}'.*ZeRO stage 0 and on ZeRO stage 1 without "
            r"overlap_comm.*runs with fp16: 1f1b, gpipe, interleaved-1f1b, zb-h1, zb-v$",
        ):
            check_precision(schedules[name], _ds_config(**fp16, zero_optimization={"stage": 1, "overlap_comm": True}))
    for name in ("2bw", "pipedream"):  # never flushing: the asynchronous overflow vote (fp16_async.py)
        check_precision(schedules[name], _ds_config(**fp16))
        check_precision(schedules[name], _ds_config(**fp16, **zero1))  # ZeRO-1 as written: .grad, ZeRO's own scaler
        with pytest.raises(
            ConfigError,
            match=rf"\"fp16.enabled\" = true: schedule '{name}'.*vote of the schedules "
            r"that never flush is built on ZeRO stage 0 and on ZeRO stage 1 without overlap_comm.*"
            r"runs with fp16: 1f1b, gpipe, interleaved-1f1b, zb-h1, zb-v$",
        ):
            check_precision(schedules[name], _ds_config(**fp16, zero_optimization={"stage": 1, "overlap_comm": True}))
