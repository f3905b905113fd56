"""The planner (hippie_ds.planner): profiles, clusters, partitions and their baselines, PipeDream's
DP and reference plans, re-computation, plans and their file format, the CLI. Pure Python except
the DeepSpeed cross-checks of the partition baselines."""
import itertools
import json
import math
import random
from pathlib import Path

import pytest

from hippie_ds.cli import main
from hippie_ds.planner import (Cluster, ClusterError, Plan, PlanMismatchError, PlannerError, Profile, ProfileError,
                               load_plan, load_profile, make_plan, parse_cluster, read_pipedream, save_plan,
                               save_profile, synthetic_profile)
from hippie_ds.planner import partition as part
from hippie_ds.schedules import available
from hippie_ds.planner.pipedream import antichain_states, pipedream_optimizer
from hippie_ds.planner.pipedream_profile import parse_pipedream_graph
from hippie_ds.planner.recompute import StageRecompute, activations_of

PROFILES = Path(__file__).resolve().parent / "data" / "pipedream"  # vendored PipeDream profiles (MIT)


def need_profiles(test):  # kept as a marker of which tests read the real profiles
    return test
V100_CLUSTER = "4x4,16GB,100Gbit"   # 4 nodes x 4 V100 16 GB, 12.5e9 B/s between nodes, 100 GB/s inside


@pytest.fixture(scope="module")
def vgg():
    return read_pipedream(PROFILES / "vgg16.txt")


@pytest.fixture(scope="module")
def gnmt():
    return read_pipedream(PROFILES / "gnmt.txt")


@pytest.fixture(scope="module")
def vgg_plan(vgg):
    return make_plan(vgg, parse_cluster(V100_CLUSTER), 2048)


# ---------------------------------------------------------------------------------------------
# Profiles

@need_profiles
@pytest.mark.parametrize("name, layers, batch, total_ms", [("vgg16", 41, 128, 672.535), ("gnmt", 48, 32, 89.416),
                                                          ("gnmt_large", 96, 128, 520.453)])
def test_read_pipedream(name, layers, batch, total_ms):
    profile = read_pipedream(PROFILES / f"{name}.txt")
    assert profile.num_layers == layers and profile.batch_size == batch and profile.model == name
    # Input nodes' data-loading time is zero, times are seconds: the total is PipeDream's single-GPU time.
    assert profile.total_time() * 1e3 == pytest.approx(total_ms, abs=1e-6)
    assert all(layer.forward == 0 for layer in profile.layers if ":Input" in layer.name)
    assert len(profile.cuts()) == layers - 1


@need_profiles
@pytest.mark.parametrize("name", ["vgg16", "gnmt", "gnmt_large"])
def test_cut_bytes_count_every_crossing_tensor(name):
    path = PROFILES / f"{name}.txt"
    graph = parse_pipedream_graph(path)
    profile = read_pipedream(path)
    order = [layer.name.split(":")[0] for layer in profile.layers]
    pos = {node: i for i, node in enumerate(order)}
    # Topological: every edge goes forward.
    assert all(pos[a] < pos[b] for a, b in graph.edges)
    act = {n.node_id: n.activation for n in graph.nodes}
    for i in range(len(order) - 1):
        crossing = {a for a, b in graph.edges if pos[a] <= i < pos[b]}
        assert profile.cuts()[i] == pytest.approx(sum(act[a] for a in crossing), rel=1e-12, abs=1e-6)


@need_profiles
def test_chain_cuts_are_outputs_and_branches_add_up(vgg, gnmt):
    # VGG-16 is a chain except for MaxPool -> Size / View: one cut also carries the pool output.
    differ = [i for i, (c, layer) in enumerate(zip(vgg.cuts(), vgg.layers)) if c != layer.output_bytes]
    assert len(differ) == 1 and "Size" in vgg.layers[differ[0]].name
    # GNMT's residual adds keep an earlier output alive across cuts.
    assert any(c > layer.output_bytes for c, layer in zip(gnmt.cuts(), gnmt.layers))


@need_profiles
@pytest.mark.parametrize("name, states", [("vgg16", 40), ("gnmt", 99), ("gnmt_large", 1495)])
def test_legal_cuts_match_the_profiles_readme(name, states):
    """PipeDream's antichain states = the legal cuts of profiles/README.md."""
    assert len(antichain_states(PROFILES / f"{name}.txt")[0]) == states


