"""Partial deferral decided once (hippie_ds/schedules/deferral/, pure): what each stage delays,
in global layer indices, from the deferred stages, ``hippie.deferred_layers`` and a plain
description of the layers; and start-up (startup.checks.prepare) compiling and validating the
schedule once and reading the cost file once. One process, no process group."""

from types import SimpleNamespace

import pytest

from hippie_ds.config import DEFAULT_DEFERRED_LAYERS, ConfigError
from hippie_ds.schedules.deferral import Deferral, StageLayers, decide, with_parameters

# Megatron-DeepSpeed's shape on 2 stages: [to_float, embedding (tied to the head), block, block |
# block, block, LayerNorm, head (the embedding's copy reached through a function: no parameters)]
MEGATRON = {
    0: StageLayers(0, (False, True, True, True), (None, "embed", None, None)),
    1: StageLayers(4, (True, True, True, False), (None, None, None, "embed")),
}
# 4 stages of 3, 3, 2 and 2 layers with parameters, no ties
PLAIN = {
    0: StageLayers(0, (True,) * 3),
    1: StageLayers(3, (True,) * 3),
    2: StageLayers(6, (True,) * 2),
    3: StageLayers(8, (True,) * 2),
}


def _what(deferral: Deferral) -> dict:
    return {
        s: ("whole" if d.whole else d.layers, set(d.tied_keys), set(d.kept_keys)) for s, d in deferral.stages.items()
    }


def test_default_untied_passes_over_a_tied_first_layer():
    assert DEFAULT_DEFERRED_LAYERS == "untied"
    deferral = decide([0], DEFAULT_DEFERRED_LAYERS, MEGATRON)
    # the first block (index 2) is delayed; the embedding before it stays in-step, and so the head
    assert _what(deferral) == {0: ((2,), set(), {"embed"})}
    assert deferral.deferred_stages() == [0] and deferral.tied_delayed == set() and deferral.tied_kept == {"embed"}
    assert deferral.leading(MEGATRON) == {0: 3}  # the engine's split_deferred: 3 leading layers, the kept one out


def test_an_int_counts_layers_with_parameters_and_ties_follow_one_rule():
    deferral = decide([0], 1, MEGATRON)
    # the embedding is stage 0's first layer with parameters: delayed, so on its other holder too,
    # which becomes a deferred stage that delays only the tied weights
    assert _what(deferral) == {0: ((1,), {"embed"}, set()), 1: ((), {"embed"}, set())}
    assert deferral.leading(MEGATRON) == {0: 2, 1: 0}
    assert _what(decide([0], 2, MEGATRON))[0] == ((1, 2), {"embed"}, set())
    assert _what(decide([0], 3, MEGATRON))[0] == ("whole", {"embed"}, set())  # every layer with parameters
    assert _what(decide([0, 1], 1, PLAIN)) == {0: ((0,), set(), set()), 1: ((3,), set(), set())}


def test_all_delays_whole_stages():
    assert _what(decide([0], "all", MEGATRON)) == {0: ("whole", {"embed"}, set()), 1: ((), {"embed"}, set())}
    deferral = decide([0, 1], "all", PLAIN)
    assert _what(deferral) == {0: ("whole", set(), set()), 1: ("whole", set(), set())}
    assert deferral.leading(PLAIN) == {} and deferral.stages[1].layers == (3, 4, 5)


def test_a_per_stage_mapping_and_zero():
    # a stage the mapping leaves out is delayed whole
    assert _what(decide([0, 1], {1: 2}, PLAIN)) == {0: ("whole", set(), set()), 1: ((3, 4), set(), set())}
    # 0: the stage delays nothing, so it is not deferred (as if left out of deferred_stages)
    assert decide([0, 1], {0: 0, 1: 1}, PLAIN).deferred_stages() == [1]
    assert decide([0, 1], 0, PLAIN).deferred_stages() == []
    # ... and, like any stage that is not deferred, it delays a tied module another holder delays
    assert _what(decide([0, 1], {0: 1, 1: 0}, MEGATRON)) == {0: ((1,), {"embed"}, set()), 1: ((), {"embed"}, set())}
    with pytest.raises(ConfigError, match=r"stage\(s\) \[2\] are not deferred; deferred stages: \[0, 1\]"):
        decide([0, 1], {2: 1}, PLAIN)


def test_no_deferred_stage_delays_nothing():
    for value in ("untied", "all", 1, {}):
        assert decide([], value, MEGATRON).stages == {}


