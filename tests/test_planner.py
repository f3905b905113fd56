"""The planner (hippie_ds.planner): plans and their file format, the search and its objectives, what
the planner asks a schedule, zero-bubble estimates, the CLI. Pure Python. Its inputs: test_planner_inputs.py."""
import json
import math

import pytest

from hippie_ds.cli import main
from hippie_ds.planner import (Cluster, PlanMismatchError, PlannerError, Profile, load_plan, make_plan, parse_cluster,
                               save_plan, save_profile, synthetic_profile)
from hippie_ds.planner import partition as part
from hippie_ds.schedules import available, load_spec
from planner_fixtures import PROFILES, V100_CLUSTER  # noqa: F401


def need_profiles(test):  # kept as a marker of which tests read the real profiles
    return test


# ---------------------------------------------------------------------------------------------
# Plans

@need_profiles
def test_vgg_plan_on_16_v100s(vgg_plan, vgg):
    plan = vgg_plan
    assert plan.world_size == 16 and plan.pipeline_depth * plan.data_parallel == 16
    assert plan.micro_batch_size * plan.micro_batches * plan.data_parallel == 2048
    assert plan.prediction.fits and plan.prediction.memory_max <= 16e9
    assert plan.prediction.predicted_by == "simulator"
    names = [b.name for b in plan.baselines]
    assert names == ["dp", "gpipe+dp", "uniform", "parameters", "pipedream"] or plan.pipeline_depth == 1
    dp = plan.baselines[0].prediction
    assert plan.prediction.me > dp.me  # the point of the exercise
    # The plan's stages use the optimal bottleneck partition.
    work = [x.forward + x.backward for x in vgg.layers]
    assert max(part.stage_sums(work, plan.boundaries)) == pytest.approx(
        part.min_bottleneck(work, plan.pipeline_depth)[1])
    summary = plan.summary()
    assert "plan for vgg16" in summary and "gpipe+dp" in summary and "ME =" in summary


@need_profiles
def test_plan_round_trips(tmp_path, vgg_plan):
    for suffix in (".json", ".yaml"):
        path = tmp_path / f"plan{suffix}"
        save_plan(vgg_plan, path)
        assert load_plan(path) == vgg_plan
    cfg = vgg_plan.deepspeed_config()
    assert cfg["train_batch_size"] == 2048 and cfg["pipeline"]["schedule"] == vgg_plan.schedule
    assert cfg["gradient_accumulation_steps"] == vgg_plan.micro_batches


@need_profiles
def test_plan_for_another_model_is_detected(vgg_plan, vgg, gnmt):
    vgg_plan.check_matches(vgg, world_size=16)
    with pytest.raises(PlanMismatchError, match="41 layers; this model has 48"):
        vgg_plan.check_matches(gnmt)
    renamed = vgg.model_copy(update={"layers": [vgg.layers[0].model_copy(update={"name": "other"})] + vgg.layers[1:]})
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        vgg_plan.check_matches(renamed)
    with pytest.raises(PlanMismatchError, match="for 16 devices"):
        vgg_plan.check_matches(vgg, world_size=8)


@need_profiles
def test_tampered_plan_is_rejected(tmp_path, vgg_plan):
    data = vgg_plan.model_dump(mode="json")
    data["boundaries"] = list(reversed(data["boundaries"]))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match="bad.json: field.*boundaries"):
        load_plan(path)
    data = vgg_plan.model_dump(mode="json")
    data["data_parallel"] += 1
    path.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match="world_size"):
        load_plan(path)


