"""The planner's memory inputs: re-computation (the memory model and its knapsack), the loss and the
working memory in a stage's planned memory, profiles without those fields, and the state factor
that follows the profile's precision (planned memory against max_memory_allocated)."""

import itertools
import math
import random

import pytest

from hippie_ds.planner import ProfileError, load_profile, parse_cluster, save_profile
from hippie_ds.planner.recompute import StageRecompute, activations_of


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
            assert rec_out.activations(k, p) == pytest.approx(
                activations_of(layers, start, saved, stage_input, p, out, ins)
            )
            assert rec.time(k) == pytest.approx(sum(rc[i - start] for i in layers))
            if k < len(rec.order) and rc[rec.order[k]] == 0:
                continue  # not a breakpoint: the next layer is free, the same time buys it too
            # At its own time, a prefix of the ratio order saves the most any subset can (0/1
            # knapsack at an LP breakpoint).
            best = max(
                sum(saved[i] for i in sub)
                for size in range(n + 1)
                for sub in itertools.combinations(range(n), size)
                if sum(rc[i] for i in sub) <= rec.time(k) + 1e-12
            )
            assert rec.cum_saved[k] == pytest.approx(best)
        for budget in (0.0, 0.5, 2.0, math.inf):
            k = rec.choose(p, budget)
            assert rec.time(k) <= budget + 1e-9
            allowed = [j for j in range(rec.options) if rec.time(j) <= budget + 1e-12]
            assert rec.activations(k, p) == pytest.approx(min(rec.activations(j, p) for j in allowed))
    # With one micro-batch in flight re-computation cannot save memory: nothing is chosen.
    assert StageRecompute(0, [5, 5, 5], [1, 1, 1], 1.0).choose(1, math.inf) == 0


# ---------------------------------------------------------------------------------------------
# The loss, working memory and the state factor (planned memory vs max_memory_allocated)

LOSS = {
    "name": "lm_loss",
    "forward": 5e-4,
    "backward": 1e-3,
    "backward_weight": 0.0,
    "output_bytes": 4.0,
    "saved_bytes": 400.0,
    "input_bytes": 464.0,
    "working_bytes": 800.0,
}


def _head_profile(**extra):
    """An embedding-like layer and a head: the head's output (the logits) is what the loss holds."""
    from hippie_ds.planner.profile import as_profile

    return as_profile(
        {
            "model": "m",
            "batch_size": 4,
            "layers": [
                {
                    "name": "a",
                    "forward": 1e-3,
                    "backward": 2e-3,
                    "output_bytes": 100.0,
                    "saved_bytes": 300.0,
                    "param_bytes": 1000.0,
                    "working_bytes": 50.0,
                },
                {
                    "name": "head",
                    "forward": 1e-3,
                    "backward": 2e-3,
                    "output_bytes": 400.0,
                    "saved_bytes": 400.0,
                    "param_bytes": 2000.0,
                    "working_bytes": 60.0,
                },
            ],
            **extra,
        }
    )


def _plan_two_stages(profile, **kw):
    from hippie_ds.planner import make_plan

    return make_plan(
        profile,
        parse_cluster("1x2,80GB,100Gbit"),
        8,
        objective="throughput",
        depths=[2],
        micro_batch_sizes=[4],
        schedules=["1f1b"],
        baselines=False,
        **kw,
    )


def test_planned_memory_counts_the_loss_and_the_working_memory():
    with_loss, without = _plan_two_stages(_head_profile(loss=LOSS)), _plan_two_stages(_head_profile())
    assert with_loss.boundaries == without.boundaries == [0, 1, 2]
    first, last = with_loss.stages
    # stage 0: 2 micro-batches in flight (1f1b), its layer's working memory; no loss there
    assert (first.in_flight, first.activation_memory, first.working_memory) == (2, 600.0, 50.0)
    assert first.memory == 4 * 1000 + 600 + 50 == without.stages[0].memory
    # the last stage keeps its input (100), the head's saved bytes (400) and the loss's (400); its
    # peak adds the largest working memory, the loss's 800 over the head's 60
    assert (last.in_flight, last.kept_bytes, last.activation_memory, last.working_memory) == (1, 900.0, 900.0, 800.0)
    assert last.memory == 4 * 2000 + 900 + 800
    assert without.stages[1].memory == 4 * 2000 + 500 + 60  # what the planner predicted without the loss
    # the loss's time is the last part's
    assert last.forward == pytest.approx(1.5e-3) and last.backward == pytest.approx(3e-3)
    assert without.stages[1].forward == pytest.approx(1e-3)
    assert with_loss.fingerprint == without.fingerprint  # the loss is not a layer
    for st in with_loss.stages:
        assert st.memory == pytest.approx(st.param_bytes * 4 + st.activation_memory + st.working_memory)


def test_working_memory_estimate_without_a_measurement():
    """A CPU profile (no allocator statistic) or an older one: input + output + parameter bytes,
    per layer and for the loss (its input: the last layer's output when it does not say)."""
    profile = _head_profile(loss={k: v for k, v in LOSS.items() if k not in ("working_bytes", "input_bytes")})
    layers = [x.model_copy(update={"working_bytes": None}) for x in profile.layers]
    profile = profile.model_copy(update={"layers": layers})
    assert profile.working() == [0 + 100 + 1000, 100 + 400 + 2000]
    assert profile.loss_working() == 400 + 4
    plan = _plan_two_stages(profile)
    assert [st.working_memory for st in plan.stages] == [1100, 2500]


