"""Golden files: every built-in schedule's compiled streams at 4 stages x 8 micro-batches in the
compact notation of ``CompiledSchedule.compact`` (tests/golden/NAME-K4-M8.txt), and the
zero-bubble schedules' at 4 stages x 2 micro-batches (fewer micro-batches than stages, as stock
1F1B runs them). A change to the compiler or a schedule file that moves an op shows up here as a
readable diff; regenerate with ``UPDATE_GOLDEN=1 pytest tests/schedules/test_golden_schedules.py`` after
checking the diff is intended."""

import os
from pathlib import Path

import pytest

from hippie_ds.schedules import available, compile as compile_schedule

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SHAPES = [(name, 4, 8) for name in available()] + [("zb-h1", 4, 2), ("hippie-zb", 4, 2), ("zb-v", 4, 2)]


@pytest.mark.parametrize("name,stages,micro_batches", SHAPES)
def test_compiled_streams_match_golden(name, stages, micro_batches):
    text = compile_schedule(name, stages, micro_batches).compact()
    path = GOLDEN / f"{name}-K{stages}-M{micro_batches}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text()


def test_every_golden_file_is_a_builtin_schedule():
    assert sorted(p.name for p in GOLDEN.glob("*.txt")) == sorted(f"{n}-K{k}-M{m}.txt" for n, k, m in SHAPES)