@need_profiles
def test_plan_memory_agrees_with_the_simulator(vgg, vgg_plan):
    """Rebuild the plan's costs and simulate: the per-stage peaks are the plan's in_flight."""
    from hippie_ds.planner import model as pl
    from hippie_ds.schedules import compile as compile_schedule
    from hippie_ds.schedules.simulator import simulate

    cluster = parse_cluster(V100_CLUSTER)
    model = pl._Model(vgg, cluster, 2048, 4.0, "mean", cluster.device_memory)
    lay = model.layout(vgg_plan.pipeline_depth, vgg_plan.boundaries)
    ks = []
    for s, st in enumerate(vgg_plan.stages):
        k = next(k for k in range(lay.rec[s].options) if lay.rec[s].layers(k) == st.checkpointed)
        ks.append(k)
    costs = pl._costs(model, lay, vgg_plan.micro_batch_size, ks)
    compiled = compile_schedule(vgg_plan.schedule, vgg_plan.pipeline_depth, vgg_plan.micro_batches,
                                **vgg_plan.schedule_params)
    delayed = {st.stage: st.deferred_layers for st in vgg_plan.stages if st.deferred}  # the plan's "auto" choice
    res = simulate(compiled, costs, iterations=3, critical_path=False, deferred_layers=delayed)
    assert [p["peak_activation_microbatches"] for p in res.per_stage] == [st.in_flight for st in vgg_plan.stages]
    assert res.step_time == pytest.approx(vgg_plan.prediction.step_time)
    assert [st.recompute for st in vgg_plan.stages] == pytest.approx([s.recompute for s in costs.stages])


def test_analytic_deferral_rule_matches_the_simulators():
    from hippie_ds.planner import evaluate, model as pl

    profile = synthetic_profile(24, seed=2, batch_size=8)
    cluster = parse_cluster("2x4,40GB,10Gbit")
    model = pl._Model(profile, cluster, 64, 4.0, "mean", cluster.device_memory)
    for K, b in ((2, 8), (4, 4), (8, 2)):
        lay = model.layout(K)
        M = 64 // (8 // K) // b
        for schedule in ("hippie", "hippie-1f1b"):
            ks = [0] * K
            step, deferred = model.step_time(lay, schedule, b / 8, M, ks)
            sim = evaluate.simulate_configuration(model, lay, b, M, schedule, ks, deferred, auto_limit=10 ** 9)
            assert sim.deferred == deferred
            assert step == pytest.approx(sim.step, rel=0.25)


def test_throughput_objective_respects_the_memory_cap():
    profile = synthetic_profile(40, seed=4, batch_size=16, act_scale=2e8)
    cluster = parse_cluster("2x4,40GB,100Gbit")
    free = make_plan(profile, cluster, 256, objective="throughput", baselines=False)
    cap = free.prediction.memory_max * 0.6
    capped = make_plan(profile, cluster, 256, objective="throughput", memory_cap=cap, baselines=False)
    assert capped.prediction.memory_max <= cap and capped.memory_cap == cap
    assert capped.prediction.throughput <= free.prediction.throughput * (1 + 1e-9)
    me = make_plan(profile, cluster, 256, baselines=False)
    assert me.prediction.me >= capped.prediction.me * (1 - 1e-9) or me.prediction.predicted_by != "simulator"


def test_recompute_is_chosen_when_memory_is_tight():
    profile = synthetic_profile(30, seed=6, batch_size=16, act_scale=5e8)
    cluster = parse_cluster("1x4,200GB,100Gbit")
    loose = make_plan(profile, cluster, 64, objective="throughput", depths=[4], micro_batch_sizes=[16],
                      schedules=["gpipe"], baselines=False)
    tight_cap = loose.prediction.memory_max * 0.5
    tight = make_plan(profile, cluster, 64, objective="throughput", depths=[4], micro_batch_sizes=[16],
                      schedules=["gpipe"], memory_cap=tight_cap, baselines=False)
    assert not loose.checkpointed_layers and tight.checkpointed_layers
    assert tight.prediction.memory_max <= tight_cap
    assert tight.prediction.step_time >= loose.prediction.step_time


def test_a_cluster_that_cannot_fit_the_model():
    profile = synthetic_profile(20, seed=1)
    with pytest.raises(PlannerError, match="does not fit.*least any configuration needs is"):
        make_plan(profile, parse_cluster("1x2,100MB,10Gbit"), 16)


def test_bad_plan_requests():
    profile = synthetic_profile(6, seed=1)
    cluster = parse_cluster("2x4,80GB,100Gbit")
    with pytest.raises(PlannerError, match="cannot be split over 8 devices"):
        make_plan(profile, cluster, 3)
    with pytest.raises(PlannerError, match="objective"):
        make_plan(profile, cluster, 64, objective="speed")
    with pytest.raises(PlannerError, match="schedule"):
        make_plan(profile, cluster, 64, schedules=["no-such-schedule"])


