"""A planner plan with virtual stages (``interleaved-1f1b``, ``zb-v``, ``hippie-interleaved``) applied to
``hippie_ds.PipelineModule``: the module takes the plan's model chunks and layout (the
config may name the schedule only when ``hippie_ds.initialize`` merges the plan in), counts the
plan's stages as pipeline ranks (``pipeline_depth`` = K, ``boundaries`` K·v+1 entries), and
``initialize`` checks a chunked module's model parts against the plan. Pure: the checks on a plan of
the Megatron-shaped client (tests/distributed/megatron_shaped.py) and stand-in modules; the real
ranks are ``tests/real_clients/test_real_clients.py::test_a_chunked_plan_in_the_config_trains_as_1f1b``."""

from types import SimpleNamespace

import pytest

from hippie_ds.adapter.module.config_discovery import FoundConfig
from hippie_ds.adapter.module.pipeline_module import announce, check_plan, chunks_of_plan
from hippie_ds.config import ConfigError, split_config
from hippie_ds.planner import PlanMismatchError, save_plan

import megatron_shaped as client

SPECS = client.specs(4)
BOUNDARIES = client.PLAN_BOUNDARIES


@pytest.fixture(scope="module")
def plans():
    return {name: client.chunked_plan(schedule=name) for name in ("interleaved-1f1b", "zb-v")}


def test_the_module_takes_the_plans_chunks(plans):
    plan = plans["interleaved-1f1b"]
    assert (plan.pipeline_depth, plan.virtual_stages, plan.boundaries) == (2, 2, BOUNDARIES)
    assert chunks_of_plan(plan, None, None) == (2, "interleaved")
    assert chunks_of_plan(plan, 2, "interleaved") == (2, "interleaved")
    assert chunks_of_plan(plans["zb-v"], None, None) == (2, "v")
    with pytest.raises(PlanMismatchError) as info:
        chunks_of_plan(plan, 3, None)
    assert str(info.value) == (
        "virtual_stages=3, but the plan for schedule 'interleaved-1f1b' has virtual_stages 2 "
        f"(boundaries {BOUNDARIES}); leave virtual_stages out to take the plan's"
    )
    with pytest.raises(PlanMismatchError) as info:
        chunks_of_plan(plan, None, "v")
    assert str(info.value) == (
        "layout='v', but the plan for schedule 'interleaved-1f1b' places its 2 model chunks "
        "per stage in the 'interleaved' layout; leave layout out to take the plan's"
    )


def test_check_plan_counts_ranks_and_model_chunks(plans):
    plan = plans["interleaved-1f1b"]
    check_plan(plan, SPECS, world_size=4, num_stages=2, virtual_stages=2, layout="interleaved")
    check_plan(plan, SPECS, world_size=4, num_stages=None)  # chunks not known yet
    with pytest.raises(
        PlanMismatchError,
        match=r"this job has 4 pipeline stages \(from num_stages=4\) on 4 ranks, "
        r"but the plan for 'megatron-shaped' has 2 stages x 2 model "
        r"chunks each",
    ):
        check_plan(plan, SPECS, world_size=4, num_stages=4)  # stages x virtual stages is not the stage count
    with pytest.raises(PlanMismatchError) as info:
        check_plan(plan, SPECS, world_size=4, num_stages=2, virtual_stages=1, layout="interleaved")
    assert str(info.value) == (
        "the module holds 1 model chunk per stage, but the plan for schedule 'interleaved-1f1b' "
        f"has 2 model chunks per stage (interleaved layout) (boundaries {BOUNDARIES})"
    )
    with pytest.raises(
        PlanMismatchError,
        match=r"holds 2 model chunks per stage \(interleaved layout\), but the plan "
        r"for schedule 'zb-v' has 2 model chunks per stage \(v layout\)",
    ):
        check_plan(plans["zb-v"], SPECS, world_size=4, num_stages=2, virtual_stages=2, layout="interleaved")
    short = plan.model_copy(update={"boundaries": [0, 4, 8]})  # past the Plan model's own check
    with pytest.raises(PlanMismatchError) as info:
        check_plan(short, SPECS, world_size=4, num_stages=2)
    assert str(info.value) == (
        "the plan's boundaries [0, 4, 8] cut 2 model parts; its 2 stages x 2 virtual stages need 4"
    )


