"""python -m tools.bench dilation's pure parts: the fit T(D) = T_inf + h / D, the smallest D within
5% of T_inf, its report, and the options it gives the scaling study."""

import pytest

from tools.bench.studies.dilation import fit_dilation, parse_args, smallest_dilation, study_args
from tools.bench.studies.dilation_report import report


def test_fit_recovers_the_line_and_the_smallest_dilation():
    fit = fit_dilation([(d, 1.5 + 4.0 / d) for d in (4, 8, 16, 32)])
    assert fit["t_inf"] == pytest.approx(1.5) and fit["h"] == pytest.approx(4.0)
    assert fit["points"][0]["excess"] == pytest.approx(1.0 / 1.5)
    other = fit_dilation([(d, 2.0 + 1.0 / d) for d in (4, 8, 16, 32)])
    # h / D <= 5% T_inf: 4 / D <= 0.075 needs D >= 53.3 (none measured); 1 / D <= 0.1 needs D >= 10
    assert smallest_dilation({"a": other}) == 16
    assert smallest_dilation({"a": other, "b": fit}) is None
    assert smallest_dilation({"a": other}, within=0.5) == 4


def test_study_options_and_report(tmp_path):
    own, rest = parse_args(["--dilations", "16,8", "--out", str(tmp_path), "--steps", "2"])
    a = study_args(own, rest, 8.0, tmp_path / "D8")
    assert a.node_counts == [4] and a.dilate == 8.0 and a.no_single and a.link_efficiency_given and a.steps == 2
    with pytest.raises(SystemExit):
        parse_args(["--dilations", "16"])
    fits = {"1f1b": fit_dilation([(8, 1.2), (16, 1.1)])}
    md = report(
        {
            "fits": fits,
            "nodes": 4,
            "command": "c",
            "within": 0.05,
            "smallest_dilation": None,
            "per_dilation": {
                "8": {
                    "rows": {"1f1b": {"runqueue_wait_share_max": 0.02}},
                    "fixed_plan": None,
                    "load_average": [1.0, 1.0, 1.0],
                },
                "16": {"rows": {}, "fixed_plan": {"same_configuration": True, "same_recomputation": False}},
            },
        }
    )
    assert "T_inf" in md and "1.000" in md and "re-computed layers differ" in md and "none of those" in md


def test_the_plans_run_at_every_d_and_the_report_gives_t_of_d_per_row(tmp_path):
    own, rest = parse_args(["--out", str(tmp_path)])
    a = study_args(own, rest, 16.0, tmp_path / "D16")
    assert a.schedule_list == ["1f1b", "planned", "planned-throughput"]  # both planned columns, each D
    assert a.max_dilate == 16.0  # T(D) at every D: the scaling study reruns no row at a larger D here
    fits = {
        "1f1b": fit_dilation([(8, 1.5 + 1 / 8), (16, 1.5 + 1 / 16)]),
        "planned-throughput": fit_dilation([(8, 1.0 + 2 / 8), (16, 1.0 + 2 / 16)]),
    }
    per_row = {n: smallest_dilation({n: f}) for n, f in fits.items()}
    assert per_row == {"1f1b": 16, "planned-throughput": None}  # 2 / 16 is 12.5% of 1.0
    row = {"runqueue_wait_share_max": 0.01}
    md = report(
        {
            "fits": fits,
            "nodes": 4,
            "command": "c",
            "within": 0.05,
            "smallest_dilation": None,
            "smallest_dilation_per_row": per_row,
            "per_dilation": {
                "8": {"rows": {"1f1b": row, "planned-throughput": row, "planned": row}},
                "16": {
                    "rows": {"1f1b": row},
                    "fixed_plan": {
                        "planned": {"same_configuration": True, "same_recomputation": True},
                        "planned-throughput": {"same_configuration": False, "same_recomputation": False},
                    },
                },
            },
        }
    )
    assert "| planned (throughput) | - | - | 1.000 | 2.00 | +25.0% | +12.5% | - |" in md
    assert "| 1F1B (stock DeepSpeed) | - | - | 1.500 | 1.00 | +8.3% | +4.2% | 16 |" in md
    assert "| planned (ME) | - | - | - | - | - | - | - |" in md  # measured at one D only: no line
    assert "planned (throughput) at D = 16: configuration DIFFERS" in md
