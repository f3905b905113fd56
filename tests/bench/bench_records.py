"""What the bench's pure tests (test_bench.py, test_bench_rounds.py) build their runs from."""


def run_record(thr, rss, saved=10e6, state=100e6):
    return {
        "throughput_samples_s": thr,
        "mean_peak_training_rss_bytes": rss,
        "mean_peak_saved_bytes": saved,
        "mean_state_bytes": state,
    }


def rounds_runs(thr_rounds: dict) -> dict:
    """Two-node runs of the given per-round throughputs (samples/s), with their medians and spreads."""
    two = {}
    for name, thrs in thr_rounds.items():
        meds = [32 / t for t in thrs]
        med = sorted(meds)[len(meds) // 2]
        two[name] = {
            **run_record(32 / med, 200e6),
            "rounds": len(thrs),
            "round_throughput_samples_s": thrs,
            "round_median_step_s": meds,
            "median_step_s": med,
            "median_step_s_min": min(meds),
            "median_step_s_max": max(meds),
            "throughput_samples_s_min": min(thrs),
            "throughput_samples_s_max": max(thrs),
        }
    return {"two_nodes": two}
