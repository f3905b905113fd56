"""The planner asks the schedule: every one-part built-in is plannable through its traits (asynchronous
ones too), deep pipelines extrapolate by distance from the last stage, zb-h1 chosen where the bubble
dominates, the split backward's estimate, deferred layers and the priced staleness in hippie plans."""

import math

import pytest

from hippie_ds.planner import PlannerError, Profile, make_plan, parse_cluster, synthetic_profile
from hippie_ds.schedules import available, load_spec
from planner_fixtures import V100_CLUSTER, need_profiles


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

    layers = [
        LayerProfile(
            name=f"l{i}",
            forward=1e-3,
            backward=2e-3,
            backward_weight=1e-3,
            output_bytes=1e9 if i >= 23 else 1e7,
            saved_bytes=2e9 if i >= 23 else 2e7,
            param_bytes=1e8,
        )
        for i in range(32)
    ]
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
                sim = evaluate.simulate_configuration(model, lay, b, M, "zb-h1", ks, deferred, auto_limit=10**9)
                assert step <= sim.step * (1 + 1e-9) and step == pytest.approx(sim.step, rel=0.25), (spec, K, ks)


@need_profiles
def test_hippie_plan_states_its_deferred_layers(vgg):
    """A plan with deferred stages carries the engine's "auto" choice of delayed layers (the same
    function, schedules.deferral.auto_layers) into the config it sets and its summary."""
    plan = make_plan(vgg, parse_cluster("4x4,16GB,10Gbit"), 2048, schedules=["hippie"], depths=[2], baselines=False)
    deferred = [st for st in plan.stages if st.deferred]
    assert deferred and plan.prediction.predicted_by == "simulator"
    for st in deferred:
        assert 1 <= st.deferred_layers <= st.end_layer - st.first_layer and 0 < st.delayed_share <= 1
    assert plan.deepspeed_config()["hippie"]["deferred_layers"] == {
        str(st.stage): st.deferred_layers for st in deferred
    }
    assert f"layers, {deferred[0].delayed_share:.0%}" in plan.summary()


@need_profiles
def test_plan_prices_staleness_and_records_the_price(vgg):
    """The time-to-loss plan's deferred layers come from the engine's "auto" rule at the given
    ``staleness_price``: priced at 0 it delays more of the gradient for a shorter step than at the
    default 0.5, and a high price delays less; the plan records the price it used and its source."""
    from hippie_ds.planner import make_plan, parse_cluster

    cluster = parse_cluster(V100_CLUSTER)
    plans = {
        price: make_plan(
            vgg, cluster, 2048, schedules=["hippie"], baselines=False, staleness_price=price, objective="time-to-loss"
        )
        for price in (None, 0.0, 5.0)
    }
    assert all("deferred_layers_auto.md" in p.assumptions["staleness_price_source"] for p in plans.values())
    share = {price: sum(st.delayed_share * st.param_bytes for st in p.stages) for price, p in plans.items()}
    assert [p.assumptions["staleness_price"] for p in plans.values()] == [0.5, 0.0, 5.0]
    assert share[0.0] > share[None] >= share[5.0]
    for price, p in plans.items():  # the factor the plan was ranked with: 1 + price x stale share of the model
        stale = share[price] / sum(st.param_bytes for st in p.stages)
        assert p.prediction.steps_factor == pytest.approx(1 + p.assumptions["staleness_price"] * stale)
    assert plans[None].prediction.steps_factor > 1.0
    assert plans[0.0].prediction.step_time <= plans[None].prediction.step_time


def test_planner_ranks_candidates_at_their_priced_step(vgg):
    """The time-to-loss objective ranks its simulated candidates at the step priced for staleness,
    step x (1 + staleness_price x stale share), each with its own priced choice of deferred layers.
    On VGG-16 this changes the winner: ranked at the whole-stage step, a candidate that is fast only
    while whole stages are stale would win and then keep only part of its delay."""
    from hippie_ds.planner import plan as planner
    from hippie_ds.planner.evaluate import deferred_layers, simulate_configuration
    from hippie_ds.planner.model import _Model
    from hippie_ds.planner.objectives import score
    from hippie_ds.planner.plan_file import DEFAULT_STATE_FACTOR, SCHEDULES

    cluster = parse_cluster(V100_CLUSTER)
    chosen = make_plan(vgg, cluster, 2048, baselines=False, objective="time-to-loss")
    model = _Model(vgg, cluster, 2048, DEFAULT_STATE_FACTOR, "mean", cluster.device_memory)
    found = planner._search(model, SCHEDULES, "time-to-loss", None, None, max(1, vgg.batch_size // 16), keep=4)
    priced, whole_stage = [], []
    for cand in found.best:
        est = simulate_configuration(
            model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, cand.est.deferred, auto_limit=4096
        )
        whole_stage.append((score("time-to-loss", *model.figures(est.step, est.memory)), cand))
        est, _ = deferred_layers(model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, est, 0.5, "time-to-loss")
        priced.append((score("time-to-loss", *model.figures(est.step, est.memory), est.steps_factor), cand))
    best = max(priced, key=lambda x: x[0])[1]
    assert (chosen.schedule, chosen.boundaries, chosen.micro_batches) == (best.schedule, list(best.lay.parts), best.M)
    assert max(whole_stage, key=lambda x: x[0])[1] is not best  # the ranking the price changed
