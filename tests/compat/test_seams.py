"""The DeepSpeed internals hippie-ds relies on (``hippie_ds._compat``: SEAMS, OVERRIDES, RELIED_ON)
exist on the installed DeepSpeed; only ``hippie_ds/adapter/ds/`` (and ``_compat``, the version check)
imports ``deepspeed.runtime`` or reaches DeepSpeed's internals, in hippie_ds/ and tools/ alike
(tools/examples/ is user code, exempt); every SEAMS entry is used there; and ``setup.py`` pins the
range the lists allow."""

import ast
import re
from pathlib import Path

import deepspeed

from hippie_ds import _compat

ROOT = Path(__file__).resolve().parents[2]
DS = Path(deepspeed.__file__).parent
SEAM_PACKAGE = ROOT / "hippie_ds" / "adapter" / "ds"
# DeepSpeed sources whose private names hippie-ds may reach: the SEAMS modules
DS_SOURCES = [
    DS / "runtime" / "engine.py",
    DS / "runtime" / "pipe" / "engine.py",
    DS / "runtime" / "pipe" / "module.py",
    DS / "runtime" / "pipe" / "p2p.py",
    DS / "runtime" / "bf16_optimizer.py",
    DS / "runtime" / "base_optimizer.py",
    DS / "runtime" / "fp16" / "unfused_optimizer.py",
    DS / "runtime" / "zero" / "stage_1_and_2.py",
    DS / "runtime" / "utils.py",
    DS / "utils" / "groups.py",
]

# hippie-ds's own attributes that share a name with a private DeepSpeed one, with where and why
HIPPIE_OWN = {"_build": "hippie_ds/schedules/costs.py: Costs._build, the cost model's own constructor"}


def _names(table: dict) -> set[str]:
    return {n for owners in table.values() for names in owners.values() for n in names}


SEAM_NAMES, OVERRIDE_NAMES, RELIED_ON_NAMES = (
    _names(_compat.SEAMS),
    _names(_compat.OVERRIDES),
    _names(_compat.RELIED_ON),
)


def _defined_in_deepspeed() -> set[str]:
    names = set()
    for path in DS_SOURCES:
        text = path.read_text()
        names |= set(re.findall(r"def (_[A-Za-z]\w*)", text))
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=", text))
        names |= set(re.findall(r"^\s*(_[A-Za-z]\w*)\s*=", text, re.M))
    return names


INTERNALS = (_defined_in_deepspeed() | SEAM_NAMES) - set(HIPPIE_OWN)


def _scanned() -> list[Path]:
    """hippie_ds/ and tools/, less the seam package, _compat.py and tools/examples/ (user code)."""
    paths = [*ROOT.glob("hippie_ds/**/*.py"), *ROOT.glob("tools/**/*.py")]
    return sorted(
        p
        for p in paths
        if SEAM_PACKAGE not in p.parents and p.name != "_compat.py" and (ROOT / "tools" / "examples") not in p.parents
    )


def _is_self_or_super(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "self") or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _reaches(path: Path) -> list[str]:
    return _reaches_in(path.read_text(), path.relative_to(ROOT))


def _reaches_in(text: str, rel) -> list[str]:
    """Where ``path`` imports ``deepspeed.runtime`` or reaches a DeepSpeed internal by name: an
    attribute, or a string (getattr/setattr, dict keys). Allowed: a subclass's override of a name
    in OVERRIDES (its ``def``, ``self.name`` / ``super().name``) and the op table's handler names."""
    found = []
    for node in sorted(ast.walk(ast.parse(text, str(rel))), key=lambda n: getattr(n, "lineno", 0)):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (
                node.module.startswith("deepspeed.runtime")
                or (node.module == "deepspeed" and any(a.name == "runtime" for a in node.names))
            )
        ):
            found.append(f"{where} imports {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.startswith("deepspeed.runtime") for a in node.names):
            found.append(f"{where} imports deepspeed.runtime")
        elif isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            if not (node.attr in OVERRIDE_NAMES and _is_self_or_super(node.value)):
                found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNALS:
            found.append(f"{where} {node.value!r}")
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name in INTERNALS
            and node.name not in OVERRIDE_NAMES
        ):
            found.append(f"{where} def {node.name} (overrides a DeepSpeed internal: list it in OVERRIDES)")
    return found


