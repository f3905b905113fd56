"""The planner (hippie_ds.planner): plans and their file format, the search and its objectives, what
the planner asks a schedule, zero-bubble estimates, the CLI. Pure Python. Its inputs: test_planner_inputs.py."""

import json

import pytest

from hippie_ds.planner import (
    Cluster,
    PlanMismatchError,
    PlannerError,
    load_plan,
    make_plan,
    parse_cluster,
    save_plan,
    save_profile,
    synthetic_profile,
)
from hippie_ds.planner import partition as part
from cli_run import run
from planner_fixtures import PROFILES, V100_CLUSTER, need_profiles


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
    # The search's stages use the optimal bottleneck partition; the cut then climbs only where the
    # simulator ranks a neighbour higher, so the balanced cut, planned as it is, is never ahead.
    work = [x.forward + x.backward for x in vgg.layers]
    balanced = part.min_bottleneck(work, plan.pipeline_depth)[0]
    if plan.search["cut_moves"] == 0:
        assert max(part.stage_sums(work, plan.boundaries)) == pytest.approx(
            part.min_bottleneck(work, plan.pipeline_depth)[1]
        )
    else:
        from hippie_ds.planner import make_plan, parse_cluster
        from planner_fixtures import V100_CLUSTER

        fixed = make_plan(
            vgg,
            parse_cluster(V100_CLUSTER),
            2048,
            schedules=[plan.schedule],
            depths=[plan.pipeline_depth],
            micro_batch_sizes=[plan.micro_batch_size],
            boundaries=balanced,
            baselines=False,
            candidates=0,
        )
        assert fixed.prediction.objective_value <= plan.prediction.objective_value * (1 + 1e-9)
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
    from hippie_ds.planner.sim_costs import _costs

    costs = _costs(model, lay, vgg_plan.micro_batch_size, ks)
    compiled = compile_schedule(
        vgg_plan.schedule, vgg_plan.pipeline_depth, vgg_plan.micro_batches, **vgg_plan.schedule_params
    )
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
            sim = evaluate.simulate_configuration(model, lay, b, M, schedule, ks, deferred, auto_limit=10**9)
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
    loose = make_plan(
        profile,
        cluster,
        64,
        objective="throughput",
        depths=[4],
        micro_batch_sizes=[16],
        schedules=["gpipe"],
        baselines=False,
    )
    tight_cap = loose.prediction.memory_max * 0.5
    tight = make_plan(
        profile,
        cluster,
        64,
        objective="throughput",
        depths=[4],
        micro_batch_sizes=[16],
        schedules=["gpipe"],
        memory_cap=tight_cap,
        baselines=False,
    )
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
    cluster = Cluster(
        nodes=64, devices_per_node=16, device_memory=80e9, inter_node_bandwidth=25e9, intra_node_bandwidth=300e9
    )
    plan = make_plan(profile, cluster, 8192)
    assert plan.world_size == 1024 and plan.prediction.fits
    assert any(b.skipped for b in plan.baselines)  # the O(N^2 K) baselines are too large here


# ---------------------------------------------------------------------------------------------
# Command line


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
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        out_file,
        "--cluster",
        V100_CLUSTER,
        "--global-batch",
        512,
        "--schedules",
        "1f1b,hippie",
        "--out",
        plan_file,
    )
    assert code == 0, err
    assert "plan for gnmt" in out and "dp" in out and f"wrote {plan_file}" in out
    plan = load_plan(plan_file)
    assert plan.schedule in ("1f1b", "hippie") and plan.model == "gnmt"
    code, out, _ = run(
        capsys,
        "plan",
        "--profile",
        PROFILES / "gnmt.txt",
        "--cluster",
        V100_CLUSTER,
        "--global-batch",
        512,
        "--no-baselines",
        "--json",
        "--objective",
        "throughput",
        "--memory-cap",
        "8GB",
        "--staleness-price",
        "0",
    )
    assert code == 0 and json.loads(out)["memory_cap"] == 8e9
    assert json.loads(out)["assumptions"]["staleness_price"] == 0.0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cluster", "4x4"], "missing device memory"),
        (["--schedules", "zb"], "--schedules 'zb'"),
        (["--memory-cap", "lots"], "--memory-cap 'lots'"),
        (["--stages", "3"], "do(es) not divide"),
        (["--cluster", "1x1,1MB,1Gbit"], "does not fit"),
        (["--staleness-price", "-1"], "--staleness-price -1.0: must be a number >= 0"),
    ],
)
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
    code, _, err = run(
        capsys, "plan", "--profile", tmp_path / "nope.txt", "--cluster", V100_CLUSTER, "--global-batch", 16
    )
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
