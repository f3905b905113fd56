"""Time to accuracy (tools/bench/time_to_accuracy.py) and the convergence tool's staleness variants:
pure functions over runs' metrics, no processes."""

import json
from pathlib import Path

import pytest

from tools.bench import convergence
from tools.bench import time_to_accuracy as tta


def run(final, evals, seed=0):
    return {"seed": seed, "final": {"loss": final}, "eval": [{"step": s, "loss": v} for s, v in evals]}


def test_target_and_first_step_at_or_below_it():
    assert tta.target_loss([1.0, 2.0]) == pytest.approx(1.515)
    curve = [{"step": 100, "loss": 2.0}, {"step": 200, "loss": 1.5}, {"step": 300, "loss": 1.2}]
    assert tta.steps_to_target(curve, 1.5) == 200
    assert tta.steps_to_target(curve, 1.0) is None


def times(link, *rounds):
    return tta.StepTimes(link, [dict(r) for r in rounds])


def test_summary_wall_time_and_not_reached():
    runs = {
        "dp": [run(1.00, [(100, 1.2), (200, 1.0)]), run(2.00, [(100, 2.2), (200, 2.0)], seed=1)],
        "fast": [run(0.99, [(100, 1.0), (200, 0.99)]), run(2.00, [(100, 2.1), (200, 2.0)], seed=1)],
        "stale": [run(1.10, [(100, 1.3), (200, 1.1)]), run(2.00, [(100, 2.2), (200, 2.0)], seed=1)],
    }
    out = tta.summarize(runs, "dp", [times("1gbit", {"dp": 2.0, "fast": 1.0, "stale": 1.0})])
    assert out["targets_per_seed"] == {0: pytest.approx(1.01), 1: pytest.approx(2.02)}  # paired by seed
    assert out["target_loss"] == pytest.approx(1.515)
    rows = out["rows"]
    assert rows["dp"]["steps_per_seed"] == [200, 200] and rows["dp"]["links"]["1gbit"]["wall_s_mean"] == 400
    assert rows["fast"]["steps_per_seed"] == [100, 200] and rows["fast"]["steps_mean"] == 150
    fast = rows["fast"]["links"]["1gbit"]
    assert fast["wall_s_mean"] == 150 and fast["wall_vs_baseline"] == pytest.approx(0.375)
    assert "vs_reference" not in fast  # no 1f1b run: nothing to compare with
    assert rows["stale"]["reached"] == 1 and rows["stale"]["steps_mean"] is None
    assert "wall_s_mean" not in rows["stale"]["links"]["1gbit"]
    table = "\n".join(tta.markdown("x", out, "dp"))
    assert "not reached by 1 of 2 seeds" in table and "| 150.0 (100.0-200.0) |" in table


def test_ratio_to_stock_1f1b_per_round_and_per_link():
    """Wall-time ratio = steps ratio x the step ratio of each round; real only when every round's
    ratio is on the same side of 1."""
    runs = {
        "dp": [run(1.0, [(100, 1.2), (200, 1.0)])],
        "1f1b": [run(1.0, [(100, 1.2), (200, 1.0)])],
        "hippie": [run(1.0, [(100, 1.2), (200, 1.0)])],
        "slow": [run(0.9, [(100, 1.0), (200, 0.9)])],
    }
    fast_link = times("1gbit", {"1f1b": 1.0, "hippie": 0.9, "slow": 2.4}, {"1f1b": 1.0, "hippie": 1.1, "slow": 2.2})
    slow_link = times(
        "250mbit", {"1f1b": 2.0, "hippie": 1.0}, {"1f1b": 2.0, "hippie": 1.2}, {"1f1b": 2.0, "hippie": 1.4}
    )
    out = tta.summarize(runs, "dp", [fast_link, slow_link])
    assert out["links"] == ["1gbit", "250mbit"]
    hippie = out["rows"]["hippie"]["links"]
    assert hippie["1gbit"]["vs_reference"] == pytest.approx(1.0)
    assert hippie["1gbit"]["vs_reference_range"] == [pytest.approx(0.9), pytest.approx(1.1)]
    assert not hippie["1gbit"]["vs_reference_real"]
    assert hippie["250mbit"]["vs_reference"] == pytest.approx(0.6) and hippie["250mbit"]["vs_reference_real"]
    slow = out["rows"]["slow"]["links"]["1gbit"]  # half the steps at 2.2-2.4x the step: slower
    assert slow["vs_reference_range"] == [pytest.approx(1.1), pytest.approx(1.2)] and slow["vs_reference_real"]
    table = "\n".join(tta.markdown("x", out, "dp"))
    assert "0.60x [0.50, 0.70] **real**" in table and "1.00x [0.90, 1.10] |" in table


