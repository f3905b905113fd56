"""One start-up path, checked on the adapter's source: every check ``hippie_ds.initialize`` makes runs from
``hippie_ds/adapter/startup/`` (in one order, before any process group), and no module registers into
another module's table at import (a table names what it holds)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "hippie_ds" / "adapter"


def _package(path: Path) -> str:
    rel = path.relative_to(ADAPTER)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _modules() -> list[Path]:
    return sorted(p for p in ADAPTER.rglob("*.py") if p != ADAPTER / "__init__.py")


STARTUP = ADAPTER / "startup"
# a check the start-up runs that also runs elsewhere, and why: the module checks its own plan as it is built,
# before DeepSpeed partitions the layers (initialize checks a plan the module did not take)
ALSO_ELSEWHERE = {("module/pipeline_module.py", "check_plan")}


def _called(path: Path) -> set[str]:
    """The names of the functions ``path`` calls (``f(...)``, ``x.f(...)``)."""
    return {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
    }


def test_start_up_checks_run_in_one_module():
    """Every check ``hippie_ds.initialize`` makes runs from ``adapter/startup/`` (in one order, before
    any process group): the checks it calls are called from no other module of the adapter, and the
    engine package calls none of its own (``check_deepspeed``, the guard of the installed DeepSpeed
    at import, is not a check of the config)."""
    checks = {name for p in STARTUP.glob("*.py") for name in _called(p) if name.startswith("check")}
    assert {
        "check_chunks",
        "check_single_grad_slot",
        "check_tied",
        "check_precision",
        "check_torch_version",
        "check_config",
        "check_wrapper",
        "check_placement",
        "check_plan",
    } <= checks, sorted(checks)
    elsewhere = sorted(
        f"{p.relative_to(ADAPTER)}: {name}"
        for p in _modules()
        if _package(p) != "startup"
        for name in _called(p) & checks
        if (p.relative_to(ADAPTER).as_posix(), name) not in ALSO_ELSEWHERE
    )
    assert elsewhere == [], "start-up checks called outside hippie_ds/adapter/startup/:\n" + "\n".join(elsewhere)
    in_engine = sorted(
        f"{p.relative_to(ADAPTER)}: {name}"
        for p in (ADAPTER / "engine").glob("*.py")
        for name in _called(p)
        if name.startswith("check") and name != "check_deepspeed"
    )
    assert in_engine == [], "the engine package makes start-up checks (they belong in adapter/startup/):\n" + "\n".join(
        in_engine
    )


_MUTATORS = {"update", "append", "extend", "setdefault", "add", "insert", "__setitem__"}
# a script run by its path finds the checkout's packages: its own imports depend on it, no other module's
SCRIPT_BOOTSTRAP = {"sys.path"}


def _top_level(body: list) -> list:
    """The statements a module runs at import (into its top-level ``if``/``try``/``with`` blocks)."""
    out = []
    for node in body:
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, field):
                out += _top_level(getattr(node, field))
        if isinstance(node, ast.ExceptHandler):
            out += _top_level(node.body)
    return out


def _root(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def import_registrations(path: Path, root: Path = ROOT) -> list[str]:
    """What ``path`` writes at import into a table another module owns: an item or attribute of an
    imported name assigned, a mutating method of one called, or a decorator of the project's own
    applied (a registering decorator: ``@command(...)``)."""
    tree = ast.parse(path.read_text())
    statements = _top_level(tree.body)
    imported, own = set(), set()
    for node in statements:
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {a.asname or a.name for a in node.names}
            imported |= names
            if node.level or (node.module or "").split(".")[0] in ("hippie_ds", "tools"):
                own |= names
    found = []
    where = lambda node: f"{path.relative_to(root)}:{node.lineno}"  # noqa: E731
    for node in statements:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        found += [
            f"{where(node)}: {ast.unparse(t)} = ..."
            for t in targets
            if isinstance(t, (ast.Subscript, ast.Attribute)) and _root(t) in imported
        ]
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and _root(node.value.func.value) in imported
            and (node.value.func.attr in _MUTATORS or node.value.func.attr.startswith("register"))
            and ast.unparse(node.value.func.value) not in SCRIPT_BOOTSTRAP
        ):
            found.append(f"{where(node)}: {ast.unparse(node.value.func)}(...)")
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found += [
                f"{where(node)}: @{ast.unparse(d)}"
                for d in node.decorator_list
                if _root(d.func if isinstance(d, ast.Call) else d) in own
            ]
    return found


def test_no_module_registers_into_another_module_s_table_at_import():
    """A table is built where it is read (``staleness.prediction.methods``, ``cli.COMMANDS``), so that
    what it holds does not depend on which modules happen to have been imported."""
    modules = [*ROOT.glob("hippie_ds/**/*.py"), *ROOT.glob("tools/**/*.py")]
    found = [r for p in sorted(modules) for r in import_registrations(p)]
    assert found == [], "modules that register into another module's table when imported:\n" + "\n".join(found)


def test_an_import_registration_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from .prediction import FACTORIES\nfrom .base import command\nimport dataclasses\n"
        "FACTORIES['adam'] = print\nif True:\n    FACTORIES.update(x=1)\n"
        "@command('costs')\ndef parser(): pass\n@dataclasses.dataclass\nclass A: pass\n"
        "TABLE = {}\nTABLE['own'] = 1\n"
    )
    assert len(import_registrations(probe, root=tmp_path)) == 3
