"""``hippie.deferred_layers: "auto"``: the per-layer costs, the simulator's early in-step
all-reduce, the chooser (schedules/deferral/auto_layers.py) and its wiring (config, the one
resolution pass, integration).
Pure: no process group."""

from types import SimpleNamespace

import pytest
import torch

from hippie_ds.config import ConfigError, merge_plan, split_config
from hippie_ds.schedules import compile
from hippie_ds.schedules.costs import Costs, CostsError, StageCost
from hippie_ds.schedules.deferral import choose_deferred_layers
from hippie_ds.schedules.simulator import SimulationError, simulate

K, M, LAYERS = 4, 8, 8


def costs(bandwidth, data_parallel=2, per_layer=True, stages=K):
    """Balanced stages of 8 equal layers (8 MB of gradient a stage), ``data_parallel`` replicas
    over a shared link of ``bandwidth`` bytes/s."""
    stage = dict(forward=0.01, backward=0.02, param_bytes=8e6)
    if per_layer:
        stage["layers"] = [{"param_bytes": 1e6}] * LAYERS
    return Costs.from_dict(
        {"stages": [stage] * stages, "comm": {"allreduce_bandwidth": bandwidth, "data_parallel": data_parallel}}
    )


HIPPIE = compile("hippie", K, M, validate=False, deferred_stages=[0, 1])


def chosen(bandwidth, staleness_price=None, **kw):
    return {
        s: c.layers
        for s, c in choose_deferred_layers(HIPPIE, costs(bandwidth, **kw), staleness_price=staleness_price).items()
    }


# ---------------------------------------------------------------------------------------------
# Costs


def test_delayed_part_from_per_layer_costs():
    """The share is by gradient bytes; the lead is the delayed layers' backward, their own when
    given, else the stage's backward split by parameter share."""
    stage = StageCost(forward=1, backward=4, layers=[{"param_bytes": 3}, {"param_bytes": 1, "backward": 0.5}])
    assert stage.delayed_part(0) == (0.0, 0.0)
    assert stage.delayed_part(1) == (pytest.approx(0.75), pytest.approx(3.0))
    assert stage.delayed_part(2) == (pytest.approx(1.0), pytest.approx(3.5))
    with pytest.raises(CostsError, match=r"delayed layers = 3: allowed 0..2 for a stage of 2 layers"):
        stage.delayed_part(3)
    with pytest.raises(CostsError, match="no per-layer breakdown"):
        StageCost(forward=1, backward=1).delayed_part(1)


def test_old_cost_files_stay_valid():
    """``layers`` is optional: a per-stage cost file without it loads and simulates as before."""
    c = costs(1e8, per_layer=False)
    assert c.stages[0].layers is None
    assert simulate(HIPPIE, c).step_time > 0


# ---------------------------------------------------------------------------------------------
# Simulator: the in-step part starts inside the last backward


def test_early_allreduce_exposure_falls_with_more_delayed_layers():
    """The in-step part is all-reduced from the moment its gradients are final, the delayed
    layers' backward before the last backward ends: the more layers delayed, the earlier it
    starts and the smaller it is, so the stage waits less for it."""
    c = costs(2e8)  # only stage 0 all-reduces: nobody else's traffic on the link
    c = c.model_copy(update={"stages": [c.stages[0]] + [x.model_copy(update={"param_bytes": 0}) for x in c.stages[1:]]})
    exposed = [
        simulate(HIPPIE, c, deferred_layers={0: L, 1: LAYERS}).per_stage[0]["exposed_allreduce"]
        for L in range(LAYERS + 1)
    ]
    assert all(a >= b for a, b in zip(exposed, exposed[1:])) and exposed[0] > exposed[3] > exposed[-1] == 0
    # by share alone (no per-layer costs) the delayed layers' backward is that share of the stage's:
    # with equal layers, the same figures as by layers
    share = c.stages[0].delayed_part(3).fraction
    by_share = simulate(HIPPIE, c, delayed_fraction={0: share, 1: 1.0}).per_stage[0]["exposed_allreduce"]
    assert by_share == pytest.approx(exposed[3])


