"""The repository's shape beside docs/architecture.md's layer table (whose layer order
``tests/docs/test_docs.py`` checks; both read the imports with tests/import_graph.py): the pure layers import
neither torch nor DeepSpeed, at any depth of their code; no module of the package, the tools or the tests is
over MAX_LINES lines (500 formatted, about 400 compact); the tools (``tools.examples``, ``tools.bench``)
import each other in no circle and never from the tests. And the adapter's packages: each with a one-line
purpose and under MAX_PACKAGE_LINES lines, a package importing only the packages below it in
``hippie_ds.adapter.PACKAGES`` (``ds`` at the bottom, ``integration`` at the top), no module outside the
``engine`` package reading a private attribute of the engine, and no component taking the engine (a component
is built with what it uses)."""

import ast
from pathlib import Path

from import_graph import circles, module_imports

ROOT = Path(__file__).resolve().parents[2]
# the pure layers of docs/architecture.md's table: shared, config, IR, language, compiler, analysis, planner
PURE = [
    "hippie_ds/formatting.py",
    "hippie_ds/data_files.py",
    "hippie_ds/config.py",
    "hippie_ds/schedules",
    "hippie_ds/planner",
]
# A module does one thing: about 400 lines of the compact layout the code was written in. Under ruff's
# format (`make test` checks it) the same code takes 21% more lines (45,703 -> 55,429 in the commit that
# reformatted everything), so the limit counts 500 formatted lines.
MAX_LINES = 500


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


def test_no_module_over_the_line_limit():
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
    graph = {
        m: {t for t in module_imports(m, "tools") if not t.endswith("__init__.py")}
        for m in modules
        if not m.endswith("__init__.py")
    }
    assert sum(map(len, graph.values())) > 40  # the imports are found
    assert circles(graph) == []


def test_a_circle_is_found():
    assert circles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}) == [
        ["a.py", "b.py", "c.py", "a.py"]
    ]
    assert circles({"a.py": {"b.py"}, "b.py": set()}) == []


# --- the adapter's packages (issue 59) ------------------------------------------------------------
ADAPTER = ROOT / "hippie_ds" / "adapter"
MAX_PACKAGE_LINES = 1500  # 1250 compact lines, formatted as MAX_LINES is (x 1.21)


def _order() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """PACKAGES and ALIASES, read from the adapter's ``__init__`` without importing it."""
    tree = ast.parse((ADAPTER / "__init__.py").read_text())
    found = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    return tuple(found.get("PACKAGES", ())), tuple(found.get("ALIASES", ()))


def _package(path: Path) -> str:
    """The package of the order a module of the adapter is in (``integration``: the module itself)."""
    rel = path.relative_to(ADAPTER)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _modules() -> list[Path]:
    return sorted(p for p in ADAPTER.rglob("*.py") if p != ADAPTER / "__init__.py")


def test_every_module_is_in_a_package_of_the_order():
    packages, aliases = _order()
    assert packages[0] == "ds" and packages[-1] == "integration", packages
    outside = sorted(
        str(p.relative_to(ROOT)) for p in _modules() if _package(p) not in packages and _package(p) not in aliases
    )
    assert outside == [], f"modules of hippie_ds/adapter/ in no package of hippie_ds.adapter.PACKAGES: {outside}"
    for package in packages[:-1]:
        init = ADAPTER / package / "__init__.py"
        assert init.is_file(), f"{init.relative_to(ROOT)} is missing"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)}: a one-line docstring says what the package holds"


def test_aliases_only_re_export():
    """An alias module (a path old checkpoints pickled) imports one module and defines nothing."""
    _, aliases = _order()
    for name in aliases:
        tree = ast.parse((ADAPTER / f"{name}.py").read_text())
        kinds = {type(node).__name__ for node in tree.body}
        assert kinds <= {"ImportFrom", "Assign", "Expr"}, (name, kinds)


def test_packages_are_small():
    packages, _ = _order()
    sizes = {
        p: sum(len(m.read_text().splitlines()) for m in (ADAPTER / p).rglob("*.py"))
        for p in packages
        if (ADAPTER / p).is_dir()
    }
    assert {p: n for p, n in sizes.items() if n > MAX_PACKAGE_LINES} == {}


