"""python -m tools.bench headline: README's headline table from a scaling study's results (pure), and
its figures block is the one tests/docs/test_doc_figures.py checks (every figure cited, a waited row no figure)."""

import json

import pytest

from tools.bench.studies.headline import END, START, main, model_table, splice


def _results():
    row = {
        "vs_1f1b": 1.712,
        "vs_1f1b_min": 1.6,
        "vs_1f1b_max": 1.8,
        "scaling": 0.97,
        "scaling_min": 0.95,
        "scaling_max": 0.99,
        "memory_bytes": 2.31e9,
        "me_vs_dp": 5.12,
        "runqueue_wait_share_max": 0.012,
        "waited_for_core": False,
    }
    stock = {**row, "vs_1f1b": 1.0, "vs_1f1b_min": None, "vs_1f1b_max": None, "me_vs_dp": 1.75}
    waited = {**row, "runqueue_wait_share_max": 0.259, "waited_for_core": True}
    return {
        "config": {"stages": 4, "dilation": 16.0, "link": "tbf 10mbit burst min", "emulate_scale": 1e-3},
        "summary": {"by_nodes": {"1": {}, "4": {"1f1b": stock, "hippie-1f1b": row, "planned": waited}}},
    }


def test_table_and_figures_block():
    lines = model_table(_results(), "docs/bench/scaling/vgg16/results.json", "VGG-16")
    text = "\n".join(lines)
    assert (
        "D = 16" in text
        and "10 Gbit/s between nodes" in text
        and "| hippie-1f1b | emulated | 16 | 1.71x (1.60-1.80) | 0.97 (0.95-0.99) | 2.31 | 5.12x | no (1.2%) |" in text
    )
    assert "| 1F1B (stock DeepSpeed) | emulated | 16 | 1.00x |" in text
    assert (
        "| planned (ME) | emulated | 16 | not a figure | - | - | - | **yes** (25.9%) |" in text
    )  # flagged: no figures
    assert (
        "hippie-1f1b | vs stock 1F1B | {summary.by_nodes.4.hippie-1f1b.vs_1f1b} "
        "{summary.by_nodes.4.hippie-1f1b.vs_1f1b_min} {summary.by_nodes.4.hippie-1f1b.vs_1f1b_max}" in text
    )
    assert "planned (ME) | memory" not in text


def test_splice_and_main(tmp_path):
    assert splice(f"a\n{START}\nold\n{END}\nb", "new") == f"a\n{START}\nnew\n{END}\nb"
    with pytest.raises(SystemExit):
        splice("no markers", "new")
    res = tmp_path / "results.json"
    res.write_text(json.dumps(_results()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{START}\n{END}\nrest\n")
    assert main(["--results", f"VGG-16={res}", "--readme", str(readme), "--picture", str(tmp_path / "h.png")]) == 0
    text = readme.read_text()
    assert "VGG-16, 4 nodes x 4" in text and "![ME against DP and scaling per column](h.png)" in text
    assert text.endswith("rest\n") and (tmp_path / "h.png").stat().st_size > 1000


def test_every_column_states_its_own_dilation():
    """A row rerun at a larger D (tools/bench/studies/row_dilation.py) names its D, cited from its row;
    rows before per-row D cite the job's."""
    res = _results()
    rows = res["summary"]["by_nodes"]["4"]
    rows["planned"] = {**rows["hippie-1f1b"], "dilation": 32.0, "me_vs_dp": 9.1}
    rows["1f1b"]["dilation"] = 16.0
    text = "\n".join(model_table(res, "r.json", "VGG-16"))
    assert "each column at its time dilation D" in text and "| schedule | kind | D |" in text
    assert "| planned (ME) | emulated | 32 | 1.71x (1.60-1.80) |" in text
    assert "planned (ME) | D | {summary.by_nodes.4.planned.dilation}" in text
    assert (
        "hippie-1f1b | D | {config.dilation}" in text
        and "1F1B (stock DeepSpeed) | D | {summary.by_nodes.4.1f1b.dilation}" in text
    )