def test_profile_round_trip_and_fingerprint(tmp_path, gnmt):
    for suffix in (".json", ".yaml"):
        path = tmp_path / f"p{suffix}"
        save_profile(gnmt, path)
        again = load_profile(path)
        assert again == gnmt
        assert again.fingerprint() == gnmt.fingerprint()
    other = gnmt.model_copy(update={"layers": gnmt.layers[:-1] + [gnmt.layers[-1].model_copy(
        update={"param_bytes": 1.0})]})
    assert other.fingerprint() != gnmt.fingerprint()
    # Times and activations scale with the micro-batch, parameters do not; the model is the same.
    half = gnmt.scaled(16)
    assert half.total_time() == pytest.approx(gnmt.total_time() / 2)
    assert half.total_param_bytes() == gnmt.total_param_bytes() and half.fingerprint() == gnmt.fingerprint()


def test_hippie_profile_defaults(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model: m\nbatch_size: 4\nlayers:\n  - {name: a, forward: 1, backward: 2, output_bytes: 10}\n"
                    "  - {name: b, forward: 1, backward: 2, output_bytes: 20, saved_bytes: 5, recompute: 0.5}\n")
    p = load_profile(path)
    assert p.cuts() == [10] and p.inputs() == [0.0, 10]
    assert [x.saved for x in p.layers] == [10, 5] and [x.recompute_time for x in p.layers] == [1, 0.5]


@pytest.mark.parametrize("text, message", [
    ("node1 -- Conv -- forward_compute_time=1.0\n", "missing backward_compute_time"),
    ("node1 -- Conv\n", "expected 'nodeN -- description"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=x, parameter_size=0\n",
     "activation_size='x' is not a number"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
     "\tnode1 -- node2\n", "unknown node node2"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
     "node2 -- B -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
     "\tnode1 -- node2\n\tnode2 -- node1\n", "cycle"),
    ("", "no nodes"),
])
def test_bad_pipedream_profiles(tmp_path, text, message):
    path = tmp_path / "vgg16.txt"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as info:
        read_pipedream(path)
    assert str(path) in str(info.value)


def test_bad_profiles_name_file_and_field(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"model": "m", "batch_size": 1, "layers": [{"name": "a", "forward": -1,
                                                                           "backward": 1}]}))
    with pytest.raises(ProfileError, match=r"m\.json: field layers\.0\.forward"):
        load_profile(path)
    path.write_text(json.dumps({"model": "m", "batch_size": 1, "cut_bytes": [1, 2],
                                "layers": [{"name": "a", "forward": 1, "backward": 1}]}))
    with pytest.raises(ProfileError, match="cut_bytes has 2 entries; a profile of 1 layers has 0 cuts"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "missing.yaml")
    unknown = tmp_path / "mynet.txt"
    unknown.write_text("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
                       "parameter_size=0\n")
    with pytest.raises(ProfileError, match="--profile-batch"):
        read_pipedream(unknown)
    assert read_pipedream(unknown, batch_size=8).batch_size == 8


# ---------------------------------------------------------------------------------------------
# Clusters

def test_parse_cluster(tmp_path):
    c = parse_cluster(V100_CLUSTER)
    assert (c.nodes, c.devices_per_node, c.devices) == (4, 4, 16)
    assert c.device_memory == 16e9 and c.inter_node_bandwidth == 12.5e9 and c.intra_node_bandwidth == 100e9
    c = parse_cluster("2x8,mem=80GiB,inter=25GB/s,intra=450GB/s,latency=5us")
    assert c.device_memory == 80 * 2 ** 30 and c.inter_node_bandwidth == 25e9 and c.latency == pytest.approx(5e-6)
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ndevices_per_node: 4\ndevice_memory: 32GB\ninter_node_bandwidth: 100Gbit\n")
    assert parse_cluster(str(path)) == Cluster(nodes=2, devices_per_node=4, device_memory=32e9,
                                               inter_node_bandwidth=12.5e9)


@pytest.mark.parametrize("spec, message", [("4x4", "missing device memory"), ("16GB", "must start with NODESxDEVICES"),
                                           ("4x4,16GB,100", "cannot tell what '100' is"),
                                           ("4x4,16GB,1Gbit,foo=2", "unknown key 'foo'"),
                                           ("0x4,16GB,1Gbit", "nodes"), ("4x4,16GB,fastGbit", "cannot tell")])
def test_bad_clusters(spec, message):
    with pytest.raises(ClusterError, match=message):
        parse_cluster(spec)


# ---------------------------------------------------------------------------------------------
# Partitions

def _instances(count, seed=0, max_n=9):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, max_n)
        kind = rng.random()
        if kind < 0.3:
            w = [rng.randint(0, 4) for _ in range(n)]  # ties and zeros
        else:
            w = [rng.uniform(0, 10) for _ in range(n)]
        yield w, rng.randint(1, n)