def test_delayed_share_takes_the_share_of_the_backward():
    """A run reports only its share: the lead is that share of the stage's backward (delayed_part's
    rule for layers without their own time), never more than the backward."""
    stage = StageCost(forward=1, backward=4)
    assert stage.delayed_share(0.25) == (0.25, pytest.approx(1.0))
    assert stage.delayed_share(1.0) == (1.0, pytest.approx(4.0))


def test_in_step_part_starts_before_the_last_stage_waits_for_its_sends():
    """hippie's last stage declares WAIT_SENDS before START_ALLREDUCE(grads); the engine's hooks
    start a partially deferred stage's in-step all-reduce inside its last backward, so it runs
    while the stage waits for its sends (measured: VGG-16's throughput plan, 4 nodes, where
    starting it at the declared op over-predicted the step by 25%)."""
    compiled = compile("hippie", K, M, validate=False, deferred_stages=[K - 1])
    stages = [dict(forward=0.01, backward=0.05, param_bytes=0.0, activation_bytes=1e6)] * (K - 1)
    last = dict(forward=0.01, backward=0.01, param_bytes=8e6, activation_bytes=1e6)
    c = Costs.from_dict(
        {
            "stages": stages + [last],
            "comm": {"allreduce_bandwidth": 1e8, "data_parallel": 4, "p2p_bandwidth": 1e7},
        }
    )
    res = simulate(compiled, c, delayed_fraction={K - 1: 0.05})
    last_call = [e for e in res.events if e.stage == K - 1]
    waits = [e for e in last_call if e.name == "wait_sends"]
    grads = [e for e in last_call if e.name == "allreduce(grads)"]
    assert waits and grads and waits[-1].end - waits[-1].start > 0.05, (waits, grads)
    # the call's in-step all-reduce is in flight before its WAIT_SENDS ends
    assert grads[-1].start < waits[-1].end


def test_nothing_delayed_is_an_ordinary_stage():
    """0 layers on a deferred stage delays nothing: its all-reduce and step time are those of the
    same stage not deferred."""
    c = costs(2e8)
    zero = simulate(HIPPIE, c, deferred_layers={0: 0, 1: 0})
    eager = simulate(compile("hippie", K, M, validate=False, deferred_stages=[]), c)
    assert zero.step_time == pytest.approx(eager.step_time)
    assert zero.per_stage[0]["exposed_allreduce"] == pytest.approx(eager.per_stage[0]["exposed_allreduce"])
    assert zero.per_stage[0]["gradient_buffer_bytes"] == 0


def test_simulator_partial_deferral_errors():
    with pytest.raises(SimulationError, match=r"deferred_layers of stage 0: .*no per-layer breakdown"):
        simulate(HIPPIE, costs(1e8, per_layer=False), deferred_layers={0: 1})
    with pytest.raises(SimulationError, match=r"stage\(s\) \[0\]: given both delayed_fraction and deferred_layers"):
        simulate(HIPPIE, costs(1e8), deferred_layers={0: 1}, delayed_fraction={0: 0.5})


# ---------------------------------------------------------------------------------------------
# The chooser


def test_nothing_to_hide_delays_nothing():
    """One replica (no all-reduce) or a link fast enough to hide it: 0 layers, at any price."""
    for price in (0.0, 0.5):
        assert chosen(1e8, data_parallel=1, staleness_price=price) == {0: 0, 1: 0}
        assert chosen(1e15, staleness_price=price) == {0: 0, 1: 0}


def _objective(c, layers, price):
    res = simulate(HIPPIE, c, 3, critical_path=False, deferred_layers=layers)
    return res.step_time * (1 + price * sum(layers.values()) / (K * LAYERS))  # equal layers, equal stages


