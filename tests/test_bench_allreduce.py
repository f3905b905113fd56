"""tools/bench_allreduce.py's summary: pure, no processes (the tool itself needs root and runs the
emulated cluster)."""
import pytest

import bench_allreduce


def test_efficiency_of_one_pair_and_of_two_sharing_the_link():
    mb = 25_000_000
    records = [{"rank": 0, "bytes": mb, "one": [0.21, 0.20, 0.22], "two": [0.41, 0.40, 0.42]},
               {"rank": 1, "bytes": mb, "one": [None, None, None], "two": [0.40, 0.41, 0.39]},  # pair 1 idles
               {"rank": 2, "bytes": mb, "one": [0.21, 0.20, 0.22], "two": [0.41, 0.40, 0.42]}]
    row = bench_allreduce.summarize(records, "1gbit")
    assert row["one_pair_s"] == pytest.approx(0.21) and row["two_pairs_s"] == pytest.approx(0.41)
    assert row["one_pair_efficiency"] == pytest.approx(25e6 / 125e6 / 0.21)  # 0.95
    assert row["two_pairs_efficiency"] == pytest.approx(2 * 25e6 / 125e6 / 0.41)  # two pairs share the link
    assert "| 1gbit | 0.210 | 0.95 | 0.410 | 0.98 |" in bench_allreduce.report([row], 25)
