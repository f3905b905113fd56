"""The one resolution pass (hippie_ds/schedules/resolve.py): 'auto' parameters, one compile, the
deferral, a second compile only when the decision changes the deferred stages, one validation;
and that start-up, the CLI and the planner reach schedules through it alone. Pure: no processes."""

import ast
from pathlib import Path

import pytest

from hippie_ds.schedules import compile as compile_schedule, resolve as resolve_module, validator
from hippie_ds.schedules.costs import Costs
from hippie_ds.schedules.deferral import StageLayers, choose_deferred_layers, resolve_auto_params
from hippie_ds.schedules.resolve import Shape, cost_layers, resolve

ROOT = Path(__file__).resolve().parents[2]


def slow_link(stages=4, per_layer=True):
    stage = dict(forward=0.01, backward=0.02, param_bytes=8e6)
    if per_layer:
        stage["layers"] = [{"param_bytes": 1e6}] * 8
    return Costs.from_dict({"stages": [stage] * stages, "comm": {"allreduce_bandwidth": 5e8, "data_parallel": 2}})


@pytest.fixture
def compiles(monkeypatch):
    calls = {"compile": 0, "validate": 0}

    def counted(fn, kind):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(resolve_module, "compile_schedule", counted(resolve_module.compile_schedule, "compile"))
    monkeypatch.setattr(validator, "validate", counted(validator.validate, "validate"))
    return calls


def test_compiles_once_and_validates_once(compiles):
    r = resolve("hippie", Shape(4, 8))
    assert compiles == {"compile": 1, "validate": 1}
    assert r.compiled.deferred_stages() == r.deferral.deferred_stages() == [0, 1]
    # the default ("untied"), one layer per stage without costs: each deferred stage delays its one layer
    assert {s: (d.layers, d.whole) for s, d in r.deferral.stages.items()} == {0: ((0,), True), 1: ((1,), True)}
    assert r.choices == {}


def test_a_decision_that_drops_deferred_stages_compiles_once_more(compiles):
    r = resolve("hippie", Shape(4, 8), layers="none")
    assert compiles == {"compile": 2, "validate": 1}
    assert r.compiled.deferred_stages() == r.deferral.deferred_stages() == []
    r = resolve("hippie", Shape(4, 8), layers={0: "none"}, validate=False)
    assert r.compiled.deferred_stages() == [1] and compiles["validate"] == 1


def test_auto_parameters_and_layers_are_the_choosers_own():
    """'auto' deferred stages and deferred layers: the same answers as the two choosers called
    in turn, in the config's unit and global layer indices."""
    costs = slow_link()
    params = resolve_auto_params("hippie", 4, 8, costs, {"deferred_stages": "auto"})
    picked = choose_deferred_layers(compile_schedule("hippie", 4, 8, **params), costs, staleness_price=0.0)
    r = resolve("hippie", Shape(4, 8), {"deferred_stages": "auto"}, "auto", costs, staleness_price=0.0)
    assert {s: c.layers for s, c in r.choices.items()} == {s: c.layers for s, c in picked.items()}
    kept = [s for s, c in picked.items() if c.layers]
    assert r.compiled.deferred_stages() == r.deferral.deferred_stages() == kept
    layers = cost_layers(costs)
    for s in kept:
        want = tuple(range(layers[s].first, layers[s].first + picked[s].layers))
        assert r.deferral.stages[s].whole or r.deferral.stages[s].layers == want
    assert r.simulator_layers() == {s: picked[s].layers for s in kept if not r.deferral.stages[s].whole}


def test_auto_layers_without_per_layer_costs_take_the_models_sizes():
    costs = slow_link(per_layer=False)
    stage_layers = {s: StageLayers(8 * s, (True,) * 8) for s in range(4)}
    r = resolve(
        "hippie",
        Shape(4, 8),
        {"deferred_stages": [0, 1]},
        "auto",
        costs,
        stage_layers,
        staleness_price=0.0,
        layer_bytes=lambda s: [1e6] * 8,
    )
    assert set(r.choices) == {0, 1}
    from hippie_ds.schedules.costs import CostsError

    with pytest.raises(CostsError, match="stage 0 lists 8 layers, the model's stage 0 has 2"):
        resolve(
            "hippie",
            Shape(4, 8),
            {"deferred_stages": [0, 1]},
            "auto",
            slow_link(),
            {s: StageLayers(2 * s, (True, True)) for s in range(4)},
        )


def test_the_tie_rule_applies_where_stages_update_apart():
    layers = {
        0: StageLayers(0, (True, True), ("embed", None)),
        1: StageLayers(2, (True,)),
        2: StageLayers(3, (True,)),
        3: StageLayers(4, (True, True), (None, "embed")),
    }
    tied = resolve("hippie", Shape(4, 8), {"deferred_stages": [0]}, 1, None, layers, ties=True)
    assert tied.compiled.deferred_stages() == [0, 3] and tied.deferral.tied_delayed == {"embed"}
    untied = resolve("hippie", Shape(4, 8), {"deferred_stages": [0]}, 1, None, layers, ties=False)
    assert untied.compiled.deferred_stages() == [0]


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
    }


def test_start_up_the_cli_and_the_planner_resolve_through_one_pass():
    """They call ``resolve`` (start-up through the adapter's ``resolve_for_module``), and nothing
    outside the pass calls the choosers or recompiles for a decision."""
    for user in (
        "hippie_ds/adapter/module/deferred_layers.py",
        "hippie_ds/cli/schedule.py",
        "hippie_ds/planner/evaluate.py",
        "tools/bench/studies/example_costs.py",
    ):
        assert "resolve" in _calls(ROOT / user), user
    assert "resolve_for_module" in _calls(ROOT / "hippie_ds/adapter/startup/checks.py")
    allowed = {ROOT / "hippie_ds/schedules/resolve.py", *(ROOT / "hippie_ds/schedules/deferral").glob("*.py")}
    for path in [*(ROOT / "hippie_ds").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        if path in allowed:
            continue
        found = _calls(path) & {
            "choose_deferred_layers",
            "resolve_auto_params",
            "decide",
            "recompile",
            "final_schedule",
        }
        assert not found, f"{path.relative_to(ROOT)} calls {sorted(found)}: go through schedules.resolve.resolve"