def test_min_bottleneck_is_optimal_against_brute_force():
    for w, k in _instances(400):
        parts, value = part.min_bottleneck(w, k)
        part.check_parts(parts, len(w), k)
        assert value == max(part.stage_sums(w, parts)) or math.isclose(value, max(part.stage_sums(w, parts)))
        assert value == pytest.approx(part.brute_force(w, k)[1], rel=1e-12, abs=1e-12)


def test_min_bottleneck_scales():
    w = [x.forward + x.backward for x in synthetic_profile(1000, seed=3).layers]
    for k in (1, 2, 7, 64, 1000):
        parts, value = part.min_bottleneck(w, k)
        part.check_parts(parts, 1000, k)
        assert value >= max(w) and value >= sum(w) / k - 1e-12
        # Lowering the bottleneck a little more is impossible.
        assert part._greedy(part.prefix_sums(w), k, value * (1 - 1e-9)) is None or k == 1000


@pytest.fixture(scope="module")
def ds_utils():
    return pytest.importorskip("deepspeed.runtime.utils")


def test_uniform_matches_deepspeed(ds_utils):
    for n in range(1, 30):
        for k in range(1, 12):
            assert part.uniform(n, k) == list(ds_utils.partition_uniform(n, k))


@need_profiles
def test_parameters_matches_deepspeed_partition_balanced(ds_utils, vgg, gnmt):
    cases = list(_instances(150, seed=5, max_n=14))
    for profile in (vgg, gnmt):
        counts = [round(x.param_bytes / 4) for x in profile.layers]
        cases += [(counts, k) for k in range(1, 9)]
    for w, k in cases:
        assert part.deepspeed_parameters(w, k) == [int(x) for x in ds_utils.partition_balanced(w, k)], (w, k)


def test_pipedream_dp_matches_its_recurrence_by_brute_force():
    rng = random.Random(7)
    for trial in range(120):
        n, m = rng.randint(1, 5), rng.randint(1, 4)
        compute = [rng.uniform(0, 5) for _ in range(n)]
        params = [rng.choice([0.0, rng.uniform(0, 20)]) for _ in range(n)]
        cuts = [rng.uniform(0, 10) for _ in range(n - 1)]
        combine = "sum" if trial % 2 else "max"
        transfers = trial % 3 != 0
        res = part.pipedream_dp(compute, params, cuts, m, 4.0, combine, transfers)
        assert sum(res.replication) == m and len(res.parts) == len(res.replication) + 1
        # The reported plan achieves the reported value, which is the best of all plans.
        assert part.pipedream_plan_time(compute, params, cuts, res.parts, res.replication, 4.0, combine,
                                        transfers) == pytest.approx(res.time)
        assert res.time == pytest.approx(part.pipedream_brute_force(compute, params, cuts, m, 4.0, combine,
                                                                   transfers))


def test_pipedream_uniform_is_optimal_for_its_objective():
    rng = random.Random(11)
    for _ in range(80):
        n = rng.randint(1, 8)
        k, r = rng.randint(1, n), rng.randint(1, 4)
        compute = [rng.uniform(0, 5) for _ in range(n)]
        params = [rng.uniform(0, 20) for _ in range(n)]
        cuts = [rng.uniform(0, 30) for _ in range(n - 1)]
        parts, value = part.pipedream_uniform(compute, params, cuts, k, r, 4.0)
        part.check_parts(parts, n, k)

        def objective(ps):
            v = 0.0
            for s, (a, b) in enumerate(zip(ps, ps[1:])):
                v = max(v, part._stage_time(sum(compute[a:b]), sum(params[a:b]), r, 4.0, "sum"))
                if s:
                    v = max(v, 2 * cuts[a - 1] / (4.0 * r))
            return v
        assert objective(parts) == pytest.approx(value)
        best = min(objective([0, *c, n]) for c in itertools.combinations(range(1, n), k - 1))
        assert value == pytest.approx(best)


# PipeDream's reference plans (profiles/README.md), quoted to 0.1 ms (GNMT-8: 0.01 ms): the
# tolerance is half the last quoted digit.
@need_profiles
@pytest.mark.parametrize("name, hierarchical, stages, straight, single", [
    ("vgg16", 43.0, 3, 235.6, 672.5), ("gnmt", 7.28, 10, 25.9, 89.4)])
def test_pipedream_reference_plans(name, hierarchical, stages, straight, single):
    path = PROFILES / f"{name}.txt"
    plan = pipedream_optimizer(path, [4, 4], [100e9, 12.5e9])
    tol = 0.005 if name == "gnmt" else 0.05
    assert plan.time_per_minibatch * 1e3 == pytest.approx(hierarchical, abs=tol)
    assert len(plan.stages) == stages and sum(plan.replication) == 16
    if name == "vgg16":
        assert plan.replication == [12, 3, 1]
    assert plan.single_machine_time * 1e3 == pytest.approx(single, abs=0.05)
    flat = pipedream_optimizer(path, [4], [12.5e9], straight=True)
    assert flat.time_per_minibatch * 1e3 == pytest.approx(straight, abs=0.05) and len(flat.stages) == 4


