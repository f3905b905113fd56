"""python -m tools.bench, its rounds: the run order rotated per round, the run plan with rounds,
rounds combined, the per-round ratios and their spread (the "real difference" rule), scaling
efficiency per round. Pure: no processes."""

import pytest

from bench_records import rounds_runs, run_record
from tools.bench import cli as bench


def test_round_orders_rotate():
    # stock 1F1B first in round 0; round r starts at schedule r mod S
    assert bench.round_orders(["dp", "1f1b", "hippie"], 4) == [
        ["1f1b", "dp", "hippie"],
        ["dp", "hippie", "1f1b"],
        ["hippie", "1f1b", "dp"],
        ["1f1b", "dp", "hippie"],
    ]
    assert bench.round_orders(["hippie"], 2) == [["hippie"], ["hippie"]]
    assert bench.round_orders(["dp", "1f1b"], 1) == [["1f1b", "dp"]]


def test_run_plan_with_rounds():
    a = bench.parse_args(["--schedules", "dp,1f1b,hippie", "--rounds", "2", "--no-single"])
    jobs = bench.run_plan(a)
    # each round: every schedule on two nodes, then on one node, in the round's order
    assert [j["dir"] for j in jobs] == [
        "two_nodes/1f1b/round0",
        "two_nodes/dp/round0",
        "two_nodes/hippie/round0",
        "one_node/1f1b/round0",
        "one_node/dp/round0",
        "one_node/hippie/round0",
        "two_nodes/dp/round1",
        "two_nodes/hippie/round1",
        "two_nodes/1f1b/round1",
        "one_node/dp/round1",
        "one_node/hippie/round1",
        "one_node/1f1b/round1",
    ]
    assert [j["round"] for j in jobs] == [0] * 6 + [1] * 6
    assert bench.config_record(a)["round_orders"] == [["1f1b", "dp", "hippie"], ["dp", "hippie", "1f1b"]]
    # the one-device run once, at the end
    a = bench.parse_args(["--schedules", "dp,1f1b", "--rounds", "2"])
    assert [j["dir"] for j in bench.run_plan(a)][-2:] == ["one_node/1f1b/round1", "one_device/dp"]


def test_combine_rounds():
    def run(m, steps):
        return {
            "median_step_s": m,
            "samples_per_step": 32,
            "throughput_samples_s": 32 / m,
            "step_times_s": steps,
            "timed_steps": len(steps),
            "memory_per_rank": {"0": {"m": m}},
            "prediction": {"step_time": 1.1, "error": (1.1 - m) / m},
        }

    r = bench.combine_rounds([run(1.0, [1.0, 1.0]), run(1.4, [1.4]), None, run(1.2, [1.2, 1.2])])
    assert r["median_step_s"] == pytest.approx(1.2) and r["throughput_samples_s"] == pytest.approx(32 / 1.2)
    assert r["round_median_step_s"] == [1.0, 1.4, None, 1.2] and r["rounds"] == 4
    assert (r["median_step_s_min"], r["median_step_s_max"]) == (1.0, 1.4)
    assert r["throughput_samples_s_min"] == pytest.approx(32 / 1.4)
    assert r["throughput_samples_s_max"] == pytest.approx(32.0)
    assert r["step_times_s"] == [1.0, 1.0, 1.4, 1.2, 1.2] and r["timed_steps"] == 5
    assert r["detail_round"] == 3 and r["memory_per_rank"] == {"0": {"m": 1.2}}  # the median round's details
    assert r["prediction"]["error"] == pytest.approx((1.1 - 1.2) / 1.2)
    # even number of rounds: median of the two middle ones; details from the lower median
    r = bench.combine_rounds([run(1.0, [1.0]), run(2.0, [2.0])])
    assert r["median_step_s"] == pytest.approx(1.5) and r["detail_round"] == 0
    # one round: exactly that run's figures (what --rounds 1 gave before rounds existed)
    one = run(1.3, [1.2, 1.3, 1.4])
    r = bench.combine_rounds([one])
    assert {k: r[k] for k in one} == one and r["rounds"] == 1
    assert bench.combine_rounds([None, None]) is None


