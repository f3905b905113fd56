"""A plan states its confidence: how many profiling steps would separate it from its
nearest candidate, from the profile's measured spread (a median's uncertainty falls as one over the
square root of its runs), printed in the plan's summary, and ``hippie.profile`` takes that number as
its ``steps``. Pure."""

import pytest

from hippie_ds.config import ProfileConfig
from hippie_ds.planner import LayerProfile, Profile, make_plan, parse_cluster
from hippie_ds.planner.noise import separating_steps, steps_to_separate
from hippie_ds.planner.plan_summary import format_summary

MS = 1e-3


def test_steps_grow_with_the_square_of_spread_over_margin():
    assert steps_to_separate(0.10, 0.10, 3) == 3  # the margin is the spread: the steps measured suffice
    assert steps_to_separate(0.10, 0.05, 3) == 12  # half the margin: four times the runs
    assert steps_to_separate(0.10, 0.20, 4) == 1
    assert steps_to_separate(0.09, 0.02, None) == 21  # one pass (hippie-ds profile): 1 x 4.5^2, rounded up
    assert steps_to_separate(None, 0.05, 3) is None and steps_to_separate(0.1, 0.0, 3) is None


def test_predictions_closer_than_the_planners_error_are_equal():
    """A margin of float noise (two cuts the simulator puts 1e-12 apart) asks for no absurd step
    count: under MIN_MARGIN no profiling length separates them."""
    from hippie_ds.planner.noise import MIN_MARGIN

    assert steps_to_separate(0.04, 1e-12, None) is None
    assert steps_to_separate(0.04, MIN_MARGIN * 0.99, None) is None
    assert steps_to_separate(0.04, MIN_MARGIN, None) == 64


def _profile(spread: float, steps: int | None) -> Profile:
    layers = [
        LayerProfile(
            name="Embedding", forward=0.3 * MS, backward=0.6 * MS, output_bytes=1e6, param_bytes=1e7, spread=spread
        )
    ]
    layers += [
        LayerProfile(
            name="Block",
            forward=(1 + 0.05 * (i % 3)) * MS,
            backward=2 * MS,
            output_bytes=1e6,
            param_bytes=1e7,
            spread=spread,
        )
        for i in range(9)
    ]
    return Profile(model="blocks", batch_size=4, layers=layers, steps=steps)


def test_the_plan_prints_the_steps_its_margin_needs_and_hippie_profile_takes_them():
    plan = make_plan(
        _profile(0.3, 3),
        parse_cluster("1x2,16GB,10Gbit"),
        16,
        depths=[2],
        micro_batch_sizes=[4],
        schedules=["1f1b"],
        baselines=False,
    )
    assert plan.profile_steps == 3 and plan.candidates and plan.profile_spread == pytest.approx(0.3)
    steps, margin = separating_steps(plan)
    nearest = min(abs(c.step_time / plan.prediction.step_time - 1) for c in plan.candidates)
    assert margin == pytest.approx(nearest) and 0 < margin < 0.3
    assert steps == steps_to_separate(0.3, margin, 3) and steps > 3
    text = format_summary(plan)
    assert (
        f"profiling steps that would separate the plan from its nearest candidate ({margin:.1%} apart): {steps} "
        f"('hippie': {{'profile': {{'steps': {steps}}}}}; this profile measured 3)" in text
    )
    assert ProfileConfig(out="profile.yaml", steps=steps).steps == steps  # the in-place profiler accepts it
    # twice the profile's steps at the same spread and margin: twice the steps to ask for
    again = make_plan(
        _profile(0.3, 6),
        parse_cluster("1x2,16GB,10Gbit"),
        16,
        depths=[2],
        micro_batch_sizes=[4],
        schedules=["1f1b"],
        baselines=False,
    )
    assert separating_steps(again)[0] == steps_to_separate(0.3, margin, 6) >= 2 * steps - 1