def test_profile_without_the_new_fields_loads_and_plans(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(
        "model: m\nbatch_size: 4\nlayers:\n"
        "  - {name: a, forward: 0.001, backward: 0.002, output_bytes: 100, saved_bytes: 300,"
        " param_bytes: 1000}\n"
        "  - {name: head, forward: 0.001, backward: 0.002, output_bytes: 400, param_bytes: 2000}\n"
    )
    old = load_profile(path)
    assert old.loss is None and old.param_dtype is None and old.state_factor() == 4.0
    assert old.loss_working() == 0.0 and old.working() == [1100, 2500]
    plan = _plan_two_stages(old)
    assert plan.assumptions["state_factor"] == 4.0
    assert plan.stages[1].memory == 4 * 2000 + 500 + 2500


def test_loss_and_precision_round_trip_and_scale(tmp_path):
    profile = _head_profile(loss=LOSS, param_dtype="bfloat16", param_bytes_dtype="float32")
    for suffix in (".json", ".yaml"):
        save_profile(profile, tmp_path / f"p{suffix}")
        again = load_profile(tmp_path / f"p{suffix}")
        assert again == profile and again.loss.saved_bytes == 400 and again.layers[0].working_bytes == 50
    half = profile.scaled(2)
    assert half.loss.forward == pytest.approx(2.5e-4) and half.loss.working_bytes == 400
    assert half.layers[1].working_bytes == 30 and half.total_time() == pytest.approx(profile.total_time() / 2)
    assert profile.total_time() == pytest.approx(4 * 3e-3 / 2 + 1.5e-3)  # the loss counts
    with pytest.raises(ProfileError, match="param_dtype"):
        from hippie_ds.planner.profile import profile_from_dict

        profile_from_dict({**profile.model_dump(exclude_none=True), "param_dtype": "int8"})


@pytest.mark.parametrize(
    "dtype, bytes_dtype, factor",
    [
        (None, None, 4.0),
        ("float32", None, 4.0),
        ("float32", "float32", 4.0),
        ("bfloat16", "float32", 4.5),  # in place: fp32-sized param bytes, BF16_Optimizer's 18 bytes a parameter
        ("bfloat16", None, 9.0),
        ("float16", "float16", 9.0),
    ],
)
def test_state_factor_follows_the_profile_precision(tmp_path, dtype, bytes_dtype, factor):
    from hippie_ds.cli import main
    from hippie_ds.planner import load_plan

    profile = _head_profile(param_dtype=dtype, param_bytes_dtype=bytes_dtype)
    assert profile.state_factor() == factor
    plan = _plan_two_stages(profile)
    assert plan.assumptions["state_factor"] == factor and plan.stages[1].memory == factor * 2000 + 500 + 60
    assert _plan_two_stages(profile, state_factor=3.0).stages[1].memory == 3 * 2000 + 500 + 60  # given: it wins
    save_profile(profile, tmp_path / "p.yaml")
    args = [
        "plan",
        "--profile",
        str(tmp_path / "p.yaml"),
        "--cluster",
        "1x2,80GB,100Gbit",
        "--global-batch",
        "8",
        "--stages",
        "2",
        "--micro-batch-size",
        "4",
        "--schedules",
        "1f1b",
        "--objective",
        "throughput",
        "--no-baselines",
    ]
    assert main(args + ["--out", str(tmp_path / "a.json")]) == 0
    assert load_plan(tmp_path / "a.json").assumptions["state_factor"] == factor
    assert main(args + ["--state-factor", "7", "--out", str(tmp_path / "b.json")]) == 0
    assert load_plan(tmp_path / "b.json").assumptions["state_factor"] == 7.0


# ---------------------------------------------------------------------------------------------
# A deferred stage's memory: twice its delayed share of the gradient


def test_a_deferred_stage_holds_twice_its_delayed_gradient_not_the_whole_stage():
    """The engine keeps a deferred stage's delayed gradient in its buffer and the default staleness
    correction's delta of the same weights (tests/bench/test_bench_memory_count.py counts both on real
    ranks); with one of three layers delayed that is that layer's share, not the stage's whole
    parameter bytes (what the planner charged before)."""
    from hippie_ds.planner import make_plan
    from hippie_ds.planner.profile import as_profile

    layer = {"forward": 1e-3, "backward": 2e-3, "output_bytes": 100.0, "saved_bytes": 100.0}
    profile = as_profile(
        {
            "model": "m",
            "batch_size": 4,
            "layers": [{**layer, "name": f"l{i}", "param_bytes": 1e6 * (i % 3 + 1)} for i in range(6)],
        }
    )
    plan = make_plan(
        profile,
        parse_cluster("2x2,80GB,1Gbit"),
        32,
        objective="throughput",
        depths=[2],
        micro_batch_sizes=[4],
        schedules=["hippie-1f1b"],
        baselines=False,
    )
    partial = [st for st in plan.stages if st.deferred and 0 < st.delayed_share < 1]
    assert partial, [(st.deferred, st.delayed_share) for st in plan.stages]
    for st in plan.stages:
        delayed = st.param_bytes * st.delayed_share if st.deferred else 0.0
        assert st.memory == pytest.approx(st.param_bytes * 4 + 2 * delayed + st.activation_memory + st.working_memory)
