"""The planner with virtual stages (interleaved-1f1b, zb-v, hippie-interleaved): per-chunk traits,
K x v-part plans, their memory and simulated step, when they win and lose, a heavy LM head.
Pure Python."""

import math

import pytest

from hippie_ds.planner import (
    LayerProfile,
    PlannerError,
    Profile,
    load_plan,
    make_plan,
    parse_cluster,
    save_plan,
    synthetic_profile,
)
from hippie_ds.planner import partition as part
from hippie_ds.schedules import available, load_spec

VIRTUAL = [n for n in available() if load_spec(n).virtual_stages is not None]


# ---------------------------------------------------------------------------------------------
# Traits: per-chunk in-flight micro-batches, by hand


def megatron_in_flight(K: int, M: int, v: int, s: int) -> tuple[int, tuple[int, ...]]:
    """Stage s of Megatron's interleaved 1F1B, counted by hand from its documented order (not
    from the compiler): W = min(2(K-s-1) + (v-1)K, vM) warm-up forwards, then forward W+j and
    backward j alternating, then the remaining backwards. Forward k is micro-batch
    (k // Kv) K + k % K on chunk (k % Kv) // K; backward k the same with the chunk counted from
    the last. (joint peak in chunk micro-batches, peak per chunk)."""

    def fwd(k):
        return (k % (K * v)) // K, (k // (K * v)) * K + k % K

    def bwd(k):
        c, mb = fwd(k)
        return v - 1 - c, mb

    W = min(2 * (K - s - 1) + (v - 1) * K, v * M)
    order = [("F", k) for k in range(W)]
    for j in range(v * M - W):
        order += [("F", W + j), ("B", j)]
    order += [("B", k) for k in range(v * M - W, v * M)]
    live, peak, chunk_peak = set(), 0, [0] * v
    for kind, k in order:
        c, mb = fwd(k) if kind == "F" else bwd(k)
        if kind == "F":
            live.add((c, mb))
        else:
            live.discard((c, mb))
        peak = max(peak, len(live))
        chunk_peak[c] = max(chunk_peak[c], sum(1 for x in live if x[0] == c))
    return peak, tuple(chunk_peak)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "hippie-interleaved"])
def test_interleaved_traits_match_a_hand_count(name):
    from hippie_ds.planner.traits import _compiled_traits, schedule_traits

    for K, M in ((2, 4), (3, 6), (4, 8), (4, 12)):
        t = _compiled_traits(name, K, M)
        assert (t.virtual_stages, t.layout, t.parts) == (2, "interleaved", 2 * K)
        hand = [megatron_in_flight(K, M, 2, s) for s in range(K)]
        assert list(t.in_flight) == [h[0] for h in hand], (K, M)
        assert list(t.in_flight_chunks) == [h[1] for h in hand], (K, M)
        assert t.interleaved and not t.splits_backward
    # K = 4: stage 0 holds 11 chunk micro-batches at most, 8 of chunk 0 and 4 of chunk 1
    assert _compiled_traits(name, 4, 8).in_flight_chunks == ((8, 4), (8, 4), (7, 3), (5, 1))
    # above the probe size the traits are extrapolated from counts the schedule runs (multiples of K)
    for K, M in ((2, 16), (2, 30), (4, 32), (4, 48)):
        assert schedule_traits(name, K, M) == _compiled_traits(name, K, M), (K, M)


def test_zb_v_traits_match_a_hand_count():
    """torch's ZB-V order: stage s runs 2(K-s)-1 chunk-0 forwards, then s x [F1, F0], then
    F0 again in the steady state before its first chunk-0 B: chunk 0 holds 2K - s micro-batches;
    chunk 1 runs s forwards, then [F1, B1, W1]: it holds s + 1. Every stage holds 2K chunk
    micro-batches at once (1F1B's K of whole micro-batches)."""
    from hippie_ds.planner.traits import _compiled_traits, schedule_traits

    for K, M in ((2, 4), (3, 6), (4, 8), (4, 13)):
        t = _compiled_traits("zb-v", K, M)
        assert (t.virtual_stages, t.layout, t.splits_backward) == (2, "v", True)
        assert list(t.in_flight_chunks) == [(2 * K - s, s + 1) for s in range(K)], (K, M)
        assert list(t.in_flight) == [2 * K] * K
    for K, M in ((2, 19), (4, 40)):
        assert schedule_traits("zb-v", K, M) == _compiled_traits("zb-v", K, M), (K, M)


