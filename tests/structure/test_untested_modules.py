"""tests/UNTESTED_MODULES.md names exactly the modules of hippie_ds/ and tools/ that no file under
tests/ imports (read with tests/import_graph.py, at any depth of the test's code), each with the tests
that cover it, so that a module's tests are found by path or by that list. Pure."""

import re
from pathlib import Path

from import_graph import module_imports

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "tests" / "UNTESTED_MODULES.md"


def _listed() -> dict[str, str]:
    """{module: where it is covered}, the list's table rows."""
    rows = {}
    for line in LIST.read_text().splitlines():
        m = re.match(r"^\| `((?:hippie_ds|tools)/[^`]+\.py)` \| (.+) \|$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
            rows[m.group(1)] = m.group(2)
    return rows


def _imported_by_tests() -> set[str]:
    found = set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        test = path.relative_to(ROOT).as_posix()
        found |= module_imports(test, "hippie_ds") | module_imports(test, "tools")
    return found


def _modules() -> list[str]:
    """The modules a test could import by name (a package's ``__init__`` and ``__main__`` come with it)."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for top in ("hippie_ds", "tools")
        for p in (ROOT / top).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )


def test_the_list_names_exactly_the_modules_no_test_imports():
    imported = _imported_by_tests()
    assert len(imported) > 80  # the scan finds the tests' imports
    untested = {m for m in _modules() if m not in imported}
    listed = set(_listed())
    assert not untested - listed, (
        "modules no test imports, missing from tests/UNTESTED_MODULES.md (add each with "
        f"the tests that cover it): {sorted(untested - listed)}"
    )
    assert not listed - untested, (
        "tests/UNTESTED_MODULES.md lists modules a test now imports, or that no longer "
        f"exist (remove them): {sorted(listed - untested)}"
    )


def test_every_row_says_where_the_module_is_covered():
    for module, where in _listed().items():
        cited = re.findall(r"`(tests/[^`]+\.py)`", where)
        assert cited, f"{module}: name the tests that cover it"
        missing = [t for t in cited if not (ROOT / t).is_file()]
        assert not missing, f"{module}: the list cites tests that do not exist: {missing}"