def _used_names(paths) -> set[str]:
    """Attribute names, strings and function names in ``paths``' code (docstrings aside: a string
    that is a whole identifier)."""
    used = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                used.add(node.value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                used.add(node.name)
    return used


def test_only_the_seam_package_reaches_deepspeed_internals():
    reached = [r for path in _scanned() for r in _reaches(path)]
    assert reached == [], (
        "outside hippie_ds/adapter/ds/, these import deepspeed.runtime or reach DeepSpeed "
        f"internals; add a named operation there and call it: {reached}"
    )


def test_the_scan_sees_what_it_should():
    """The scan flags an import, an attribute, a string and an unlisted override, and spares an
    override's super() call."""
    probe = (
        "from deepspeed.runtime.pipe.module import LayerSpec\n"
        "class E:\n"
        "    def _train_schedule(self):\n        return super()._train_schedule()\n"
        "    def _exec_send_grads(self, b):\n        return self._reserve_pipe_buffers(1)\n"
        "x = getattr(object(), 'grad_layer', None), m._layer_specs\n"
    )
    found = sorted(f.split(" ", 1)[1] for f in _reaches_in(probe, "probe.py"))
    assert found == sorted(
        [
            "imports deepspeed.runtime.pipe.module",
            "._layer_specs",
            "._reserve_pipe_buffers",
            "'grad_layer'",
            "def _exec_send_grads (overrides a DeepSpeed internal: list it in OVERRIDES)",
        ]
    )


def test_the_pure_layers_import_no_deepspeed():
    for layer in ("schedules", "planner"):
        for path in (ROOT / "hippie_ds" / layer).glob("**/*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n.split(".")[0] == "deepspeed" for n in names), (
                    f"{path.relative_to(ROOT)} imports {names}"
                )


def test_every_seam_exists_on_the_installed_deepspeed():
    assert _compat.missing_seams() == []


def test_a_missing_seam_is_reported():
    _compat.SEAMS["deepspeed.runtime.pipe.engine"]["PipelineEngine"] += ("_no_such_internal",)
    try:
        assert _compat.missing_seams() == ["deepspeed.runtime.pipe.engine.PipelineEngine._no_such_internal"]
    finally:
        _compat.SEAMS["deepspeed.runtime.pipe.engine"]["PipelineEngine"] = _compat.SEAMS[
            "deepspeed.runtime.pipe.engine"
        ]["PipelineEngine"][:-1]


def test_setup_pins_the_range_the_seams_allow():
    setup = (ROOT / "setup.py").read_text()
    assert f'"{_compat.REQUIREMENT}"' in setup
    lo, hi = _compat.SUPPORTED_DEEPSPEED
    assert _compat.REQUIREMENT == f"deepspeed>={lo[0]}.{lo[1]}.{lo[2]},<{hi[0]}.{hi[1]}"
    _compat.check_deepspeed_version(deepspeed.__version__)


def test_every_seam_is_used_in_the_seam_package():
    """A SEAMS entry is a DeepSpeed internal hippie-ds reaches (as ``.name``, or a string of the name
    given to getattr/setattr) in adapter/ds; one nothing uses only narrows the supported range for
    nothing. An OVERRIDES entry is a method a subclass defines or the op table names; RELIED_ON's
    are named nowhere (else they belong in SEAMS)."""
    used = _used_names(SEAM_PACKAGE.glob("*.py"))
    unused = sorted(
        f"{module}.{owner + '.' if owner else ''}{name}"
        for module, owners in _compat.SEAMS.items()
        for owner, names in owners.items()
        for name in names
        if name not in used
    )
    assert unused == [], f"hippie_ds/_compat.py SEAMS lists internals adapter/ds does not use: {unused}"
    everywhere = _used_names([*_scanned(), *SEAM_PACKAGE.glob("*.py")])
    defined = set()
    for path in _scanned():
        defined |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
    idle = sorted(OVERRIDE_NAMES - defined)
    assert idle == [], f"OVERRIDES lists names no subclass overrides: {idle}"
    named = sorted(RELIED_ON_NAMES & everywhere)
    assert named == [], f"RELIED_ON lists internals hippie-ds names: move them to SEAMS: {named}"
