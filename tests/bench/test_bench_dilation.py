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
    md = report({"fits": fits, "nodes": 4, "command": "c", "within": 0.05, "smallest_dilation": None,
                 "per_dilation": {"8": {"rows": {"1f1b": {"runqueue_wait_share_max": 0.02}}, "fixed_plan": None,
                                        "load_average": [1.0, 1.0, 1.0]},
                                  "16": {"rows": {}, "fixed_plan": {"same_configuration": True,
                                                                    "same_recomputation": False}}}})
    assert "T_inf" in md and "1.000" in md and "re-computed layers differ" in md and "none of those" in md
