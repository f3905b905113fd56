"""The README's tables name every built-in schedule: the schedule guide, what each schedule buys,
and the precision table (whose cells tests/test_precision.py backs)."""
import re
from pathlib import Path

import pytest

from hippie_ds.schedules.spec import available

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _table_after(heading: str) -> str:
    """The first markdown table after ``heading``."""
    start = README.index(heading)
    lines = README[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[first:end])


@pytest.mark.parametrize("heading", ["## What each schedule buys", "## Precision, ZeRO-1 and tied weights",
                                     "## Schedules"])
def test_readme_tables_name_every_builtin_schedule(heading):
    table = _table_after(heading)
    named = set(re.findall(r"`([a-z0-9-]+)`", table))
    missing = sorted(set(available()) - named)
    assert not missing, f"README table after {heading!r} does not name {missing}"
