"""The planner's inputs (hippie_ds.planner): profiles (PipeDream graph.txt and hippie-ds files), clusters,
partitions and PipeDream's DP with its reference plans, re-computation. Pure Python except the
DeepSpeed cross-checks of the partition baselines."""

import itertools
import json
import math
import random

import pytest

from hippie_ds.planner import (
    Cluster,
    ClusterError,
    ProfileError,
    load_profile,
    parse_cluster,
    read_pipedream,
    save_profile,
    synthetic_profile,
)
from hippie_ds.planner import partition as part
from hippie_ds.planner.pipedream import antichain_states, pipedream_optimizer
from hippie_ds.planner.pipedream_profile import parse_pipedream_graph
from planner_fixtures import PROFILES, V100_CLUSTER, need_profiles


# ---------------------------------------------------------------------------------------------
# Profiles


@need_profiles
@pytest.mark.parametrize(
    "name, layers, batch, total_ms",
    [("vgg16", 41, 128, 672.535), ("gnmt", 48, 32, 89.416), ("gnmt_large", 96, 128, 520.453)],
)
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
    other = gnmt.model_copy(
        update={"layers": gnmt.layers[:-1] + [gnmt.layers[-1].model_copy(update={"param_bytes": 1.0})]}
    )
    assert other.fingerprint() != gnmt.fingerprint()
    # Times and activations scale with the micro-batch, parameters do not; the model is the same.
    half = gnmt.scaled(16)
    assert half.total_time() == pytest.approx(gnmt.total_time() / 2)
    assert half.total_param_bytes() == gnmt.total_param_bytes() and half.fingerprint() == gnmt.fingerprint()


def test_hippie_profile_defaults(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "model: m\nbatch_size: 4\nlayers:\n  - {name: a, forward: 1, backward: 2, output_bytes: 10}\n"
        "  - {name: b, forward: 1, backward: 2, output_bytes: 20, saved_bytes: 5, recompute: 0.5}\n"
    )
    p = load_profile(path)
    assert p.cuts() == [10] and p.inputs() == [0.0, 10]
    assert [x.saved for x in p.layers] == [10, 5] and [x.recompute_time for x in p.layers] == [1, 0.5]


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 -- Conv -- forward_compute_time=1.0\n", "missing backward_compute_time"),
        ("node1 -- Conv\n", "expected 'nodeN -- description"),
        (
            "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=x, parameter_size=0\n",
            "activation_size='x' is not a number",
        ),
        (
            "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
            "\tnode1 -- node2\n",
            "unknown node node2",
        ),
        (
            "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
            "node2 -- B -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
            "\tnode1 -- node2\n\tnode2 -- node1\n",
            "cycle",
        ),
        ("", "no nodes"),
    ],
)
def test_bad_pipedream_profiles(tmp_path, text, message):
    path = tmp_path / "vgg16.txt"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as info:
        read_pipedream(path)
    assert str(path) in str(info.value)


def test_bad_profiles_name_file_and_field(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps({"model": "m", "batch_size": 1, "layers": [{"name": "a", "forward": -1, "backward": 1}]})
    )
    with pytest.raises(ProfileError, match=r"m\.json: field layers\.0\.forward"):
        load_profile(path)
    path.write_text(
        json.dumps(
            {"model": "m", "batch_size": 1, "cut_bytes": [1, 2], "layers": [{"name": "a", "forward": 1, "backward": 1}]}
        )
    )
    with pytest.raises(ProfileError, match="cut_bytes has 2 entries; a profile of 1 layers has 0 cuts"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "missing.yaml")
    unknown = tmp_path / "mynet.txt"
    unknown.write_text(
        "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
    )
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
    assert c.device_memory == 80 * 2**30 and c.inter_node_bandwidth == 25e9 and c.latency == pytest.approx(5e-6)
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ndevices_per_node: 4\ndevice_memory: 32GB\ninter_node_bandwidth: 100Gbit\n")
    assert parse_cluster(str(path)) == Cluster(
        nodes=2, devices_per_node=4, device_memory=32e9, inter_node_bandwidth=12.5e9
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ("4x4", "missing device memory"),
        ("16GB", "must start with NODESxDEVICES"),
        ("4x4,16GB,100", "cannot tell what '100' is"),
        ("4x4,16GB,1Gbit,foo=2", "unknown key 'foo'"),
        ("0x4,16GB,1Gbit", "nodes"),
        ("4x4,16GB,fastGbit", "cannot tell"),
    ],
)
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
        assert part.pipedream_plan_time(
            compute, params, cuts, res.parts, res.replication, 4.0, combine, transfers
        ) == pytest.approx(res.time)
        assert res.time == pytest.approx(part.pipedream_brute_force(compute, params, cuts, m, 4.0, combine, transfers))


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
@pytest.mark.parametrize(
    "name, hierarchical, stages, straight, single", [("vgg16", 43.0, 3, 235.6, 672.5), ("gnmt", 7.28, 10, 25.9, 89.4)]
)
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