def test_a_stage_with_only_tied_layers_is_not_deferred_under_untied():
    layers = {
        0: StageLayers(0, (False, True), (None, "embed")),
        1: StageLayers(2, (True, True)),
        2: StageLayers(4, (True, False), (None, "embed")),
    }
    assert _what(decide([0, 1], "untied", layers)) == {1: ((2,), set(), set())}


def test_tie_rule_off_and_auto_unresolved():
    assert _what(decide([0], 1, MEGATRON, tie_rule=False)) == {0: ((1,), set(), set())}
    with pytest.raises(ConfigError, match="resolve it first"):
        decide([0], "auto", MEGATRON)
    # "auto" chooses leading layers of a cost file's stage; the config counts layers with parameters
    assert with_parameters(MEGATRON[0].params, 3) == 2 and with_parameters(MEGATRON[0].params, 0) == 0


# ---------------------------------------------------------------------------------------------
# start-up: compiled and validated once, the cost file read once


def _model(parts=(0, 4, 8), built=False):
    import torch
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.pipe.topology import ProcessTopology

    stages = len(parts) - 1
    extra = (
        dict(
            forward_funcs=[torch.nn.Linear(4, 4) for _ in range(parts[-1])],
            _local_start=0,
            _layer_specs=[LayerSpec(torch.nn.Linear, 4, 4)] * parts[-1],
            stage_id=0,
            global_rank=0,
            stage_owner=lambda i: next(s for s in range(stages) if parts[s] <= i < parts[s + 1]),
        )
        if built
        else {}
    )
    return SimpleNamespace(
        num_stages=stages,
        _topo=ProcessTopology(axes=["data", "pipe"], dims=[1, stages]),
        mpu=lambda: None,
        tied_comms={},
        parts=list(parts),
        **extra,
    )


def _config(**hippie):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "train_batch_size": 4,
        "pipeline": {"schedule": "hippie"},
        "hippie": hippie,
    }


@pytest.fixture
def counted(monkeypatch):
    from hippie_ds.schedules import resolve as schedules, validator
    from hippie_ds.schedules.costs import Costs

    calls = {"compile": 0, "validate": 0, "costs": 0}

    def counting(name, fn, kind):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(schedules, "compile_schedule", counting("compile", schedules.compile_schedule, "compile"))
    monkeypatch.setattr(validator, "validate", counting("validate", validator.validate, "validate"))
    monkeypatch.setattr(Costs, "from_file", staticmethod(counting("costs", Costs.from_file, "costs")))
    return calls


def test_start_up_compiles_and_validates_the_schedule_once(counted):
    from hippie_ds.adapter.startup.checks import prepare

    *_, compiled, options, deferral = prepare(_model(), _config())
    assert counted == {"compile": 1, "validate": 1, "costs": 0}
    assert compiled.deferred_stages() == deferral.deferred_stages() == [0] and deferral.stages[0].layers == (0,)
    # a decision that changes the deferred stages compiles once more, and still validates once
    *_, compiled, _, deferral = prepare(_model(), _config(deferred_layers=0))
    assert counted == {"compile": 3, "validate": 2, "costs": 0}
    assert compiled.deferred_stages() == deferral.deferred_stages() == []


def test_start_up_reads_the_cost_file_once(counted, tmp_path):
    from hippie_ds.adapter.startup.checks import prepare
    from hippie_ds.schedules.costs import Costs

    stage = {"forward": 0.01, "backward": 0.02, "param_bytes": 4e6, "layers": [{"param_bytes": 1e6}] * 4}
    path = tmp_path / "costs.json"
    path.write_text(
        Costs.from_dict(
            {"stages": [stage] * 2, "comm": {"allreduce_bandwidth": 1e8, "data_parallel": 2}}
        ).model_dump_json()
    )
    choices = {}
    *_, compiled, _, deferral = prepare(
        _model(built=True), _config(deferred_stages="auto", deferred_layers="auto", costs=str(path)), choices=choices
    )
    assert counted["costs"] == 1 and counted["validate"] == 1
    # both stages defer on this slow link; "auto" chose leading layers, the decision holds their indices
    assert compiled.deferred_stages() == deferral.deferred_stages() == [0, 1]
    assert {s: d.layers for s, d in deferral.stages.items()} == {
        s: tuple(range(4 * s, 4 * s + c.layers)) for s, c in choices.items()
    }