def test_large_instance_plans():
    """The benchmark's shape (`tools/bench.py planner` reports the time; not timed here)."""
    profile = synthetic_profile(1000, seed=1)
    cluster = Cluster(nodes=64, devices_per_node=16, device_memory=80e9, inter_node_bandwidth=25e9,
                      intra_node_bandwidth=300e9)
    plan = make_plan(profile, cluster, 8192)
    assert plan.world_size == 1024 and plan.prediction.fits
    assert any(b.skipped for b in plan.baselines)  # the O(N^2 K) baselines are too large here


# ---------------------------------------------------------------------------------------------
# Command line

def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [["plan", "--help"], ["profile-import", "--help"]])
def test_cli_help(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "usage: hippie-ds" in out


@need_profiles
def test_cli_plan_and_import(capsys, tmp_path):
    out_file = tmp_path / "gnmt.yaml"
    code, out, err = run(capsys, "profile-import", "--profile", PROFILES / "gnmt.txt", "--out", out_file)
    assert code == 0 and "48 layers at batch 32" in out
    plan_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--profile", out_file, "--cluster", V100_CLUSTER, "--global-batch", 512,
                         "--schedules", "1f1b,hippie", "--out", plan_file)
    assert code == 0, err
    assert "plan for gnmt" in out and "dp" in out and f"wrote {plan_file}" in out
    plan = load_plan(plan_file)
    assert plan.schedule in ("1f1b", "hippie") and plan.model == "gnmt"
    code, out, _ = run(capsys, "plan", "--profile", PROFILES / "gnmt.txt", "--cluster", V100_CLUSTER,
                       "--global-batch", 512, "--no-baselines", "--json", "--objective", "throughput",
                       "--memory-cap", "8GB", "--staleness-price", "0")
    assert code == 0 and json.loads(out)["memory_cap"] == 8e9
    assert json.loads(out)["assumptions"]["staleness_price"] == 0.0


@pytest.mark.parametrize("extra, message", [
    (["--cluster", "4x4"], "missing device memory"),
    (["--schedules", "zb"], "--schedules 'zb'"),
    (["--memory-cap", "lots"], "--memory-cap 'lots'"),
    (["--stages", "3"], "do(es) not divide"),
    (["--cluster", "1x1,1MB,1Gbit"], "does not fit"),
    (["--staleness-price", "-1"], "--staleness-price -1.0: must be a number >= 0"),
])
def test_cli_plan_errors(capsys, tmp_path, extra, message):
    profile = tmp_path / "p.yaml"
    save_profile(synthetic_profile(8, seed=1), profile)
    argv = ["plan", "--profile", profile, "--cluster", "2x2,8GB,10Gbit", "--global-batch", 16]
    # later options win in argparse
    code, out, err = run(capsys, *argv, *extra)
    assert code == 2 and out == ""
    assert err.startswith("hippie-ds: error:") and message in err


def test_cli_bad_profile(capsys, tmp_path):
    bad = tmp_path / "vgg16.txt"
    bad.write_text("node1 -- Conv\n")
    code, _, err = run(capsys, "plan", "--profile", bad, "--cluster", V100_CLUSTER, "--global-batch", 16)
    assert code == 2 and f"{bad}:1" in err
    code, _, err = run(capsys, "plan", "--profile", tmp_path / "nope.txt", "--cluster", V100_CLUSTER,
                       "--global-batch", 16)
    assert code == 2 and "no such file" in err


