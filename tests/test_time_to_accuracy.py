"""Time to accuracy (tools/time_to_accuracy.py) and the convergence tool's staleness variants:
pure functions over runs' metrics, no processes."""
import json
from pathlib import Path

import pytest

import convergence
import time_to_accuracy as tta


def run(final, evals, seed=0):
    return {"seed": seed, "final": {"loss": final}, "eval": [{"step": s, "loss": v} for s, v in evals]}


def test_target_and_first_step_at_or_below_it():
    assert tta.target_loss([1.0, 2.0]) == pytest.approx(1.515)
    curve = [{"step": 100, "loss": 2.0}, {"step": 200, "loss": 1.5}, {"step": 300, "loss": 1.2}]
    assert tta.steps_to_target(curve, 1.5) == 200
    assert tta.steps_to_target(curve, 1.0) is None


def test_summary_wall_time_and_not_reached():
    runs = {"dp": [run(1.00, [(100, 1.2), (200, 1.0)]), run(2.00, [(100, 2.2), (200, 2.0)], seed=1)],
            "fast": [run(0.99, [(100, 1.0), (200, 0.99)]), run(2.00, [(100, 2.1), (200, 2.0)], seed=1)],
            "stale": [run(1.10, [(100, 1.3), (200, 1.1)]), run(2.00, [(100, 2.2), (200, 2.0)], seed=1)]}
    out = tta.summarize(runs, "dp", {"dp": 2.0, "fast": 1.0, "stale": 1.0})
    assert out["targets_per_seed"] == {0: pytest.approx(1.01), 1: pytest.approx(2.02)}  # paired by seed
    assert out["target_loss"] == pytest.approx(1.515)
    rows = out["rows"]
    assert rows["dp"]["steps_per_seed"] == [200, 200] and rows["dp"]["wall_s_mean"] == 400
    assert rows["fast"]["steps_per_seed"] == [100, 200] and rows["fast"]["steps_mean"] == 150
    assert rows["fast"]["wall_s_mean"] == 150 and rows["fast"]["wall_vs_baseline"] == pytest.approx(0.375)
    assert rows["stale"]["reached"] == 1 and rows["stale"]["steps_mean"] is None and "wall_s_mean" not in rows["stale"]
    table = "\n".join(tta.markdown("x", out, "dp"))
    assert "not reached by 1 of 2 seeds" in table and "0.38x" in table


def test_step_times_from_a_bench_results_file(tmp_path):
    f = tmp_path / "results.json"
    f.write_text(json.dumps({"runs": {"two_nodes": {"dp": {"median_step_s": 0.5}, "hippie": {"median_step_s": 0.4}},
                                      "one_node": {"dp": {"median_step_s": 9.0}}}}))
    assert tta.load_step_times(f) == {"dp": 0.5, "hippie": 0.4}
    g, h = tmp_path / "r2.json", tmp_path / "r3.json"
    g.write_text(json.dumps({"runs": {"two_nodes": {"dp": {"median_step_s": 0.7}, "hippie": {"median_step_s": 0.3}}}}))
    h.write_text(json.dumps({"runs": {"two_nodes": {"dp": {"median_step_s": 0.6}}}}))
    assert tta.load_step_times(f"{f}+{g}+{h}") == {"dp": 0.6, "hippie": 0.35}  # median over rounds
    assert tta.bench_name("hippie:none") == "hippie"
    f.write_text(json.dumps({"runs": {}}))
    with pytest.raises(SystemExit, match="no 'two_nodes' runs"):
        tta.load_step_times(f)


def test_staleness_variant_names_set_the_config(tmp_path):
    assert convergence.split_name("hippie:extrapolate=1.5") == ("hippie", {"method": "extrapolate", "coefficient": 1.5})
    assert convergence.split_name("hippie") == ("hippie", None)
    assert convergence.split_layers("hippie@1:none") == ("hippie:none", 1)
    assert convergence.split_layers("hippie") == ("hippie", None)
    assert convergence.make_config("hippie@2", Path(convergence.REPO / "configs"), 1e-3, "decay",
                                   100)["hippie"]["deferred_layers"] == 2
    config = convergence.make_config("hippie:none", Path(convergence.REPO / "configs"), 1e-3, "decay", 100)
    assert config["pipeline"]["schedule"] == "hippie" and config["hippie"]["staleness"] == {"method": "none"}
    assert convergence.run_dir(tmp_path, "gpt", "hippie:extrapolate=1.5", 0, [0]) == tmp_path / "gpt" / "hippie_extrapolate1.5"