def test_packages_import_only_the_packages_below_them():
    packages, aliases = _order()
    rank = {p: i for i, p in enumerate(packages)} | {a: len(packages) for a in aliases}
    wrong = []
    for path in _modules():
        module = path.relative_to(ROOT).as_posix()
        own = _package(path)
        for target in module_imports(module, "hippie_ds"):
            if not target.startswith("hippie_ds/adapter/") or target == "hippie_ds/adapter/__init__.py":
                continue
            theirs = _package(ROOT / target)
            if theirs != own and rank.get(theirs, len(packages) + 1) >= rank.get(own, -1):
                wrong.append(f"{module} ({own}) imports {target} ({theirs})")
    assert wrong == [], (
        "imports against hippie_ds.adapter.PACKAGES (a package imports only those below it):\n"
        + "\n".join(sorted(wrong))
    )


def _engine_privates() -> set[str]:
    """The private attributes the engine package sets on the engine (``self._name = ...`` in a
    method of a class there), and its private methods."""
    names = set()
    for path in (ADAPTER / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if (
                        isinstance(item, ast.FunctionDef)
                        and item.name.startswith("_")
                        and not item.name.startswith("__")
                    ):
                        names.add(item.name)
                    if isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        for t in targets:
                            for sub in ast.walk(t):
                                if (
                                    isinstance(sub, ast.Attribute)
                                    and isinstance(sub.value, ast.Name)
                                    and sub.value.id == "self"
                                    and sub.attr.startswith("_")
                                    and not sub.attr.startswith("__")
                                ):
                                    names.add(sub.attr)
    return names


def private_engine_reads(path: Path, privates: set[str], root: Path = ROOT) -> list[str]:
    """``x._name`` (x not ``self``) and ``getattr(x, "_name")`` where ``_name`` is the engine's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in privates
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in privates
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_outside_the_engine_package_reads_a_private_engine_attribute():
    privates = _engine_privates()
    assert {"_runtime", "_chunk_selector", "_chunks"} <= privates  # the scan finds the engine's state
    reads = [r for p in _modules() if _package(p) != "engine" for r in private_engine_reads(p, privates)]
    assert reads == [], (
        "components read the engine's private attributes (give them what they use when built):\n" + "\n".join(reads)
    )


def test_the_engine_has_no_mixin_and_its_handlers_live_in_the_stage_runtime():
    """``HippiePipelineEngine`` subclasses DeepSpeed's ``PipelineEngine`` alone (no mixins sharing
    state through ``self``); a stage's state is one ``StageRuntime`` the engine builds, and every op
    kind's handler takes that runtime, not the engine."""
    tree = ast.parse((ADAPTER / "engine" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HippiePipelineEngine")
    assert [ast.unparse(b) for b in engine.bases] == ["ds_engine.PipelineEngine"]
    classes = [
        n.name
        for pkg in ("engine", "stage")
        for p in (ADAPTER / pkg).glob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef)
    ]
    assert "StageRuntime" in classes and not [c for c in classes if c.endswith(("Mixin", "Handlers"))]
    import inspect
    from hippie_ds.adapter.stage.handlers import HANDLERS, NONBLOCKING_HANDLERS

    firsts = {next(iter(inspect.signature(h).parameters)) for h in [*HANDLERS.values(), *NONBLOCKING_HANDLERS.values()]}
    assert firsts == {"rt"}


def test_the_tools_use_the_engines_public_surface():
    """tools/ (the bench's probes, the examples) read no private attribute of the engine: neither one
    the engine package sets nor any ``engine._name`` (the bench's memory count once read an attribute
    that no longer existed, and silently counted nothing)."""
    privates = _engine_privates()
    reads = [r for p in sorted((ROOT / "tools").rglob("*.py")) for r in private_engine_reads(p, privates)]
    reads += [r for p in sorted((ROOT / "tools").rglob("*.py")) for r in engine_private_reads(p)]
    assert reads == [], "tools read the engine's private attributes (use a public method or hook):\n" + "\n".join(reads)


def engine_private_reads(path: Path, root: Path = ROOT) -> list[str]:
    """``engine._name`` and ``getattr(engine, "_name")`` / ``setattr`` / ``hasattr``, any private name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id == "engine"
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: engine.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "engine"
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.func.id}(engine, {node.args[1].value!r})")
    return found


def test_a_private_read_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("engine._gradients.store\ngetattr(engine, '_versions', None)\nself._gradients\nengine.device\n")
    assert len(private_engine_reads(probe, {"_gradients", "_versions"}, root=tmp_path)) == 2
    probe.write_text("getattr(engine, '_grad_buffer', None)\nengine._bench_t0 = 0\nengine.timeline()\n")
    assert len(engine_private_reads(probe, root=tmp_path)) == 2


def test_the_handlers_call_down_never_back_into_a_module_they_came_from():
    """The modules of the ``stage`` and ``engine`` packages (the runtime, the handlers, p2p, the
    overrides), an arrow where one imports another: no circle (an ``ISendGrad`` once went back and
    forth between two modules of the engine)."""
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for pkg in ("stage", "engine")
        for p in (ADAPTER / pkg).glob("*.py")
        if p.name != "__init__.py"
    )
    graph = {m: {t for t in module_imports(m, "hippie_ds") if t in modules} for m in modules}
    assert sum(map(len, graph.values())) > 5  # the imports are found
    assert circles(graph) == []


# the one module outside the seam and the engine package that reads the engine: the factory that builds
# the stage's components from it
FACTORY = ADAPTER / "stage" / "build.py"
ENGINE_CLASSES = {"HippiePipelineEngine", "PipelineEngine", "DeepSpeedEngine"}
# functions of the scanned modules that are handed an engine and are no component, with why
TAKES_AN_ENGINE = {
    "hippie_ds/adapter/profiling/timeline.py:time_stock_handlers": (
        "times a stock PipelineEngine, which has no instruction hook, by rebinding that engine's map"
    )
}


def _component_modules() -> list[Path]:
    """The adapter's modules less the engine package (the class whose overrides DeepSpeed calls),
    ``ds`` (the seam), ``integration.py`` (it builds the engine) and the components' factory."""
    return [p for p in _modules() if _package(p) not in ("ds", "integration", "engine", *_order()[1]) and p != FACTORY]


def engine_parameters(path: Path, root: Path = ROOT) -> list[str]:
    """Functions and methods (a class's ``__init__`` included) of ``path`` with a parameter named
    ``engine`` or annotated with an engine class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is None:
                continue
            annotated = arg.annotation is not None and any(
                isinstance(n, ast.Name)
                and n.id in ENGINE_CLASSES
                or isinstance(n, ast.Attribute)
                and n.attr in ENGINE_CLASSES
                or isinstance(n, ast.Constant)
                and str(n.value) in ENGINE_CLASSES
                for n in ast.walk(arg.annotation)
            )
            if arg.arg == "engine" or annotated:
                found.append(f"{path.relative_to(root).as_posix()}:{node.name}")
    return found


def test_no_component_constructor_takes_the_engine():
    """A component is built with what it reads (tensors, the optimizer, the grid and process groups,
    callables for the DeepSpeed operations it triggers, made in ``adapter/ds/``), never the engine: it
    cannot call back through it; the stage runtime takes DeepSpeed's side of the stage
    (``ds.stage.DeepSpeedStage``), not the engine. Only the components' factory (``stage/build.py``),
    the engine package and the seam read the engine."""
    modules = _component_modules()
    assert len(modules) > 30 and ADAPTER / "stage" / "chunk_selector.py" in modules  # the scan finds them
    assert ADAPTER / "stage" / "runtime.py" in modules and FACTORY.is_file()
    found = [f for p in modules for f in engine_parameters(p) if f not in TAKES_AN_ENGINE]
    assert found == [], "components take the engine (give them what they read):\n" + "\n".join(found)


def test_an_engine_parameter_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class A:\n    def __init__(self, engine):\n        pass\n"
        "def f(x, e: 'HippiePipelineEngine'):\n    pass\n"
        "def g(x, *, e: ds.PipelineEngine = None):\n    pass\n"
        "def h(optimizer, checkpoint_engine):\n    pass\n"
    )
    assert sorted(engine_parameters(probe, root=tmp_path)) == ["probe.py:__init__", "probe.py:f", "probe.py:g"]