def test_round_ratio_statistics():
    rr = bench.round_ratios([12.0, 10.0, None, 9.0], [10.0, 10.0, 8.0, 10.0])
    assert rr["rounds"][2] is None and rr["n"] == 3
    assert [rr["rounds"][i] for i in (0, 1, 3)] == pytest.approx([1.2, 1.0, 0.9])
    assert rr["median"] == pytest.approx(1.0) and rr["min"] == pytest.approx(0.9) and rr["max"] == pytest.approx(1.2)
    assert bench.spread_excludes(1.05, 1.2) is True and bench.spread_excludes(0.9, 1.2) is False
    assert bench.spread_excludes(0.8, 0.99) is True and bench.spread_excludes(None, 1.2) is None
    assert bench.ranges_overlap((1, 2), (2, 3)) is True and bench.ranges_overlap((1, 2), (2.5, 3)) is False
    assert bench.ranges_overlap((1, None), (2, 3)) is None


def test_summarize_per_round_ratios_and_real_rule():
    # The machine drifts: round 1 is slow for everybody. Per round, hippie beats 1F1B by 20%,
    # which a ratio of medians taken over rounds mixed together would not show as cleanly.
    runs = rounds_runs(
        {"dp": [20.0, 10.0, 19.0], "1f1b": [16.0, 8.0, 15.0], "hippie": [19.2, 9.6, 18.0], "gpipe": [17.0, 7.6, 15.5]}
    )
    s = bench.summarize(runs)["schedules"]
    h, g, f, dp = s["hippie"], s["gpipe"], s["1f1b"], s["dp"]
    assert h["ratio_to_1f1b_rounds"] == pytest.approx([1.2, 1.2, 1.2])
    assert h["ratio_to_1f1b"] == pytest.approx(1.2) and h["real_vs_1f1b"] is True
    # gpipe: 1.0625, 0.95, 1.033 -> spread includes 1.0: not real
    assert g["ratio_to_1f1b_min"] == pytest.approx(0.95) and g["ratio_to_1f1b_max"] == pytest.approx(17 / 16)
    assert g["ratio_to_1f1b"] == pytest.approx(15.5 / 15) and g["real_vs_1f1b"] is False
    assert f["ratio_to_1f1b"] == pytest.approx(1.0) and f["real_vs_1f1b"] is None
    # vs DP: throughput ranges over rounds. hippie [9.6, 19.2] overlaps dp's [10, 20]: not real,
    # although every round's ratio is below 1 (0.96, 0.96, 0.947)
    assert h["ratio_to_dp_max"] == pytest.approx(0.96) and h["real_vs_dp"] is False
    assert dp["real_vs_dp"] is None and dp["ratio_to_dp"] == pytest.approx(1.0)
    # ranges that do not overlap: real
    runs = rounds_runs({"dp": [20.0, 21.0], "1f1b": [10.0, 11.0]})
    s = bench.summarize(runs)["schedules"]
    assert s["1f1b"]["real_vs_dp"] is True and s["1f1b"]["ratio_to_dp_rounds"] == pytest.approx([0.5, 11 / 21])
    # one round: no spread to judge by -> nothing marked real
    s = bench.summarize(rounds_runs({"dp": [20.0], "1f1b": [10.0], "hippie": [15.0]}))["schedules"]
    assert s["hippie"]["ratio_to_1f1b"] == pytest.approx(1.5) and s["hippie"]["real_vs_1f1b"] is None
    assert s["hippie"]["real_vs_dp"] is None


def test_scaling_efficiency_per_round():
    """With one-node runs in rounds, the scaling 1->2 nodes is taken per round (runs of the same
    round) with its spread; the report shows it and no longer calls the one-node runs single."""

    def run(thr_rounds):
        med = sorted(thr_rounds)[len(thr_rounds) // 2]
        return {
            **run_record(med, 100e6),
            "rounds": len(thr_rounds),
            "round_throughput_samples_s": thr_rounds,
            "throughput_samples_s_min": min(thr_rounds),
            "throughput_samples_s_max": max(thr_rounds),
        }

    runs = {
        "two_nodes": {"1f1b": run([18.0, 16.0, 20.0])},
        "one_node": {"1f1b": run([10.0, 10.0, 10.0])},
        "one_device": {"dp": run_record(6.0, 100e6)},
    }
    s = bench.summarize(runs)["schedules"]["1f1b"]
    assert s["scaling_efficiency_rounds"] == pytest.approx([0.9, 0.8, 1.0])
    assert s["scaling_efficiency"] == pytest.approx(0.9)
    assert (s["scaling_efficiency_min"], s["scaling_efficiency_max"]) == pytest.approx((0.8, 1.0))
    from tools.bench.report import single_runs_note

    note = single_runs_note({"runs": runs})
    assert "one-device run" in note and "one-node" not in note