@need_profiles
def test_pipedream_reference_gnmt16_straight():
    plan = pipedream_optimizer(PROFILES / "gnmt_large.txt", [4], [12.5e9], straight=True)
    assert plan.time_per_minibatch * 1e3 == pytest.approx(137.1, abs=0.05)
    assert plan.single_machine_time * 1e3 == pytest.approx(520.5, abs=0.05)


@need_profiles
def test_pipedream_reference_gnmt16_hierarchical():
    plan = pipedream_optimizer(PROFILES / "gnmt_large.txt", [4, 4], [100e9, 12.5e9])
    assert plan.time_per_minibatch * 1e3 == pytest.approx(36.0, abs=0.05) and len(plan.stages) == 7


@need_profiles
def test_pipedream_default_leaves_transfers_out():
    """PipeDream's CLI default (no compression ratio) ignores activation transfers; the README's
    VGG-16 figures count them."""
    plan = pipedream_optimizer(PROFILES / "vgg16.txt", [4], [12.5e9], straight=True, count_transfers=False)
    assert plan.time_per_minibatch * 1e3 == pytest.approx(216.45, abs=0.01)


# ---------------------------------------------------------------------------------------------
# Re-computation

def test_recompute_memory_model_and_knapsack():
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(1, 8)
        saved = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        rc = [rng.choice([0.0, rng.uniform(0.1, 3)]) for _ in range(n)]
        start, stage_input, p = rng.randint(0, 5), rng.uniform(0, 5), rng.randint(1, 6)
        rec = StageRecompute(start, saved, rc, stage_input)
        # The same with run outputs kept (the output of a run's last layer stays in memory).
        out = [rng.uniform(0, s) for s in saved]
        ins = [rng.choice([0.0, rng.uniform(0, 4)]) for _ in saved]
        rec_out = StageRecompute(start, saved, rc, stage_input, out, ins)
        assert rec_out.order == rec.order
        for k in range(rec.options):
            layers = rec.layers(k)
            assert rec.activations(k, p) == pytest.approx(activations_of(layers, start, saved, stage_input, p))
            assert rec_out.activations(k, p) == pytest.approx(activations_of(layers, start, saved, stage_input, p, out, ins))
            assert rec.time(k) == pytest.approx(sum(rc[i - start] for i in layers))
            if k < len(rec.order) and rc[rec.order[k]] == 0:
                continue  # not a breakpoint: the next layer is free, the same time buys it too
            # At its own time, a prefix of the ratio order saves the most any subset can (0/1
            # knapsack at an LP breakpoint).
            best = max(sum(saved[i] for i in sub) for size in range(n + 1)
                       for sub in itertools.combinations(range(n), size)
                       if sum(rc[i] for i in sub) <= rec.time(k) + 1e-12)
            assert rec.cum_saved[k] == pytest.approx(best)
        for budget in (0.0, 0.5, 2.0, math.inf):
            k = rec.choose(p, budget)
            assert rec.time(k) <= budget + 1e-9
            allowed = [j for j in range(rec.options) if rec.time(j) <= budget + 1e-12]
            assert rec.activations(k, p) == pytest.approx(min(rec.activations(j, p) for j in allowed))
    # With one micro-batch in flight re-computation cannot save memory: nothing is chosen.
    assert StageRecompute(0, [5, 5, 5], [1, 1, 1], 1.0).choose(1, math.inf) == 0


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
    from hippie_ds.planner import evaluate, model as pl
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
    res = simulate(compiled, costs, iterations=3, critical_path=False)
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
    """The benchmark's shape (tools/bench_planner.py reports the time; not timed here)."""
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
                       "--memory-cap", "8GB")
    assert code == 0 and json.loads(out)["memory_cap"] == 8e9


@pytest.mark.parametrize("extra, message", [
    (["--cluster", "4x4"], "missing device memory"),
    (["--schedules", "zb"], "--schedules 'zb'"),
    (["--memory-cap", "lots"], "--memory-cap 'lots'"),
    (["--stages", "3"], "do(es) not divide"),
    (["--cluster", "1x1,1MB,1Gbit"], "does not fit"),
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


@pytest.mark.parametrize("name", available())
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


@pytest.mark.parametrize("name", available())
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
    from hippie_ds.planner.model import split_backward_time
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