@pytest.mark.parametrize("price", [0.0, 0.5])
def test_choice_is_the_least_predicted_time_to_a_loss(price):
    """The choice minimises step time x (1 + price x stale share of the model's gradient): on two
    deferred stages of 8 layers it matches an exhaustive search over all 81 pairs, including a
    link where only both stages delaying together pays (2e8: either alone still shares the link)."""
    for bandwidth in (1e10, 1e9, 5e8, 2e8, 1e8):
        c = costs(bandwidth)
        got = chosen(bandwidth, staleness_price=price)
        best = min(_objective(c, {0: a, 1: b}, price) for a in range(LAYERS + 1) for b in range(LAYERS + 1))
        assert _objective(c, got, price) <= best * (1 + 1e-3), (bandwidth, got)


def test_staleness_price_trades_step_time_for_fewer_stale_layers():
    """Price 0: the step time alone (at 1 Gbit/s some of stage 0, the stage with the least slack;
    slower links more); a higher price delays no more, and at 0.5 these costs' 1 Gbit/s gain
    (under 3% of the step) is not worth a stale layer."""
    assert 0 < chosen(1e9, staleness_price=0.0)[0] < LAYERS
    for bandwidth in (1e9, 5e8, 2e8):
        shares = [sum(chosen(bandwidth, staleness_price=p).values()) for p in (0.0, 0.1, 0.5, 2.0)]
        assert shares == sorted(shares, reverse=True), (bandwidth, shares)
    assert chosen(1e9) == {0: 0, 1: 0}  # the default price, 0.5
    assert chosen(2e8) == {0: LAYERS, 1: LAYERS}  # a slow link: hiding it is worth the staleness
    with pytest.raises(CostsError, match=r"staleness_price = -1: allowed a number >= 0"):
        choose_deferred_layers(HIPPIE, costs(1e9), staleness_price=-1)


def test_choice_reports_what_it_predicts():
    c = costs(5e8)
    choice = choose_deferred_layers(HIPPIE, c, staleness_price=0.0)
    first = choice[0]
    assert first.delayed_share == pytest.approx(first.layers / LAYERS)
    assert first.stale_share == pytest.approx(sum(x.layers for x in choice.values()) / (K * LAYERS))
    res = simulate(HIPPIE, c, deferred_layers={s: x.layers for s, x in choice.items()})
    assert first.step_time == pytest.approx(res.step_time)
    assert first.exposed_allreduce == pytest.approx(res.per_stage[0]["exposed_allreduce"])
    assert first.nothing_delayed_step_time == pytest.approx(simulate(HIPPIE, c, deferred_layers={0: 0, 1: 0}).step_time)
    assert first.step_time < first.nothing_delayed_step_time
    text = first.describe()
    assert "stage 0: delays" in text and "predicted exposed all-reduce" in text and "staleness_price 0" in text


def test_chooser_needs_per_layer_costs_and_deferred_stages():
    with pytest.raises(CostsError, match=r"stage\(s\) \[0, 1\]: no per-layer costs"):
        choose_deferred_layers(HIPPIE, costs(1e8, per_layer=False))
    assert choose_deferred_layers(compile("1f1b", K, M, validate=False), costs(1e8)) == {}


# ---------------------------------------------------------------------------------------------
# Config and integration


def test_config_accepts_auto_and_names_it_in_errors():
    assert split_config({"hippie": {"deferred_layers": "auto"}})[2].deferred_layers == "auto"
    with pytest.raises(ConfigError, match=r'"hippie.deferred_layers" = \'some\': .*allowed: .*"auto"'):
        split_config({"hippie": {"deferred_layers": "some"}})
    # a plan's choice replaces "auto", a different explicit value is a conflict
    planned = {"hippie": {"deferred_layers": {"0": 3}}}
    assert merge_plan({"hippie": {"deferred_layers": "auto"}}, planned, "p.json")["hippie"]["deferred_layers"] == {
        "0": 3
    }
    with pytest.raises(ConfigError, match=r'"hippie.deferred_layers" = 1, but the plan p.json'):
        merge_plan({"hippie": {"deferred_layers": 1}}, planned, "p.json")