def _module(**attrs):
    """What ``startup.inputs.apply_plan`` reads of a built module (a chunked one: its K·v+1 parts)."""
    base = dict(
        _layer_specs=SPECS,
        world_size=4,
        num_stages=2,
        virtual_stages=2,
        layout_kind="interleaved",
        parts=list(BOUNDARIES),
        checkpointed_layers=list(client.PLAN_CHECKPOINTED),
        activation_checkpoint_interval=0,
        hippie_config_source="config=",
    )
    return SimpleNamespace(**{**base, **attrs})


def _apply(model, plan, tmp_path):
    from hippie_ds.adapter.startup.inputs import apply_plan as _apply_plan

    save_plan(plan, tmp_path / "plan.json")
    config = {"train_micro_batch_size_per_gpu": client.MICRO, "hippie": {"plan": "plan.json"}}  # no schedule
    return _apply_plan(model, config, split_config(config)[2], str(tmp_path / "ds.json"))


def test_initialize_checks_a_chunked_module_against_the_plan(plans, tmp_path):
    plan = plans["interleaved-1f1b"]
    merged = _apply(_module(), plan, tmp_path)
    assert merged["pipeline"] == {"schedule": "interleaved-1f1b", "virtual_stages": 2}
    assert merged["gradient_accumulation_steps"] == 4 and merged["hippie"]["plan"] == "plan.json"
    # the same boundaries in the other layout: other parts on each rank
    with pytest.raises(ConfigError) as info:
        _apply(_module(), plans["zb-v"], tmp_path)
    assert str(info.value).startswith(
        "config key \"hippie.plan\" = 'plan.json': the plan has 2 model chunks per stage (v layout), boundaries "
        f"{BOUNDARIES} and checkpointed layers [3, 4, 6], but the model was built with 2 model chunks per stage "
        f"(interleaved layout), boundaries {BOUNDARIES} and checkpointed layers [3, 4, 6]; "
    ), str(info.value)
    with pytest.raises(
        ConfigError,
        match=r"but the model was built with 2 model chunks per stage \(interleaved "
        r"layout\), boundaries \[0, 2, 4, 6, 8\]",
    ):
        _apply(_module(parts=[0, 2, 4, 6, 8]), plan, tmp_path)
    # DeepSpeed's module: one chunk, K+1 parts
    stock = _module(parts=[0, 4, 8], checkpointed_layers=[])
    del stock.virtual_stages, stock.layout_kind, stock.hippie_config_source
    with pytest.raises(
        ConfigError,
        match=r"built with 1 model chunk per stage, boundaries \[0, 4, 8\] .*the model "
        r"is DeepSpeed's PipelineModule",
    ):
        _apply(stock, plan, tmp_path)


def test_the_announcement_names_the_plans_schedule(plans, capsys):
    """The config names no schedule (the plan's is merged in by initialize): rank 0 says the plan's."""
    found = FoundConfig({"hippie": {"plan": "plan.json"}}, "--deepspeed_config /job/ds.json (sys.argv)", "/job/ds.json")
    announce(found, 2, "interleaved", plans["interleaved-1f1b"])
    assert capsys.readouterr().out == (
        "hippie-ds: PipelineModule built without config=, from the DeepSpeed config --deepspeed_config /job/ds.json "
        "(sys.argv): the plan for 'megatron-shaped' (schedule 'interleaved-1f1b': 2 model chunks per stage "
        f"(interleaved layout); boundaries {BOUNDARIES})\n"
    )