def test_objective_registry():
    """A registered objective is plannable by name and changes the choice: least memory per
    device picks a configuration holding no more than the throughput plan's; unknown names
    are refused with the registered ones listed."""
    from hippie_ds.planner import OBJECTIVES, register_objective
    profile = synthetic_profile(24, seed=2, batch_size=8)
    cluster = parse_cluster("2x4,16GB,10Gbit")
    register_objective("least-memory", lambda f: -f.memory)
    try:
        fast = make_plan(profile, cluster, 256, objective="throughput", baselines=False)
        lean = make_plan(profile, cluster, 256, objective="least-memory", baselines=False)
        assert lean.objective == "least-memory"
        assert lean.prediction.memory <= fast.prediction.memory
        assert lean.prediction.throughput <= fast.prediction.throughput * (1 + 1e-9)
        assert (lean.prediction.memory, lean.pipeline_depth) != (fast.prediction.memory, fast.pipeline_depth)
        with pytest.raises(PlannerError, match="objective 'fastest': expected one of .*least-memory"):
            make_plan(profile, cluster, 256, objective="fastest")
    finally:
        OBJECTIVES.pop("least-memory")


ONE_PART = [n for n in available() if load_spec(n).virtual_stages is None]  # virtual ones: test_planner_virtual.py


@pytest.mark.parametrize("name", ONE_PART)
def test_the_planner_asks_the_schedule(name):
    """Traits come from the compiled schedule: the named rules they replace (1F1B and GPipe
    in-flight counts, hippie's fused last stage, 2bw's two weight versions) and, above the probe
    size, the linear extrapolation equals a full compile."""
    from hippie_ds.planner.traits import _compiled_traits, schedule_traits
    for K in (2, 4):
        for M in (K, 2 * K + 5, 2 * K + 9):
            t = schedule_traits(name, K, M)
            assert t == _compiled_traits(name, K, M), (K, M)
            if name in ("1f1b", "hippie-1f1b", "2bw", "pipedream"):
                assert list(t.in_flight) == [min(K - s, M) for s in range(K)]
            elif name == "gpipe":
                assert list(t.in_flight) == [M] * K
            elif name == "hippie":
                assert list(t.in_flight) == [M] * (K - 1) + [1]
            elif name in ("zb-h1", "hippie-zb"):  # stage s postpones s W's: K micro-batches in flight everywhere
                assert list(t.in_flight) == [K] * K
            assert t.defers == (name in ("hippie", "hippie-1f1b", "hippie-zb"))
            assert t.late_update == (name not in ("1f1b", "gpipe", "zb-h1"))
            assert t.weight_versions == ((2,) * K if name == "2bw" else t.weight_versions)


def test_asynchronous_schedules_are_plannable():
    """2bw and pipedream plan like any other schedule: their extra weight versions count in memory."""
    profile = synthetic_profile(24, seed=2, batch_size=8)
    cluster = parse_cluster("2x4,16GB,10Gbit")
    flush = make_plan(profile, cluster, 256, schedules=["1f1b"], depths=[4], micro_batch_sizes=[8], baselines=False)
    twobw = make_plan(profile, cluster, 256, schedules=["2bw"], depths=[4], micro_batch_sizes=[8], baselines=False)
    assert twobw.schedule == "2bw" and twobw.pipeline_depth == 4
    assert [s.in_flight for s in twobw.stages] == [s.in_flight for s in flush.stages]
    # same layout and activations, plus one weight-sized copy per stage for the second version
    if twobw.boundaries == flush.boundaries and twobw.checkpointed_layers == flush.checkpointed_layers:
        assert twobw.prediction.memory > flush.prediction.memory
    pipedream = make_plan(profile, cluster, 256, schedules=["pipedream"], depths=[4], baselines=False)
    assert pipedream.schedule == "pipedream"
    with pytest.raises(PlannerError, match="schedule 'zb': .*built-in: 1f1b"):
        make_plan(profile, cluster, 256, schedules=["zb"])


@pytest.mark.parametrize("name", ONE_PART)
def test_deep_pipelines_extrapolate_by_distance_from_the_last_stage(name, monkeypatch):
    from hippie_ds.planner import traits
    monkeypatch.setattr(traits, "DEPTH_PROBE", 6)
    traits.schedule_traits.cache_clear()
    try:
        for K, M in ((9, 9), (10, 12), (10, 30)):
            assert traits.schedule_traits(name, K, M) == traits._compiled_traits(name, K, M), (K, M)
    finally:
        traits.schedule_traits.cache_clear()


# ---------------------------------------------------------------------------------------------
# Split backward (zero-bubble: zb-h1)

