"""Cost files from measurements (hippie_ds.schedules.measured_costs, ``hippie-ds costs``): which
instruction's time becomes which cost, warm-up steps left out, a profile cut at boundaries. Pure;
the engine's own timelines go through it in test_engine_distributed's partial-deferral test."""

import pytest

from hippie_ds.cli import main as cli
from hippie_ds.planner import save_profile
from hippie_ds.planner.profile import LayerProfile, Profile
from hippie_ds.schedules import measured_costs as mc
from hippie_ds.schedules.costs import Costs


def _timeline(stage, steps, durations, param_bytes=0.0):
    """A rank's timeline: each step runs each (kind, seconds) back to back."""
    events, t = [], 0.0
    for step in range(steps):
        for kind, secs in durations(step):
            events.append(
                {
                    "name": kind,
                    "kind": kind,
                    "category": "compute",
                    "start": t,
                    "end": t + secs,
                    "step": step,
                    "micro_batch": 0,
                }
            )
            t += secs
        events.append(
            {
                "name": "allreduce(grads)",
                "kind": "AllReduceInFlight",
                "category": "comm",
                "start": 0.0,
                "end": t,
                "step": step,
                "micro_batch": None,
            }
        )
    return {"stage": stage, "param_bytes": param_bytes, "events": events}


def test_timelines_become_stage_costs_without_the_warm_up_step():
    slow_first = lambda step: 10.0 if step == 0 else 1.0  # noqa: E731
    first = _timeline(
        0,
        3,
        lambda s: [
            ("ForwardPass", 0.01 * slow_first(s)),
            ("BackwardPass", 0.03),
            ("ISendActivation", 0.001),
            ("StartAllReduce", 0.002),
            ("StageOptimizerStep", 0.004),
            ("CopyGradsToBuffer", 0.001),
        ],
        400.0,
    )
    last = _timeline(1, 3, lambda s: [("ForwardBackwardPass", 0.08 * slow_first(s)), ("OptimizerStep", 0.005)], 100.0)
    costs = mc.costs_from_timelines([first, last], {"data_parallel": 2, "allreduce_bandwidth": 1e8})
    s0, s1 = costs.stages
    assert (s0.forward, s0.backward, s0.send_issue_time, s0.allreduce_issue_time) == pytest.approx(
        (0.01, 0.03, 0.001, 0.002)
    )
    assert s0.optimizer_time == pytest.approx(0.005) and s0.param_bytes == 400.0
    # the fused last stage is split by the other stage's forward share (1/4)
    assert (s1.forward, s1.backward, s1.optimizer_time) == pytest.approx((0.02, 0.06, 0.005))
    assert costs.comm.data_parallel == 2
    with pytest.raises(ValueError, match="no instruction left after skipping 3"):
        mc.costs_from_timelines([first, last], skip_steps=3)
    with pytest.raises(ValueError, match=r"stages \[1\]"):
        mc.costs_from_timelines([last])


def test_a_split_backward_keeps_its_weight_part():
    tl = _timeline(0, 2, lambda s: [("ForwardPass", 0.01), ("BackwardInputPass", 0.02), ("BackwardWeightPass", 0.015)])
    (stage,) = mc.costs_from_timelines([tl], skip_steps=0).stages
    assert (stage.backward, stage.backward_weight) == pytest.approx((0.035, 0.015))


def test_profile_cut_at_boundaries_and_uniform(tmp_path):
    layers = [
        LayerProfile(
            name=f"l{i}", forward=0.001 * (i + 1), backward=0.002 * (i + 1), param_bytes=100.0 * i, output_bytes=8.0
        )
        for i in range(5)
    ]
    profile = Profile(
        model="m",
        batch_size=2,
        layers=layers,
        loss=LayerProfile(name="loss", forward=0.01, backward=0.02, saved_bytes=4.0),
    )
    costs = mc.costs_from_profile(profile, [0, 3, 5])
    assert [s.forward for s in costs.stages] == pytest.approx([0.006, 0.009 + 0.01])
    assert [s.param_bytes for s in costs.stages] == [300.0, 700.0]
    assert mc.uniform_boundaries(5, 2) == [0, 3, 5] and mc.uniform_boundaries(12, 5) == [0, 3, 6, 8, 10, 12]
    path = tmp_path / "profile.yaml"
    save_profile(profile, path)
    out = tmp_path / "costs.yaml"
    assert cli(["costs", "--profile", str(path), "--stages", "2", "--data-parallel", "4", "--out", str(out)]) == 0
    read = Costs.from_file(out)
    assert [s.backward for s in read.stages] == pytest.approx([s.backward for s in costs.stages])
    assert read.comm.data_parallel == 4
    assert cli(["costs", "--profile", str(path), "--boundaries", "0,x", "--out", str(out)]) == 2
    assert cli(["costs", "--profile", str(path), "--out", str(out)]) == 2