@pytest.mark.parametrize("name", VIRTUAL)
def test_deep_virtual_pipelines_are_compiled_at_their_depth(name, monkeypatch):
    """Not extrapolated from a shallower depth (interleaved's M % K == 0 ties M to the depth)."""
    from hippie_ds.planner import traits

    monkeypatch.setattr(traits, "DEPTH_PROBE", 6)
    traits.schedule_traits.cache_clear()
    try:
        for K, M in ((9, 18), (10, 20), (10, 40)):
            assert traits.schedule_traits(name, K, M) == traits._compiled_traits(name, K, M), (K, M)
    finally:
        traits.schedule_traits.cache_clear()


# ---------------------------------------------------------------------------------------------
# Plans with K x v parts: boundaries, memory, the simulated step


def _profile(n=24, seed=3):
    """Layers of unequal time, saved bytes and parameters, explicit numbers (micro-batch 8)."""
    import random

    rng = random.Random(seed)
    layers = [
        LayerProfile(
            name=f"l{i}",
            forward=rng.uniform(1, 3) * 1e-3,
            backward=rng.uniform(2, 6) * 1e-3,
            output_bytes=rng.uniform(1, 4) * 1e6,
            saved_bytes=rng.uniform(5, 20) * 1e6,
            param_bytes=rng.uniform(1, 8) * 1e7,
        )
        for i in range(n)
    ]
    return Profile(model=f"virtual-{n}", batch_size=8, layers=layers)