def _head_heavy_profile():
    """Equal layers, W half the backward; the last layers' activations are large, so a schedule
    holding K micro-batches on the last stages (zb-h1) needs far more memory there than 1F1B's."""
    from hippie_ds.planner import LayerProfile
    layers = [LayerProfile(name=f"l{i}", forward=1e-3, backward=2e-3, backward_weight=1e-3,
                           output_bytes=1e9 if i >= 23 else 1e7, saved_bytes=2e9 if i >= 23 else 2e7, param_bytes=1e8)
              for i in range(32)]
    return Profile(model="head-heavy", batch_size=8, layers=layers)


def test_zb_h1_is_chosen_when_the_bubble_dominates_and_memory_is_plentiful():
    profile, cluster = _head_heavy_profile(), parse_cluster("1x8,80GB,100Gbit,2400Gbit")
    kw = dict(objective="throughput", baselines=False, depths=[8], micro_batch_sizes=[8])  # M = K: bubble 7/15
    plan = make_plan(profile, cluster, 64, **kw)
    assert plan.schedule == "zb-h1" and plan.prediction.predicted_by == "simulator"
    assert [s.in_flight for s in plan.stages] == [8] * 8
    one = make_plan(profile, cluster, 64, schedules=["1f1b"], **kw)
    assert plan.prediction.step_time < 0.8 * one.prediction.step_time
    # too little memory for K micro-batches on the last stages: not even full re-computation fits
    with pytest.raises(PlannerError, match="does not fit"):
        make_plan(profile, cluster, 64, schedules=["zb-h1"], memory_cap=one.prediction.memory_max, **kw)
    tight = make_plan(profile, cluster, 64, memory_cap=one.prediction.memory_max, **kw)
    assert tight.schedule != "zb-h1" and tight.prediction.memory_max <= one.prediction.memory_max


def test_split_backward_estimate_is_a_lower_bound_close_to_the_simulator():
    """The analytic zb-h1 step time never exceeds the simulated one (the pruning bound is safe)
    and is within the tolerance of the deferral rule's check; with equal stages it is ZB-H1's
    M (F+I+W) + (K-1) max(F, I, F+I-W) (the paper's (K-1)(F+I-W) bubble when W <= I)."""
    from hippie_ds.planner import evaluate, model as pl
    from hippie_ds.planner.split_bounds import split_backward_time
    from hippie_ds.planner.traits import schedule_traits
    from hippie_ds.schedules import compile as compile_schedule
    from hippie_ds.schedules.costs import CommCost, Costs, StageCost
    from hippie_ds.schedules.simulator import simulate

    free = CommCost(p2p_bandwidth=math.inf, allreduce_bandwidth=math.inf)
    for K, M in ((4, 4), (4, 9), (6, 12)):
        p = schedule_traits("zb-h1", K, M).in_flight
        for F, I, W in ((1, 1, 1), (1, 1.5, 0.5), (1, 0.5, 1.5), (0.5, 2, 1), (1, 1, 0)):
            costs = Costs(stages=[StageCost(forward=F, backward=I + W, backward_weight=W)] * K, comm=free)
            sim = simulate(compile_schedule("zb-h1", K, M), costs, iterations=1, critical_path=False).step_time
            paper = M * (F + I + W) + (K - 1) * max(F, I, F + I - W)
            assert split_backward_time([F] * K, [I] * K, [W] * K, [0.0] * K, M, p) == pytest.approx(paper)
            assert sim == pytest.approx(paper), (K, M, F, I, W)

    profile = synthetic_profile(24, seed=2, batch_size=8)
    for spec in ("2x4,40GB,10Gbit", "2x4,40GB,100Gbit"):
        cluster = parse_cluster(spec)
        model = pl._Model(profile, cluster, 64, 4.0, "mean", cluster.device_memory)
        for K, b in ((2, 8), (4, 4), (8, 2)):
            lay = model.layout(K)
            M = 64 // (8 // K) // b
            for ks in ([0] * K, [lay.rec[s].options - 1 for s in range(K)]):
                step, deferred = model.step_time(lay, "zb-h1", b / 8, M, ks)
                sim = evaluate.simulate_configuration(model, lay, b, M, "zb-h1", ks, deferred, auto_limit=10 ** 9)
                assert step <= sim.step * (1 + 1e-9) and step == pytest.approx(sim.step, rel=0.25), (spec, K, ks)


