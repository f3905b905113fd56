"""The repository's shape beside docs/extending.md's layer table (whose layer order ``tests/test_docs.py``
checks; both read the imports with tests/import_graph.py): the pure layers import neither torch
nor DeepSpeed, at any depth of their code; no module of the package, the tools or the tests is over
400 lines; the tools (``tools.examples``, ``tools.bench``) import each other in no circle and never
from the tests."""
import ast
from pathlib import Path

from import_graph import circles, module_imports

ROOT = Path(__file__).resolve().parents[1]
# the pure layers of docs/extending.md's table: shared, config, IR, language, compiler, analysis, planner
PURE = ["hippie_ds/formatting.py", "hippie_ds/data_files.py", "hippie_ds/config.py", "hippie_ds/schedules",
        "hippie_ds/planner"]
MAX_LINES = 400


def _pure_modules() -> list[Path]:
    return [p for entry in PURE for p in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry])]


def _top_level_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, at any depth of its code (a lazy import counts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_pure_layers_import_neither_torch_nor_deepspeed():
    modules = _pure_modules()
    assert len(modules) > 30  # the globs find the pure layers
    wrong = {str(p.relative_to(ROOT)): sorted(_top_level_imports(p) & {"torch", "deepspeed"}) for p in modules}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_no_module_over_400_lines():
    modules = [*ROOT.glob("hippie_ds/**/*.py"), *ROOT.glob("tools/**/*.py"), *ROOT.glob("tests/**/*.py")]
    assert len(modules) > 150
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_tools_import_in_no_circle_and_never_from_the_tests():
    """Package ``__init__`` files re-export their package (``tools.bench.cluster``) and are left out
    of the circles, as in the layer check."""
    modules = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("tools/**/*.py"))
    from_tests = sorted(m for m in modules if "tests" in _top_level_imports(ROOT / m))
    assert from_tests == []
    graph = {m: {t for t in module_imports(m, "tools") if not t.endswith("__init__.py")}
             for m in modules if not m.endswith("__init__.py")}
    assert sum(map(len, graph.values())) > 40  # the imports are found
    assert circles(graph) == []


def test_a_circle_is_found():
    assert circles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}) == \
        [["a.py", "b.py", "c.py", "a.py"]]
    assert circles({"a.py": {"b.py"}, "b.py": set()}) == []
