"""The package's shape beside docs/extending.md's layer table (whose layer order and import circles
``tests/test_docs.py`` checks): the pure layers import neither torch nor DeepSpeed, at any depth of
their code, and no module of the package or the tools is over 400 lines."""
import ast
from pathlib import Path

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
    long = {str(p.relative_to(ROOT)): n for p in [*ROOT.glob("hippie_ds/**/*.py"), *ROOT.glob("tools/**/*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