def _model(stage_id=0, parts=(0, 8, 16, 24, 32), specs=True):
    """What integration reads of a PipelineModule: its layer specs and built layers, every
    stage's (as ``layers_with_parameters`` gathers them over the world); equal Linear layers, so
    the same shares as the per-layer cost files."""
    from deepspeed.pipe import LayerSpec

    layers = [torch.nn.Linear(4, 4) for _ in range(parts[-1])]
    specs = [LayerSpec(torch.nn.Linear, 4, 4) if specs else LayerSpec(_NeedsData) for _ in range(parts[-1])]
    return SimpleNamespace(
        parts=list(parts),
        num_stages=len(parts) - 1,
        stage_id=stage_id,
        forward_funcs=layers,
        _local_start=0,
        _layer_specs=specs,
        global_rank=0,
        tied_comms={},
        _topo=SimpleNamespace(get_coord=lambda rank: SimpleNamespace(data=0)),
    )


class _NeedsData(torch.nn.Module):
    """A layer that cannot be built on the meta device."""

    def __init__(self):
        super().__init__()
        raise RuntimeError("needs real tensors")


def _options(tmp_path, c=None, **hippie):
    if c is not None:
        path = tmp_path / "costs.json"
        path.write_text(c.model_dump_json())
        hippie["costs"] = str(path)
    return split_config({"hippie": {"deferred_layers": "auto", **hippie}})[2]


def _resolved(model, options, compiled=HIPPIE):
    """The schedule ``compiled`` names, at its shape and with its parameters as given, resolved
    as start-up resolves it for ``model``."""
    from hippie_ds.adapter.module.deferred_layers import read_costs, resolve_for_module
    from hippie_ds.schedules import load_spec
    from hippie_ds.schedules.resolve import Shape

    c = None if options.costs is None else read_costs(options, compiled.stages)  # start-up reads it once
    return resolve_for_module(
        model,
        options,
        load_spec(compiled.name),
        Shape(compiled.stages, compiled.micro_batches),
        dict(compiled.params),
        c,
    )


def _decided(model, options, compiled=HIPPIE):
    """{deferred stage: delayed layers with parameters, or 'whole'} as start-up decides it."""
    deferral = _resolved(model, options, compiled).deferral
    return {s: "whole" if d.whole else len(d.layers) for s, d in deferral.stages.items()}


def test_staleness_price_is_checked_before_any_process_group(tmp_path):
    with pytest.raises(ConfigError, match=r'"hippie.staleness_price" = -0.5: .*greater than or equal to 0'):
        split_config({"hippie": {"deferred_layers": "auto", "staleness_price": -0.5}})
    options = split_config({"hippie": {"staleness_price": 0.2}})[2]
    with pytest.raises(
        ConfigError,
        match=r'"hippie.staleness_price" = 0.2: it prices only "hippie.deferred_layers": '
        r'"auto", and that key is \'untied\' here',
    ):  # the default
        _decided(_model(), options)


