"""docs/extending.md's worked op kind ("Adding an op kind"), tried as a reader would: its edits are
read from the page (each a code block under a line naming its file and the line it goes before or
after, found by that line's start, not by its number), applied to a copy of the package, and on
the copy, in a fresh interpreter, a schedule using the new kind compiles, validates and simulates,
and tests/schedules/test_op_table.py passes, its engine checks included. The edits touch at most three files;
the engine's edit goes to the ``HANDLERS`` table of adapter/stage/handlers.py."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## 2. Adding an op kind"
ENGINE_FILE = "hippie_ds/adapter/stage/handlers.py"
_EDIT = re.compile(
    r"^\*\*`(?P<path>[^`]+)`\*\*, (?P<where>before|after) the line starting `(?P<anchor>[^`]+)`:\n\n"
    r"```python\n(?P<code>.*?)\n```$",
    re.S | re.M,
)
_SCHEDULE = re.compile(r"^```yaml\n(?P<text>name: .*?)\n```$", re.S | re.M)


class Edit(NamedTuple):
    path: str
    before: bool  # before the anchor line, else after it
    anchor: str  # how the line starts (leading spaces aside)
    code: str


def section() -> str:
    text = (ROOT / "docs/extending.md").read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + len(SECTION))]


def edits(text: str) -> list[Edit]:
    return [Edit(m["path"], m["where"] == "before", m["anchor"], m["code"]) for m in _EDIT.finditer(text)]


def anchor_line(lines: list[str], edit: Edit) -> int | None:
    """The index of the one line that starts with the edit's anchor; None when none does."""
    hits = [i for i, line in enumerate(lines) if line.strip().startswith(edit.anchor)]
    assert len(hits) <= 1, f"{edit.path}: the anchor {edit.anchor!r} starts {len(hits)} lines, so it names none"
    return hits[0] if hits else None


def apply(edit: Edit, root: Path) -> bool:
    """Inserts the edit's block next to its anchor line (a top-level definition with the two blank
    lines that set it apart); False when the file has no such line."""
    path = root / edit.path
    lines = path.read_text().splitlines(keepends=True)
    at = anchor_line(lines, edit)
    if at is None:
        return False
    at += 0 if edit.before else 1
    gap = "\n\n" if edit.code.startswith(("def ", "class ", "@")) else ""
    path.write_text("".join(lines[:at]) + edit.code + "\n" + gap + "".join(lines[at:]))
    return True


def test_the_edits_are_read_and_anchored():
    found = edits(section())
    assert len(found) == 5, f"the worked example's edits (file, before/after, anchor, block): {found}"
    assert {e.path for e in found} == {"hippie_ds/schedules/ir.py", "hippie_ds/schedules/op_rules.py", ENGINE_FILE}
    for edit in found:
        assert anchor_line((ROOT / edit.path).read_text().splitlines(), edit) is not None, (
            f"{edit.path} has no line starting {edit.anchor!r}"
        )
    assert _SCHEDULE.search(section()), "the worked example shows a schedule file using the kind"


def test_the_edit_reader_rejects_an_ambiguous_anchor(tmp_path):
    (tmp_path / "f.py").write_text("x = 1\nx = 2\n")
    with pytest.raises(AssertionError, match="starts 2 lines"):
        apply(Edit("f.py", False, "x =", "y = 0"), tmp_path)
    assert not apply(Edit("f.py", False, "z =", "y = 0"), tmp_path)
    assert apply(Edit("f.py", True, "x = 2", "y = 0"), tmp_path)
    assert (tmp_path / "f.py").read_text() == "x = 1\ny = 0\nx = 2\n"


# Run on the copy, in its own interpreter: the new kind in a flush schedule and in a steady-state
# one (2bw with the op in its epilogue) compiles, validates, and simulates to the step time of the
# same schedule without it (the op takes no simulated time).
_CHECK = """
import sys
from pathlib import Path
import hippie_ds
from hippie_ds import schedules
from hippie_ds.schedules.costs import Costs
from hippie_ds.schedules.ir import OP_INFO, OpKind
from hippie_ds.schedules.op_rules import RULES
from hippie_ds.schedules.simulator import simulate
from hippie_ds.schedules.validator import check

copy = Path(sys.argv[1])
assert Path(hippie_ds.__file__).resolve().parent == copy / "hippie_ds", hippie_ds.__file__
kind = OpKind("empty_cache")
assert kind in OP_INFO and kind in RULES
costs = Costs.uniform(4, forward=1.0, backward=2.0, optimizer_time=0.5)
for path, plain in ((copy / "example.yaml", "1f1b"), (copy / "example-2bw.yaml", "2bw")):
    compiled = schedules.compile(str(path), 4, 8)
    assert all(any(op.kind is kind for op in compiled.ops(s)) for s in range(4)), compiled.compact()
    assert check(compiled) == [], check(compiled)
    ours, theirs = simulate(compiled, costs), simulate(schedules.compile(plain, 4, 8), costs)
    assert ours.step_time == theirs.step_time, (ours.step_time, theirs.step_time)
print("the example kind compiles, validates and simulates")
"""


def test_the_worked_example_adds_an_op_kind_in_three_files(tmp_path):
    text = section()
    found = edits(text)
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "hippie_ds", copy / "hippie_ds", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "schedules", copy / "schedules")  # the built-ins, where an uninstalled copy looks
    (copy / "tests" / "schedules").mkdir(parents=True)
    shutil.copy(ROOT / "tests/schedules/test_op_table.py", copy / "tests/schedules/test_op_table.py")
    (copy / "pytest.ini").write_text("[pytest]\n")  # the copy's own root: none of the suite's conftest
    applied = {e.path for e in found if apply(e, copy)}
    assert applied == {"hippie_ds/schedules/ir.py", "hippie_ds/schedules/op_rules.py", ENGINE_FILE}, applied
    touched = {e.path for e in found}
    assert len(touched) <= 3, f"the worked example touches {len(touched)} files: {sorted(touched)}"
    changed = {
        p.relative_to(copy).as_posix()
        for p in (copy / "hippie_ds").rglob("*.py")
        if p.read_text() != (ROOT / p.relative_to(copy)).read_text()
    }
    assert changed == applied, changed
    (copy / "example.yaml").write_text(_SCHEDULE.search(text)["text"] + "\n")
    spec = yaml.safe_load((ROOT / "schedules/2bw.yaml").read_text())
    spec["name"] += "-empty-cache"
    spec["epilogue"].append({"op": "empty_cache"})
    (copy / "example-2bw.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    run = subprocess.run(
        [sys.executable, "-c", _CHECK, str(copy)], cwd=copy, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # the op table's checks on the copy, the engine's included
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/schedules/test_op_table.py"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
