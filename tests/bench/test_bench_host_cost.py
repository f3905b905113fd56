"""python -m tools.bench host-cost's arithmetic (the study itself is a bench: no timing here)."""

from tools.bench.studies.host_cost import report, summarize


def _raw():
    def recs(walls, cpus, n):
        return [{"round": r, "wall": w, "cpu": c, "instructions": n} for r, (w, c) in enumerate(zip(walls, cpus))]

    # two ranks; rank 1 is the slower one in round 0 for stock, rank 0 in round 1 for 1f1b
    return {
        "args": {"layers": 8, "width": 16, "micro_batches": 16, "steps": 1, "warmup": 0},
        "calls_per_instruction": {"stock": 14.0, "1f1b": 12.5},
        "ranks": [
            {"stock": recs([0.10, 0.10], [0.05, 0.05], 100), "1f1b": recs([0.11, 0.12], [0.05, 0.06], 100)},
            {"stock": recs([0.20, 0.10], [0.10, 0.04], 100), "1f1b": recs([0.10, 0.10], [0.05, 0.05], 100)},
        ],
    }


def test_ratios_are_taken_per_round_on_the_slowest_rank():
    s = summarize(_raw())
    assert s["per_round"]["stock"][0] == {"wall_us": 2000.0, "cpu_us": 1000.0}  # rank 1's 0.20 s / 100
    assert s["per_round"]["1f1b"][1] == {"wall_us": 1200.0, "cpu_us": 600.0}
    assert s["ratios"]["1f1b"]["wall_us"] == [1100.0 / 2000.0, 1200.0 / 1000.0]
    text = report(s, _raw(), "python -m tools.bench host-cost")
    assert "| `1f1b` |" in text and "0.875 (0.550-1.200)" in text and "`1f1b` 12.5" in text
