"""Start-up (hippie_ds/adapter/startup/): the config a module has read is not read again, and the
``adam`` correction's optimizer and wrapper are refused before any process group, with the message
the correction gives once built."""

from types import SimpleNamespace

import pytest
import torch

from hippie_ds.adapter.ds.runtime import DeepSpeedConfig
from hippie_ds.adapter.staleness import adam
from hippie_ds.adapter.startup import inputs
from hippie_ds.config import ConfigError, StalenessConfig

ADAM = StalenessConfig(method="adam")
BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_batch_size": 2}


def _config_class(**extra):
    return DeepSpeedConfig({**BASE, **extra}, None)


def test_the_wrapper_adam_cannot_read_is_refused_at_start_up_as_once_built():
    zero1 = _config_class(zero_optimization={"stage": 1})
    assert adam.wrapper_of(_config_class()) is None  # fp32: the torch optimizer itself
    assert (
        adam.wrapper_of(
            _config_class(
                bf16={"enabled": True}, zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "fp32"}
            )
        )
        is None
    )  # BF16_Optimizer
    assert adam.wrapper_of(zero1) == "DeepSpeedZeroOptimizer"
    assert adam.wrapper_of(_config_class(fp16={"enabled": True})) == "FP16_UnfusedOptimizer"
    with pytest.raises(ConfigError) as at_start:
        adam.check_wrapper(ADAM, zero1)
    with pytest.raises(ConfigError) as once_built:
        adam.source_of(type("DeepSpeedZeroOptimizer", (), {})(), 1.0)
    assert str(at_start.value) == str(once_built.value)
    adam.check_wrapper(StalenessConfig(method="extrapolate"), zero1)  # only adam reads the moments


def test_an_optimizer_adam_cannot_read_is_refused_as_a_callable_builds_it():
    params = [torch.nn.Parameter(torch.randn(2))]
    assert adam.checked_when_built(ADAM, None) is None
    built = adam.checked_when_built(ADAM, lambda ps: torch.optim.AdamW(ps, lr=0.1))
    assert type(built(params)) is torch.optim.AdamW
    with pytest.raises(ConfigError, match=r'"hippie.staleness.method" = "adam": the optimizer is torch.optim.sgd.SGD'):
        adam.checked_when_built(ADAM, lambda ps: torch.optim.SGD(ps, lr=0.1))(params)
    named = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "maximize": True}}}
    with pytest.raises(ConfigError, match="the optimizer runs with maximize=True"):
        adam.check_config(ADAM, named)


def test_initialize_takes_the_config_and_plan_the_module_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2}')
    read = {"train_micro_batch_size_per_gpu": 2, "hippie": {"plan": "plan.json"}}
    plan = SimpleNamespace(model="gpt")
    model = SimpleNamespace(
        hippie_config=read, hippie_config_path=str(path), hippie_plan=plan, hippie_plan_source=f"{path} (config=)"
    )
    assert inputs.load_config(None, str(path), None, model) is read  # not read again
    assert inputs.load_config(None, str(path), None) == {"train_micro_batch_size_per_gpu": 2}  # no module: read
    assert inputs.module_plan(model, dict(read), str(path)) is plan
    assert inputs.module_plan(model, {**read, "hippie": {"plan": "other.json"}}, str(path)) is None
    assert inputs.module_plan(model, read, str(tmp_path / "elsewhere.json")) is None  # relative to another file