def test_a_run_the_bench_measured_under_its_own_label_is_timed_by_it():
    """2bw:extrapolate-made+ef=0.5 by its own bench run (error feedback's extra work); a variant the
    bench did not measure (2bw:adam) by its schedule's."""
    link = times(
        "1gbit",
        {"1f1b": 1.0, "2bw": 0.8, "2bw:extrapolate-made+ef=0.5": 0.9},
        {"1f1b": 1.0, "2bw": 0.8, "2bw:extrapolate-made+ef=0.5": 1.1},
    )
    assert link.timed_as("2bw:extrapolate-made+ef=0.5") == "2bw:extrapolate-made+ef=0.5"
    assert link.timed_as("2bw:adam") == "2bw" and link.timed_as("2bw") == "2bw"
    runs = {
        name: [run(1.0, [(100, 1.2), (200, 1.0)])] for name in ("dp", "1f1b", "2bw:adam", "2bw:extrapolate-made+ef=0.5")
    }
    rows = tta.summarize(runs, "dp", [link])["rows"]
    ef, adam = rows["2bw:extrapolate-made+ef=0.5"]["links"]["1gbit"], rows["2bw:adam"]["links"]["1gbit"]
    assert ef["median_step_s"] == pytest.approx(1.0) and ef["vs_reference_range"] == [
        pytest.approx(0.9),
        pytest.approx(1.1),
    ]
    assert adam["timed_as"] == "2bw" and adam["vs_reference"] == pytest.approx(0.8) and adam["vs_reference_real"]


def test_price_gives_a_committed_summary_new_step_times():
    """A results.json's time_to_accuracy (seeds as JSON keys, no links) priced anew: the same as
    summarizing the runs with those step times; the input is left as it was."""
    runs = {
        "dp": [run(1.0, [(100, 1.2), (200, 1.0)])],
        "1f1b": [run(1.0, [(100, 1.2), (200, 1.0)])],
        "2bw": [run(0.9, [(100, 1.0), (200, 0.9)])],
    }
    link = times("250mbit", {"dp": 3.0, "1f1b": 2.0, "2bw": 1.0}, {"dp": 3.0, "1f1b": 2.0, "2bw": 1.5})
    committed = json.loads(json.dumps(tta.summarize(runs, "dp", None)))
    priced = tta.price(committed, "dp", [link])
    assert committed["links"] == [] and committed["rows"]["2bw"]["links"] == {}
    assert priced["links"] == ["250mbit"] and priced["targets_per_seed"] == {"0": pytest.approx(1.01)}
    assert priced["rows"] == json.loads(json.dumps(tta.summarize(runs, "dp", [link])))["rows"]
    assert priced["rows"]["2bw"]["links"]["250mbit"]["vs_reference_range"] == [
        pytest.approx(0.25),
        pytest.approx(0.375),
    ]


def test_step_times_from_bench_results_files(tmp_path):
    f = tmp_path / "results.json"
    f.write_text(
        json.dumps(
            {
                "config": {"link": "tbf 1gbit"},
                "runs": {
                    "two_nodes": {"dp": {"median_step_s": 0.5}, "hippie": {"median_step_s": 0.4}},
                    "one_node": {"dp": {"median_step_s": 9.0}},
                },
            }
        )
    )
    [one] = tta.load_step_times(f)
    assert one.link == "1gbit" and one.median("dp") == 0.5 and one.median("hippie") == 0.4
    g, h = tmp_path / "r2.json", tmp_path / "r3.json"
    g.write_text(
        json.dumps(
            {
                "config": {"link": "tbf 1gbit"},
                "runs": {"two_nodes": {"dp": {"median_step_s": 0.7}, "hippie": {"median_step_s": 0.3}}},
            }
        )
    )
    h.write_text(
        json.dumps(
            {
                "config": {"link": "tbf 250mbit"},
                "runs": {
                    "two_nodes": {
                        "dp": {"median_step_s": 0.6, "round_median_step_s": [0.6, 0.8, 0.5]},
                        "hippie": {"median_step_s": 0.3, "round_median_step_s": [0.3, None, 0.2]},
                    }
                },
            }
        )
    )
    fast, slow = tta.load_step_times(f"{f}+{g}+{h}")
    assert fast.link == "1gbit" and fast.median("dp") == pytest.approx(0.6)  # median over the files' rounds
    assert slow.link == "250mbit" and slow.median("dp") == 0.6 and slow.median("hippie") == pytest.approx(0.25)
    assert slow.round_ratios("hippie", "dp") == [pytest.approx(0.5), pytest.approx(0.4)]  # rounds where both ran
    assert tta.bench_name("hippie:none") == "hippie"
    f.write_text(json.dumps({"runs": {}}))
    with pytest.raises(SystemExit, match="no 'two_nodes' runs"):
        tta.load_step_times(f)


