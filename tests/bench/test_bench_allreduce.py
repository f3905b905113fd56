"""``python -m tools.bench allreduce``'s summary (benchmarks/studies/allreduce.py): pure, no processes (the
study itself needs root and runs the emulated cluster)."""

import pytest

from tools.bench.studies import allreduce as bench_allreduce


def test_efficiency_of_one_pair_and_of_two_sharing_the_link():
    mb = 25_000_000
    records = [
        {
            "rank": 0,
            "bytes": mb,
            "one": [0.21, 0.20, 0.22],
            "two": [0.41, 0.40, 0.42],
            "one_cpu": [0.05, 0.04, 0.06],
            "two_cpu": [0.07, 0.08, 0.09],
            "one_machine_busy": [0.20, 0.30, 0.25],
            "two_machine_busy": [0.50, 0.40, 0.60],
        },
        {
            "rank": 1,
            "bytes": mb,
            "one": [None, None, None],
            "two": [0.40, 0.41, 0.39],  # pair 1 idles
            "one_cpu": [None, None, None],
            "two_cpu": [0.08, 0.08, 0.08],
        },
        {
            "rank": 2,
            "bytes": mb,
            "one": [0.21, 0.20, 0.22],
            "two": [0.41, 0.40, 0.42],
            "one_cpu": [0.05, 0.05, 0.05],
            "two_cpu": [0.08, 0.08, 0.08],
        },
    ]
    row = bench_allreduce.summarize(records, "1gbit")
    assert row["one_pair_s"] == pytest.approx(0.21) and row["two_pairs_s"] == pytest.approx(0.41)
    assert row["one_pair_efficiency"] == pytest.approx(25e6 / 125e6 / 0.21)  # 0.95
    assert row["two_pairs_efficiency"] == pytest.approx(2 * 25e6 / 125e6 / 0.41)  # two pairs share the link
    assert "| 1gbit | 0.210 | 0.95 | 0.410 | 0.98 |" in bench_allreduce.report([row], 25)


def test_cpu_cost_of_an_allreduce_per_rank_and_machine_wide():
    mb = 25_000_000
    records = [
        {
            "rank": 0,
            "bytes": mb,
            "one": [0.2],
            "two": [0.4],
            "one_cpu": [0.05],
            "two_cpu": [0.07],
            "one_machine_busy": [0.25],
            "two_machine_busy": [0.5],
        },
        {"rank": 1, "bytes": mb, "one": [None], "two": [0.4], "one_cpu": [None], "two_cpu": [0.09]},
        {"rank": 2, "bytes": mb, "one": [0.2], "two": [0.4], "one_cpu": [0.04], "two_cpu": [0.08]},
    ]
    row = bench_allreduce.summarize(records, "1gbit")
    assert row["one_pair_cpu_s"] == pytest.approx(0.045)  # the idle pair's ranks are not counted
    assert row["two_pairs_cpu_s"] == pytest.approx(0.08)
    assert (row["one_pair_machine_busy_s"], row["two_pairs_machine_busy_s"]) == (0.25, 0.5)  # rank 0's reading
    assert row["cpu_per_mb"] == pytest.approx(0.5 / 2 / 25)  # per core (one rank of each pair), per MB
    assert "| 1gbit | 0.045 | 0.250 | 0.080 | 0.500 | 10.00 |" in bench_allreduce.report([row], 25)
