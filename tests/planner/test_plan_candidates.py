"""Plans that say how sure they are: a plan lists its runner-ups (other cuts of its
configuration, other configurations) with their predicted steps, and its summary says which are
within the profile's spread of the plan. Pure: the planner on small profiles."""

import pytest

from cli_run import run
from hippie_ds.planner import LayerProfile, PlannerError, Profile, make_plan, parse_cluster, save_profile
from hippie_ds.planner.candidates import neighbour_cuts
from hippie_ds.planner.plan_summary import format_candidates, within_spread

CLUSTER = parse_cluster("1x2,16GB,10Gbit")


def _profile(spread=None, n=8):
    return Profile(
        model="blocks",
        batch_size=4,
        layers=[
            LayerProfile(
                name="Block",
                forward=1e-3 * (1 + 0.1 * (i % 3)),
                backward=2e-3,
                output_bytes=1e4,
                param_bytes=1e5,
                spread=spread,
            )
            for i in range(n)
        ],
    )


def test_neighbouring_cuts_move_one_boundary_at_a_time():
    assert neighbour_cuts([0, 4, 8], reach=2) == [[0, 3, 8], [0, 5, 8], [0, 2, 8], [0, 6, 8]]
    assert neighbour_cuts([0, 1, 2, 8], reach=1) == [[0, 1, 3, 8]]  # the others would collide
    assert len(neighbour_cuts(list(range(0, 41, 2)), reach=2, limit=24)) == 24


def test_a_plan_lists_its_runner_ups_with_the_step_each_would_be_planned_with():
    plan = make_plan(
        _profile(), CLUSTER, 16, depths=[2], micro_batch_sizes=[4], schedules=["1f1b", "gpipe"], baselines=False
    )
    assert len(plan.candidates) >= 3
    kinds = {c.kind for c in plan.candidates}
    assert kinds == {"cut", "configuration"}
    steps = [plan.ranked_step(c.step_time, c.steps_factor) for c in plan.candidates]
    assert steps == sorted(steps)
    for c in plan.candidates:
        assert (c.pipeline_depth, c.micro_batch_size) == (2, 4)
        assert (c.schedule, c.boundaries) != (plan.schedule, plan.boundaries)
    # a cut's predicted step is what planning that cut gives
    cut = next(c for c in plan.candidates if c.kind == "cut")
    again = make_plan(
        _profile(),
        CLUSTER,
        16,
        depths=[2],
        micro_batch_sizes=[4],
        schedules=[cut.schedule],
        boundaries=cut.boundaries,
        baselines=False,
        candidates=0,
    )
    assert again.boundaries == cut.boundaries and again.candidates == []
    assert again.prediction.step_time == pytest.approx(cut.step_time)
    assert again.checkpointed_layers == cut.checkpointed_layers
    with pytest.raises(PlannerError, match=r"boundaries \[0, 9, 8\]: need strictly increasing entries from 0 to 8"):
        make_plan(_profile(), CLUSTER, 16, depths=[2], boundaries=[0, 9, 8])
    with pytest.raises(PlannerError, match="give one pipeline depth with them"):
        make_plan(_profile(), CLUSTER, 16, boundaries=[0, 4, 8])


def test_the_summary_says_which_candidates_the_profile_cannot_tell_apart():
    noisy = make_plan(_profile(spread=0.3), CLUSTER, 16, depths=[2], micro_batch_sizes=[4], baselines=False)
    assert noisy.profile_spread == pytest.approx(0.3)
    close = within_spread(noisy)
    mine = noisy.ranked_step(noisy.prediction.step_time, noisy.prediction.steps_factor)
    assert (
        close
        == [
            i
            for i, c in enumerate(noisy.candidates)
            if abs(noisy.ranked_step(c.step_time, c.steps_factor) / mine - 1) <= 0.3
        ]
        and close
    )
    text = "\n".join(format_candidates(noisy))
    assert "candidates beside the plan, by predicted step (the profile's spread 30%" in text
    assert text.count("within spread") == len(close)
    assert f"the plan's margin over {len(close)} of them is inside the profile's spread (30%)" in text
    quiet = make_plan(_profile(spread=0.0), CLUSTER, 16, depths=[2], micro_batch_sizes=[4], baselines=False)
    far = [
        i
        for i, c in enumerate(quiet.candidates)
        if quiet.ranked_step(c.step_time, c.steps_factor) > quiet.prediction.step_time
    ]
    assert set(far).isdisjoint(within_spread(quiet)) and "inside the profile's spread" not in quiet.summary()


def test_cli_prints_at_least_three_candidates_beside_the_plan(capsys, tmp_path):
    path = tmp_path / "p.yaml"
    save_profile(_profile(spread=0.1), path)
    code, out, err = run(
        capsys, "plan", "--profile", path, "--cluster", "1x2,16GB,10Gbit", "--global-batch", 16, "--no-baselines"
    )
    assert code == 0, err
    table = out.split("candidates beside the plan")[1].splitlines()
    assert (
        table[2].split()[0] == "plan"
        and sum(line.split()[0] in ("cut", "configuration") for line in table[3:] if line.strip()) >= 3
    )


def test_no_cut_leaves_a_stage_without_parameters():
    """DeepSpeed's optimizer refuses a stage with an empty parameter list (the emulated VGG's pools
    and ReLUs): neither the climbing cut nor a listed runner-up puts only parameter-free layers on a
    stage. Four heavy parameter-free layers up front would draw a balanced cut into them."""
    layers = [LayerProfile(name="Pool", forward=4e-3, backward=8e-3, output_bytes=1e4, param_bytes=0) for _ in range(4)]
    layers += [
        LayerProfile(name="Block", forward=1e-3, backward=2e-3, output_bytes=1e4, param_bytes=1e5) for _ in range(6)
    ]
    profile = Profile(model="pools", batch_size=4, layers=layers)
    plan = make_plan(profile, CLUSTER, 16, objective="throughput", depths=[2], candidates=8)
    params = [x.param_bytes for x in layers]
    cuts = [plan.boundaries] + [c.boundaries for c in plan.candidates if c.kind == "cut"]
    assert len(cuts) > 1
    for parts in cuts[1:]:
        assert all(sum(params[a:e]) > 0 for a, e in zip(parts, parts[1:])), parts