def test_staleness_variant_names_set_the_config(tmp_path):
    assert convergence.split_name("hippie:extrapolate=1.5") == ("hippie", {"method": "extrapolate", "coefficient": 1.5})
    assert convergence.split_name("hippie") == ("hippie", None)
    assert convergence.split_name("2bw:extrapolate-made+ef=0.5") == (
        "2bw",
        {"method": "extrapolate-made", "error_feedback": 0.5},
    )
    assert convergence.split_name("2bw:none+dc=300") == ("2bw", {"method": "none", "delay_compensation": 300.0})
    assert convergence.split_name("2bw:none+dc=2+ef=0.5") == (
        "2bw",
        {"method": "none", "delay_compensation": 2.0, "error_feedback": 0.5},
    )
    with pytest.raises(SystemExit, match=r"\+dc=D"):
        convergence.split_name("2bw:none+dc")
    assert convergence.split_layers("hippie@1:none") == ("hippie:none", 1)
    assert convergence.split_layers("hippie") == ("hippie", None)
    assert convergence.split_layers("hippie@auto") == ("hippie", "auto")
    with pytest.raises(SystemExit, match="--costs"):  # 'auto' without costs to choose from
        convergence.make_config("hippie@auto", Path(convergence.REPO / "configs"), 1e-3, "decay", 100)
    auto = convergence.make_config(
        "hippie@auto", Path(convergence.REPO / "configs"), 1e-3, "decay", 100, costs="costs.json"
    )["hippie"]
    assert auto["deferred_layers"] == "auto" and auto["costs"].endswith("costs.json")
    assert convergence.example_files("gpt=a.json,vgg=b.json", "--costs") == {"gpt": "a.json", "vgg": "b.json"}
    with pytest.raises(SystemExit, match="--costs: unknown example"):
        convergence.example_files("bert=a.json", "--costs")
    assert (
        convergence.make_config("hippie@2", Path(convergence.REPO / "configs"), 1e-3, "decay", 100)["hippie"][
            "deferred_layers"
        ]
        == 2
    )
    config = convergence.make_config("hippie:none", Path(convergence.REPO / "configs"), 1e-3, "decay", 100)
    assert config["pipeline"]["schedule"] == "hippie" and config["hippie"]["staleness"] == {"method": "none"}
    assert (
        convergence.run_dir(tmp_path, "gpt", "hippie:extrapolate=1.5", 0, [0])
        == tmp_path / "gpt" / "hippie_extrapolate1.5"
    )


def test_the_bench_sets_a_labels_staleness_beside_the_schedules_config(tmp_path):
    """The cluster bench's rank worker reads ``2bw:extrapolate-made+ef=0.5`` as schedule 2bw (its
    configs/2bw.json section kept) with that ``hippie.staleness``; a plain name sets none."""
    from argparse import Namespace
    from tools.bench.engines import schedule_config

    a = Namespace(schedule_configs="configs")
    name, hippie = schedule_config(a, "2bw:extrapolate-made+ef=0.5")
    assert name == "2bw" and hippie["placement"] == "pipeline_in_node"
    assert hippie["staleness"] == {"method": "extrapolate-made", "error_feedback": 0.5}
    assert "staleness" not in schedule_config(a, "2bw")[1]
    assert schedule_config(Namespace(schedule_configs=None), "hippie@all:none") == (
        "hippie",
        {"deferred_layers": "all", "staleness": {"method": "none"}},
    )