def test_an_interleaved_plan_has_k_v_parts_and_hand_computed_memory(tmp_path):
    profile, cluster = _profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    plan = make_plan(
        profile, cluster, 64, schedules=["interleaved-1f1b"], depths=[4], micro_batch_sizes=[8], objective="throughput"
    )
    K, v, M, L = 4, 2, 8, profile.layers
    assert (plan.pipeline_depth, plan.virtual_stages, plan.layout, plan.micro_batches) == (K, v, "interleaved", M)
    assert len(plan.boundaries) == K * v + 1 and len(plan.stages) == K * v
    assert [(st.stage, st.chunk) for st in plan.stages] == [(p % K, p // K) for p in range(K * v)]
    assert plan.checkpointed_layers == []  # memory is plentiful: nothing re-computed
    # by hand: 4 x parameters of both chunks + per chunk (in flight x (its input + its saved bytes))
    # + the largest working memory of the stage's layers (estimated: input + output + parameters)
    b = plan.boundaries
    for s in range(K):
        joint, per_chunk = megatron_in_flight(K, M, v, s)
        memory, working = 0.0, 0.0
        for c in range(v):
            p = c * K + s
            first, end = b[p], b[p + 1]
            memory += 4 * sum(x.param_bytes for x in L[first:end])
            stage_input = L[first - 1].output_bytes if first else 0.0
            memory += per_chunk[c] * (stage_input + sum(x.saved_bytes for x in L[first:end]))
            working = max(
                [working]
                + [
                    (L[i - 1].output_bytes if i else 0.0) + L[i].output_bytes + L[i].param_bytes
                    for i in range(first, end)
                ]
            )
        memory += working
        assert plan.prediction.memory_per_stage[s] == pytest.approx(memory, rel=1e-12), s
        assert [st.in_flight for st in plan.stages if st.stage == s] == list(per_chunk)
    config = plan.deepspeed_config()
    assert config["pipeline"] == {"schedule": "interleaved-1f1b", "virtual_stages": 2}
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    assert "(2 chunks per stage, layout interleaved)" in plan.summary()


def test_a_plan_file_places_its_parts_by_its_layout():
    profile, cluster = _profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    plan = make_plan(profile, cluster, 64, schedules=["zb-v"], depths=[4], micro_batch_sizes=[8], baselines=False)
    assert plan.layout == "v" and [(st.stage, st.chunk) for st in plan.stages] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (3, 1),
        (2, 1),
        (1, 1),
        (0, 1),
    ]
    data = plan.model_dump()
    with pytest.raises(ValueError, match=r"need 9 strictly increasing entries .*4 stages x 2 virtual stages"):
        type(plan).model_validate({**data, "boundaries": data["boundaries"][:-2] + [24]})
    with pytest.raises(
        ValueError,
        match=r"stages\[4\] is stage 3 chunk 1; layout 'interleaved' places model part 4 "
        r"on stage 0 chunk 1",
    ):
        type(plan).model_validate({**data, "layout": "interleaved"})
    with pytest.raises(ValueError, match="layout 'v' holds 2 chunks per stage"):
        type(plan).model_validate({**data, "virtual_stages": 3})


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_the_predicted_step_is_the_simulators_for_the_plans_partition(name):
    """Costs built here from the plan file alone (a stage's chunks summed, the largest cut it
    sends), simulated on the compiled schedule: the plan's step, to the last digit."""
    from hippie_ds.schedules import compile as compile_schedule
    from hippie_ds.schedules.costs import CommCost, Costs, StageCost
    from hippie_ds.schedules.simulator import simulate

    profile, cluster = _profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    plan = make_plan(profile, cluster, 64, schedules=[name], depths=[4], micro_batch_sizes=[8], objective="throughput")
    assert plan.prediction.predicted_by == "simulator"
    L, K = profile.layers, plan.pipeline_depth
    stages = []
    for s in range(K):
        mine = [st for st in plan.stages if st.stage == s]
        layers = [i for st in mine for i in range(st.first_layer, st.end_layer)]
        stages.append(
            StageCost(
                forward=sum(L[i].forward for i in layers),
                backward=sum(L[i].backward for i in layers),
                # the model's first layers have no input gradient: their whole backward is W
                backward_weight=sum(L[i].backward if i < plan.boundaries[1] else L[i].backward / 2 for i in layers),
                param_bytes=sum(L[i].param_bytes for i in layers),
                activation_bytes=max(st.activation_bytes for st in mine),
            )
        )
    comm = CommCost(
        p2p_bandwidth=cluster.intra_node_bandwidth,
        p2p_latency=cluster.latency,
        allreduce_bandwidth=cluster.intra_node_bandwidth,
        allreduce_latency=cluster.latency,
        data_parallel=1,
        shared_link=True,
    )
    sim = simulate(
        compile_schedule(name, K, plan.micro_batches),
        Costs(stages=stages, comm=comm),
        iterations=1,
        critical_path=False,
    )
    assert plan.prediction.step_time == pytest.approx(sim.step_time, rel=1e-12)


def _uniform_profile(n=32, output_bytes=1e6):
    layers = [
        LayerProfile(
            name=f"l{i}", forward=1e-3, backward=2e-3, output_bytes=output_bytes, saved_bytes=1e7, param_bytes=1e7
        )
        for i in range(n)
    ]
    return Profile(model=f"uniform-{n}", batch_size=8, layers=layers)


def test_interleaving_wins_when_the_bubble_dominates():
    """M = K: 1F1B idles (K-1)/(M+K-1) = 3/7 of the step, interleaved-1f1b (K-1)/(vM+K-1) = 3/11,
    zb-v still less; with memory to spare and cheap links, the throughput plan interleaves."""
    profile, cluster = _uniform_profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    kw = dict(depths=[4], micro_batch_sizes=[8], objective="throughput", baselines=False)
    one = make_plan(profile, cluster, 32, schedules=["1f1b"], **kw)
    plan = make_plan(profile, cluster, 32, schedules=["1f1b", "interleaved-1f1b"], **kw)
    assert plan.schedule == "interleaved-1f1b" and plan.micro_batches == 4
    # equal stages: M (F+B) + (K-1)(F+B)/v against M (F+B) + (K-1)(F+B)
    assert plan.prediction.step_time / one.prediction.step_time == pytest.approx((4 + 1.5) / (4 + 3), rel=0.02)
    zbv = make_plan(profile, cluster, 32, schedules=["1f1b", "interleaved-1f1b", "zb-v"], **kw)
    assert zbv.schedule == "zb-v" and zbv.prediction.step_time < plan.prediction.step_time


def test_interleaving_loses_when_memory_is_the_limit():
    """Many micro-batches (a small bubble to win back) and memory capped at 1F1B's peak:
    interleaved-1f1b's first stage holds 8 + 4 half-model micro-batches, 1F1B's 4 whole ones,
    so interleaving must re-compute (a slower step) and the plan stays 1F1B."""
    profile, cluster = _uniform_profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    kw = dict(depths=[4], micro_batch_sizes=[8], objective="throughput", baselines=False)
    one = make_plan(profile, cluster, 256, schedules=["1f1b"], **kw)
    cap = one.prediction.memory_max
    plan = make_plan(profile, cluster, 256, schedules=["1f1b", "interleaved-1f1b"], memory_cap=cap, **kw)
    assert plan.schedule == "1f1b" and plan.checkpointed_layers == []
    tight = make_plan(profile, cluster, 256, schedules=["interleaved-1f1b"], memory_cap=cap, **kw)
    assert tight.checkpointed_layers and tight.prediction.step_time > plan.prediction.step_time
    free = make_plan(profile, cluster, 256, schedules=["1f1b", "interleaved-1f1b"], **kw)
    assert free.schedule == "interleaved-1f1b"  # without the cap its smaller bubble wins


def test_too_few_layers_for_the_chunks_is_refused_clearly():
    profile, cluster = synthetic_profile(6, seed=1, batch_size=8), parse_cluster("1x4,80GB,100Gbit")
    with pytest.raises(
        PlannerError,
        match=r"schedule 'interleaved-1f1b' runs 2 model chunks per stage, so 4 stages "
        r"need 8 parts of at least one layer; the profile has 6 layers",
    ):
        make_plan(profile, cluster, 32, schedules=["interleaved-1f1b"], depths=[4])
    # beside a schedule that fits, the planner plans that one
    plan = make_plan(profile, cluster, 32, schedules=["1f1b", "interleaved-1f1b"], depths=[4], baselines=False)
    assert plan.schedule == "1f1b" and plan.virtual_stages == 1
    with pytest.raises(ValueError, match="cannot split 6 layers into 4 stages x 2 chunks = 8 non-empty parts"):
        part.chunked_partition([1.0] * 6, 4, 2)


def test_chunked_partition_balances_stages_not_parts():
    """A heavy last layer: balanced parts leave its stage with a full part beside it; the
    chunked partition moves layers off that stage (optimal here, checked by brute force)."""
    import itertools

    from hippie_ds.schedules.layout import Layout

    work = [1.0] * 15 + [6.0]
    for kind in ("interleaved", "v"):
        owner = [Layout(kind, 3, 2).place(p)[0] for p in range(6)]
        parts, value = part.chunked_partition(work, 3, 2, kind)
        prefix = part.prefix_sums(work)
        assert value == max(part.chunk_stage_sums(prefix, parts, owner, 3))
        best = min(
            max(part.chunk_stage_sums(prefix, [0, *cuts, 16], owner, 3))
            for cuts in itertools.combinations(range(1, 16), 5)
        )
        assert value == best == 7.0, kind


# ---------------------------------------------------------------------------------------------
# A heavy LM head: the planner moves transformer layers off the last stage


def _lm_profile(transformers=32, head=9.0):
    """An embedding (cheap compute, large parameters), transformer layers, an LM head costing
    ``head`` transformer layers (a large vocabulary)."""
    t = dict(forward=1e-3, backward=2e-3, output_bytes=2e6, saved_bytes=2e7)
    layers = [
        LayerProfile(name="embed", forward=1e-4, backward=2e-4, output_bytes=2e6, saved_bytes=2e6, param_bytes=2e8)
    ]
    layers += [LayerProfile(name=f"block{i}", param_bytes=5e7, **t) for i in range(transformers)]
    layers += [
        LayerProfile(
            name="lm_head",
            forward=head * 1e-3,
            backward=head * 2e-3,
            output_bytes=5e7,
            saved_bytes=5e7,
            param_bytes=2e8,
        )
    ]
    return Profile(model="lm", batch_size=8, layers=layers)


def _transformer_partition(n_blocks: int, parts: int) -> list[int]:
    """DeepSpeed's partition_method 'type:transformer': equal transformer layers per part, the
    embedding with the first, the head with the last."""
    per = part.uniform(n_blocks, parts)
    return [0] + [1 + x for x in per[1:-1]] + [n_blocks + 2]


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_a_heavy_head_moves_transformer_layers_off_the_last_stage(name, v):
    from hippie_ds.planner import model as pl
    from hippie_ds.planner.evaluate import simulate_configuration

    profile, cluster = _lm_profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    K, b, G = 4, 8, 128
    plan = make_plan(
        profile,
        cluster,
        G,
        schedules=[name],
        depths=[K],
        micro_batch_sizes=[b],
        objective="throughput",
        baselines=False,
    )
    M = plan.micro_batches
    last = [st for st in plan.stages if st.end_layer == profile.num_layers][0]
    assert last.end_layer - last.first_layer - 1 < 32 // (K * v), plan.boundaries  # fewer blocks beside the head
    model = pl._Model(profile, cluster, G, 4.0, "mean", cluster.device_memory)
    ds = model.layout(K, _transformer_partition(32, K * v), v, "interleaved")
    zero = [0] * K
    step, deferred = model.step_time(ds, name, b / 8, M, zero)
    deepspeed = simulate_configuration(model, ds, b, M, name, zero, deferred, auto_limit=0).step
    ratio = plan.prediction.step_time / deepspeed
    print(
        f"{name}: planned {plan.boundaries} {plan.prediction.step_time * 1e3:.2f} ms, type:transformer "
        f"{ds.parts} {deepspeed * 1e3:.2f} ms, ratio {ratio:.3f}"
    )
    assert ratio <= 0.85
    assert math.isfinite(ratio)


def test_the_analytic_step_shrinks_the_bubble_v_times():
    """Equal stages, nearly free links: the analytic interleaved-1f1b step is
    M (F+B) + (K-1)(F+B)/v and the simulator agrees; zb-v's is the zero-bubble bound on v M
    chunk micro-batches, never above the simulated step, equal to it from M = 2K on."""
    from hippie_ds.planner import model as pl
    from hippie_ds.planner.evaluate import simulate_configuration

    profile, cluster = _uniform_profile(output_bytes=1.0), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    model = pl._Model(profile, cluster, 64, 4.0, "mean", cluster.device_memory)
    K, F, B = 4, 4 * 1e-3, 4 * 2e-3  # 32 layers in 8 parts of 4: a stage's two chunks = 8 layers
    for M in (4, 8, 16):
        lay = model.layout(K, v=2, kind="interleaved")
        assert lay.parts == list(range(0, 33, 4))
        step, _ = model.step_time(lay, "interleaved-1f1b", 1.0, M, [0] * K)
        assert step == pytest.approx(M * 2 * (F + B) + (K - 1) * (F + B), rel=1e-3)
        sim = simulate_configuration(model, lay, 8, M, "interleaved-1f1b", [0] * K, [], auto_limit=0)
        assert sim.step == pytest.approx(step, rel=1e-3)
        vlay = model.layout(K, v=2, kind="v")
        step, _ = model.step_time(vlay, "zb-v", 1.0, M, [0] * K)
        sim = simulate_configuration(model, vlay, 8, M, "zb-v", [0] * K, [], auto_limit=0)
        # M < 2K - 1: torch's ZB-V order pads to 2K - 1 micro-batches, which the bound does not know
        assert step <= sim.step * (1 + 1e-9) and step == pytest.approx(sim.step, rel=1e-3 if M >= 2 * K else 0.15), M


def test_cli_plans_virtual_schedules_beside_the_others(capsys, tmp_path):
    from hippie_ds.cli import main
    from hippie_ds.planner import save_profile

    profile = _uniform_profile()
    save_profile(profile, tmp_path / "p.yaml")
    plan_file = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--profile",
            str(tmp_path / "p.yaml"),
            "--cluster",
            "1x4,80GB,100Gbit,2400Gbit",
            "--global-batch",
            "32",
            "--stages",
            "4",
            "--micro-batch-size",
            "8",
            "--objective",
            "throughput",
            "--schedules",
            "1f1b,interleaved-1f1b,zb-v",
            "--out",
            str(plan_file),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = load_plan(plan_file)
    assert plan.schedule == "zb-v" and plan.virtual_stages == 2 and len(plan.boundaries) == 9
    assert "schedule zb-v (2 chunks per stage, layout v)" in out
    assert "3.1 " in out and "zb-v" in out  # a row per part (stage.chunk); the baselines under zb-v's layout
    # too few layers: a usage error naming the counts
    save_profile(_uniform_profile(n=6), tmp_path / "six.yaml")
    code = main(
        [
            "plan",
            "--profile",
            str(tmp_path / "six.yaml"),
            "--cluster",
            "1x4,80GB,100Gbit",
            "--global-batch",
            "32",
            "--stages",
            "4",
            "--schedules",
            "zb-v",
        ]
    )
    _, err = capsys.readouterr()
    assert code != 0 and "4 stages need 8 parts of at least one layer; the profile has 6 layers" in err


def test_recomputation_per_chunk_matches_the_run_by_run_memory_model():
    """Under a memory cap the interleaved plan re-computes layers; each stage's memory is its
    chunks' parameters, each chunk's in-flight x kept bytes (recompute.activations_of, written
    out run by run) and the largest re-materialized run of any chunk (one backward at a time)."""
    from hippie_ds.planner.recompute import activations_of

    profile, cluster = _profile(), parse_cluster("1x4,80GB,100Gbit,2400Gbit")
    kw = dict(
        schedules=["interleaved-1f1b"], depths=[4], micro_batch_sizes=[8], objective="throughput", baselines=False
    )
    free = make_plan(profile, cluster, 64, **kw)
    plan = make_plan(profile, cluster, 64, memory_cap=0.8 * free.prediction.memory_max, **kw)
    assert plan.checkpointed_layers and plan.prediction.memory_max <= 0.8 * free.prediction.memory_max
    L, K = profile.layers, 4
    for s in range(K):
        params, held, runs = 0.0, 0.0, []
        chunks = [st for st in plan.stages if st.stage == s]
        working = max(profile.working()[i] for st in chunks for i in range(st.first_layer, st.end_layer))
        for st in chunks:
            a, e = st.first_layer, st.end_layer
            args = (plan.checkpointed_layers, a, [x.saved_bytes for x in L[a:e]], L[a - 1].output_bytes if a else 0.0)
            outputs = [x.output_bytes for x in L[a:e]]
            run = activations_of(*args, 0, outputs)
            held += activations_of(*args, st.in_flight, outputs) - run
            runs.append(run)
            params += 4 * sum(x.param_bytes for x in L[a:e])
        assert plan.prediction.memory_per_stage[s] == pytest.approx(params + held + max(runs) + working, rel=1e-9), s