def test_integration_auto_needs_costs(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r'"hippie.deferred_layers" = \'auto\': needs costs to choose from: '
        r'"hippie.costs".*or "hippie.plan"',
    ):
        _decided(_model(), _options(tmp_path))
    with pytest.raises(ConfigError, match=r'the plan \'p.json\' \("hippie.plan"\) states no choice'):
        _decided(_model(), _options(tmp_path, plan="p.json"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: {forward: 1}\n")
    with pytest.raises(ConfigError, match=r'(?s)"hippie.costs" = .*bad.yaml.*field stages.0.backward'):
        _decided(_model(), split_config({"hippie": {"deferred_layers": "auto", "costs": str(bad)}})[2])


def test_integration_auto_from_per_stage_costs_and_the_models_layers(tmp_path, caplog):
    """A per-stage cost file: the stages take the model's own layers' parameter bytes (from its
    layer specs; when those cannot be built, this rank's layers); the choice matches the
    chooser's on the per-layer file, in the decision's unit (global layer indices)."""
    expected = chosen(5e8, staleness_price=0.0)
    assert 0 < expected[0] < LAYERS
    want = {s: "whole" if k == LAYERS else k for s, k in expected.items() if k}
    price = {"staleness_price": 0.0}
    assert _decided(_model(), _options(tmp_path, costs(5e8, per_layer=False), **price)) == want
    assert _decided(_model(stage_id=1), _options(tmp_path, costs(5e8), **price)) == want
    for stage_id in (0, 1):
        assert _decided(_model(stage_id, specs=False), _options(tmp_path, costs(5e8, per_layer=False), **price)) == want
    resolved = _resolved(_model(), _options(tmp_path, costs(5e8), **price))
    assert resolved.deferral.stages[0].layers == tuple(range(expected[0]))  # stage 0's first layers, by index
    assert {s: c.layers for s, c in resolved.choices.items()} == expected
    # the default price: this link's gain is not worth a stale layer: no stage stays deferred
    assert _decided(_model(), _options(tmp_path, costs(5e8))) == {}
    with pytest.raises(ConfigError, match="stage 0 lists 8 layers, the model's stage 0 has 2"):
        _decided(_model(parts=(0, 2, 16, 24, 32)), _options(tmp_path, costs(5e8)))
    # a fast link: nothing delayed, and the stages are then ordinary (no gradient buffer)
    resolved = _resolved(_model(), _options(tmp_path, costs(1e15)))
    assert resolved.deferral.stages == {} and resolved.compiled.deferred_stages() == []


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_simulate_deferred_layers(tmp_path, capsys):
    from hippie_ds.cli import main

    path = tmp_path / "costs.json"
    path.write_text(costs(5e8).model_dump_json(exclude_none=True))
    common = [
        "schedule",
        "simulate",
        "hippie",
        "-K",
        "4",
        "-M",
        "8",
        "--costs",
        str(path),
        "--param",
        "deferred_stages=0,1",
    ]
    assert main(common + ["--deferred-layers", "auto", "--staleness-price", "0"]) == 0
    out = capsys.readouterr().out
    picks = chosen(5e8, staleness_price=0.0)
    assert f"deferred_layers auto, stage 0: delays {picks[0]} of 8 layers" in out and "staleness_price 0" in out
    assert main(common + ["--deferred-layers", "2", "--staleness-price", "0"]) == 2
    assert "--staleness-price 0.0: it prices only --deferred-layers auto" in capsys.readouterr().err
    assert main(common + ["--deferred-layers", "2"]) == 0
    assert main(common + ["--deferred-layers", "some"]) == 2
    assert "'some': allowed untied, auto, all or a layer count" in capsys.readouterr().err
    path.write_text(costs(5e8, per_layer=False).model_dump_json(exclude_none=True))
    assert main(common[:-2] + ["--deferred-layers", "auto", "--param", "deferred_stages=0"]) != 0
    assert "stage(s) [0]: no per-layer costs" in capsys.readouterr().err


def test_cli_simulate_default_is_the_configs(tmp_path, capsys):
    """`schedule simulate` defaults to hippie.deferred_layers' default ("untied": here the first
    layer, every listed layer holding parameters); 0 makes a stage an ordinary one; a stage
    without per-layer costs counts as one layer, so the default delays it whole."""
    import json

    from hippie_ds.cli import main
    from hippie_ds.config import DEFAULT_DEFERRED_LAYERS

    path = tmp_path / "costs.json"
    path.write_text(costs(5e8).model_dump_json(exclude_none=True))
    common = [
        "schedule",
        "simulate",
        "hippie",
        "-K",
        "4",
        "-M",
        "8",
        "--costs",
        str(path),
        "--param",
        "deferred_stages=0,1",
        "--json",
    ]

    def step(*extra):
        assert main(common + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["step_time"]

    assert step() == step("--deferred-layers", DEFAULT_DEFERRED_LAYERS) == step("--deferred-layers", "1")
    assert step() != step("--deferred-layers", "all")
    assert step("--deferred-layers", "0") == step("--param", "deferred_stages=none") != step()
    path.write_text(costs(5e8, per_layer=False).model_dump_json(exclude_none=True))
    assert step() == step("--deferred-layers", "all")