@need_profiles
def test_hippie_plan_states_its_deferred_layers(vgg):
    """A plan with deferred stages carries the engine's "auto" choice of delayed layers (the same
    function, schedules.partial_deferral) into the config it sets and its summary."""
    plan = make_plan(vgg, parse_cluster("4x4,16GB,10Gbit"), 2048, schedules=["hippie"], depths=[2], baselines=False)
    deferred = [st for st in plan.stages if st.deferred]
    assert deferred and plan.prediction.predicted_by == "simulator"
    for st in deferred:
        assert 1 <= st.deferred_layers <= st.end_layer - st.first_layer and 0 < st.delayed_share <= 1
    assert plan.deepspeed_config()["hippie"]["deferred_layers"] == {str(st.stage): st.deferred_layers
                                                                    for st in deferred}
    assert f"layers, {deferred[0].delayed_share:.0%}" in plan.summary()


@need_profiles
def test_plan_prices_staleness_and_records_the_price(vgg):
    """The plan's deferred layers come from the engine's "auto" rule at the given
    ``staleness_price``: priced at 0 it delays more of the gradient for a shorter step than at the
    default 0.5, and a high price delays less; the plan records the price it used."""
    from hippie_ds.planner import make_plan, parse_cluster
    cluster = parse_cluster(V100_CLUSTER)
    plans = {price: make_plan(vgg, cluster, 2048, schedules=["hippie"], baselines=False, staleness_price=price)
             for price in (None, 0.0, 5.0)}
    share = {price: sum(st.delayed_share * st.param_bytes for st in p.stages) for price, p in plans.items()}
    assert [p.assumptions["staleness_price"] for p in plans.values()] == [0.5, 0.0, 5.0]
    assert share[0.0] > share[None] >= share[5.0]
    for price, p in plans.items():  # the factor the plan was ranked with: 1 + price x stale share of the model
        stale = share[price] / sum(st.param_bytes for st in p.stages)
        assert p.prediction.steps_factor == pytest.approx(1 + p.assumptions["staleness_price"] * stale)
    assert plans[None].prediction.steps_factor > 1.0
    assert plans[0.0].prediction.step_time < plans[None].prediction.step_time


def test_planner_ranks_candidates_at_their_priced_step(vgg):
    """The planner ranks its simulated candidates at the step priced for staleness, step x (1 +
    staleness_price x stale share), each with its own priced choice of deferred layers. On VGG-16
    this changes the winner: ranked at the whole-stage step (as before), a candidate that is fast
    only while whole stages are stale would win and then keep only part of its delay."""
    from hippie_ds.planner import plan as planner
    from hippie_ds.planner.evaluate import deferred_layers, simulate_configuration
    from hippie_ds.planner.model import _Model
    from hippie_ds.planner.objectives import score
    from hippie_ds.planner.plan_file import DEFAULT_STATE_FACTOR, SCHEDULES
    cluster = parse_cluster(V100_CLUSTER)
    chosen = make_plan(vgg, cluster, 2048, baselines=False)
    model = _Model(vgg, cluster, 2048, DEFAULT_STATE_FACTOR, "mean", cluster.device_memory)
    found = planner._search(model, SCHEDULES, "me", None, None, max(1, vgg.batch_size // 16), keep=4)
    priced, whole_stage = [], []
    for cand in found.best:
        est = simulate_configuration(model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, cand.est.deferred,
                                     auto_limit=4096)
        whole_stage.append((score("me", *model.figures(est.step, est.memory)), cand))
        est, _ = deferred_layers(model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, est, 0.5)
        priced.append((score("me", *model.figures(est.step * est.steps_factor, est.memory)), cand))
    best = max(priced, key=lambda x: x[0])[1]
    assert (chosen.schedule, chosen.boundaries, chosen.micro_batches) == (best.schedule, list(best.lay.parts), best.M)
    assert max(whole_stage, key=lambda x: x[0])[1] is not best  # the ranking the price changed
