"""The docs' tables name what the code has, so that none goes stale unnoticed. Pure: the
markdown is parsed, nothing is run.

- README.md: the schedule guide, what each schedule buys and the precision table (whose cells
  tests/test_precision.py backs) name every built-in schedule;
- docs/reference.md: the op table has one row per ``OpKind``, checked against its ``OP_INFO``
  entry; the ``hippie-ds schedule list`` output lists exactly the built-in schedules; the layout
  table names every module;
- docs/extending.md: the layer table puts every module of ``hippie_ds/`` in exactly one layer,
  and names no module that does not exist (so does hippie_ds/planner/README.md for the planner).
"""
import ast
import re
from pathlib import Path

import pytest

from hippie_ds.schedules.ir import OP_INFO, OpKind
from hippie_ds.schedules.spec import available

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
EXTENDING = (ROOT / "docs" / "extending.md").read_text()
PLANNER_README = (ROOT / "hippie_ds" / "planner" / "README.md").read_text()
OP_HEADER = "| op | label | role / category | placed by | roughly | instruction | flags |"
LAYER_HEADER = "| layer | modules | what lives there |"
FLAGS = ("new_version", "consumes_grads", "pipeline_collective")  # the flags column; the others
# have columns of their own: micro_batch (a label), placeable (placed by names `prologue`)


def _table_after(text: str, heading: str) -> str:
    """The first markdown table after ``heading`` (a line of ``text``, e.g. a section title or
    the table's own header row)."""
    start = text.index(heading)
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[first:end])


def _cells(line: str) -> list[str]:
    """A table row's cells, stripped (a ``|`` inside backticks does not split)."""
    cells, cell, code = [], "", False
    for ch in line.strip().removeprefix("|").removesuffix("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return cells + [cell.strip()]


def _rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the table whose header row is ``header`` (the separator row skipped)."""
    assert header in text, f"no table with the header {header!r}"
    table = _table_after(text, header).splitlines()
    return [_cells(line) for line in table[1:] if not re.fullmatch(r"\|[-:| ]*\|?", line.strip())]


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# --- README -----------------------------------------------------------------------------------

@pytest.mark.parametrize("heading", ["## What each schedule buys", "## Precision, ZeRO-1 and tied weights",
                                     "## Schedules"])
def test_readme_tables_name_every_builtin_schedule(heading):
    table = _table_after(README, heading)
    named = set(re.findall(r"`([a-z0-9-]+)`", table))
    missing = sorted(set(available()) - named)
    assert not missing, f"README table after {heading!r} does not name {missing}"


# --- docs/reference.md: ops and schedules ---------------------------------------------------

def _op_rows() -> dict[str, list[str]]:
    rows = {}
    for cells in _rows(REFERENCE, OP_HEADER):
        assert len(cells) == 7, f"docs/reference.md op table: row {cells} does not have 7 cells"
        name = _code(cells[0])
        assert len(name) == 1, f"docs/reference.md op table: the first cell of {cells} is not one `op`"
        assert name[0] not in rows, f"docs/reference.md op table: `{name[0]}` has two rows"
        rows[name[0]] = cells
    return rows


def test_reference_op_table_names_every_op_kind():
    rows = _op_rows()
    missing = [k.value for k in OpKind if k.value not in rows]
    assert not missing, (f"docs/reference.md's op table (section 'Ops', header {OP_HEADER!r}) has no "
                         f"row for {missing}: add one per op kind from its OP_INFO entry in "
                         "hippie_ds/schedules/ir.py")
    unknown = sorted(set(rows) - {k.value for k in OpKind})
    assert not unknown, f"docs/reference.md's op table names ops that OpKind does not have: {unknown}"


def _new_instruction_classes() -> set[str]:
    """The instruction classes hippie-ds adds (read from the source: no DeepSpeed import)."""
    tree = ast.parse((ROOT / "hippie_ds" / "adapter" / "instructions.py").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize("kind", list(OpKind), ids=lambda k: k.value)
def test_reference_op_table_row_matches_op_info(kind):
    rows = _op_rows()
    if kind.value not in rows:
        pytest.skip("missing row: test_reference_op_table_names_every_op_kind reports it")
    _, label, role_category, placed_by, roughly, instruction, flags = rows[kind.value]
    info = OP_INFO[kind]
    where = f"docs/reference.md's op table, row `{kind.value}`"
    assert _code(label) == ([info.short] if info.short else []), \
        f"{where}: the label cell should be {'`' + info.short + '`' if info.short else 'empty'} (OP_INFO short)"
    assert info.micro_batch == bool(info.short), f"OP_INFO[{kind}]: a micro-batch op has a label, others none"
    assert role_category == f"{info.role} / {info.category}", \
        f"{where}: role / category should be '{info.role} / {info.category}'"
    assert ("`prologue`" in placed_by) == info.placeable, \
        f"{where}: placed by should {'' if info.placeable else 'not '}name `prologue` (OP_INFO placeable)"
    assert roughly.startswith(info.doc), f"{where}: the roughly cell should start with OP_INFO's doc {info.doc!r}"
    expected = [info.instruction] + ([info.nonblocking_instruction] if info.nonblocking_instruction else [])
    assert _code(instruction) == expected, f"{where}: the instruction cell should name {expected}, in that order"
    stock = info.instruction not in _new_instruction_classes()
    assert ("DeepSpeed's" in instruction) == stock, \
        f"{where}: `{info.instruction}` is {'DeepSpeed' if stock else 'hippie-ds'}'s (adapter/instructions.py)"
    assert _code(flags) == [f for f in FLAGS if getattr(info, f)], \
        f"{where}: flags should be {[f for f in FLAGS if getattr(info, f)]} (OP_INFO)"


def test_reference_schedule_list_names_every_builtin_schedule():
    """The ``hippie-ds schedule list`` example output lists the built-ins, one per line."""
    lines = REFERENCE[REFERENCE.index("$ hippie-ds schedule list"):].splitlines()[1:]
    output = lines[:next(i for i, line in enumerate(lines) if not line.strip())]
    assert output and output[0].split()[0] == "schedule", "docs/reference.md: `schedule list` output has no header"
    listed = [line.split()[0] for line in output[1:]]
    assert listed == available(), (f"docs/reference.md's `hippie-ds schedule list` output (section 'CLI') lists {listed}; the "
                                   f"built-ins are {available()}: paste the command's output there")


# --- module tables ----------------------------------------------------------------------------

def _modules() -> set[str]:
    """Every module of hippie_ds/ (packages' __init__ and __main__ aside), as paths from the root."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "hippie_ds").rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py")}


def _named_modules(cell: str, context: str = "") -> set[str]:
    """The modules a table cell names, as paths from the root. ``hippie_ds/...`` paths are taken
    as they are and set the folder for the bare names after them (`hippie_ds/adapter/`:
    `engine.py`, ...); a name with a folder of the package (`adapter/memory.py`) is under
    ``hippie_ds/``. Paths outside hippie_ds (tools/, tests/) and the bare names after them are
    not modules of the package and are left out."""
    named = set()
    for token in _code(cell):
        if " " in token:
            continue
        if token.endswith("/"):  # a folder: the bare names after it are in it
            context = token
            continue
        if not token.endswith(".py"):
            continue
        if "/" in token and not token.startswith("hippie_ds/"):  # adapter/memory.py; benchmarks/... is tools'
            token = "hippie_ds/" + token if (ROOT / "hippie_ds" / token.split("/")[0]).is_dir() else token
        elif "/" not in token:
            token = context + token
        if token.startswith("hippie_ds/"):
            named.add(token)
        context = token.rsplit("/", 1)[0] + "/"
    return named


def test_extending_layer_table_puts_every_module_in_one_layer():
    where: dict[str, list[str]] = {}
    for cells in _rows(EXTENDING, LAYER_HEADER):
        for module in _named_modules(cells[1]):
            where.setdefault(module, []).append(cells[0])
    missing = sorted(_modules() - set(where))
    assert not missing, (f"docs/extending.md's layer table (header {LAYER_HEADER!r}) does not name {missing}: "
                         "add each to the 'modules' cell of its layer's row, with what it holds")
    twice = {m: layers for m, layers in where.items() if len(layers) > 1}
    assert not twice, f"docs/extending.md's layer table names modules in more than one layer: {twice}"
    stale = sorted(set(where) - _modules())
    assert not stale, f"docs/extending.md's layer table names modules that do not exist: {stale}"


@pytest.mark.parametrize("doc,text,header,context", [
    ("docs/reference.md (Layout)", REFERENCE, "| path | what |", ""),
    ("hippie_ds/planner/README.md", PLANNER_README, "| module | what |", "hippie_ds/planner/"),
])
def test_module_tables_name_existing_modules(doc, text, header, context):
    named = set()
    for cells in _rows(text, header):
        named |= _named_modules(" ".join(cells), context)
    scope = {m for m in _modules() if m.startswith(context or "hippie_ds/")}
    missing = sorted(scope - named)
    assert not missing, f"{doc}'s table (header {header!r}) does not name {missing}: add a row or a mention"
    stale = sorted(named - _modules())
    assert not stale, f"{doc}'s table (header {header!r}) names modules that do not exist: {stale}"


# --- structure: imports follow the layer table ------------------------------------------------

def _imports(module: str) -> set[str]:
    """The hippie_ds modules ``module`` (a path from the root) imports, at any depth of its code
    (an import inside a function is an arrow of the structure too)."""
    path = ROOT / module
    package = path.parent.relative_to(ROOT).parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            base += node.module.split(".") if node.module else []
            targets = [base + [a.name] for a in node.names]
        else:
            continue
        for parts in targets:
            while parts and parts[0] == "hippie_ds":  # the longest prefix that is a module
                candidate = "/".join(parts)
                if (ROOT / f"{candidate}.py").is_file():
                    out.add(f"{candidate}.py")
                    break
                if (ROOT / candidate / "__init__.py").is_file() and len(parts) > 1 and \
                        not (ROOT / "/".join(parts[:-1] + [parts[-1] + ".py"])).is_file():
                    out.add(f"{candidate}/__init__.py")
                    break
                parts = parts[:-1]
    out.discard(module)
    return out


def test_imports_go_down_the_layer_table_and_never_in_a_circle():
    """A module imports from its own layer and the rows above it in extending.md's layer table
    (from pure to DeepSpeed-bound), never from a row below, and no modules import each other in a
    circle. Packages' __init__ files re-export their package and are left out."""
    rank = {}
    for i, cells in enumerate(_rows(EXTENDING, LAYER_HEADER)):
        for module in _named_modules(cells[1]):
            rank[module] = (i, cells[0])
    graph = {m: {t for t in _imports(m) if t in rank} for m in rank if (ROOT / m).is_file()}
    upward = sorted(f"{m} ({rank[m][1]}) imports {t} ({rank[t][1]})"
                    for m, targets in graph.items() for t in targets if rank[t][0] > rank[m][0])
    assert not upward, "imports against the layer order of docs/extending.md:\n" + "\n".join(upward)
    # circles: depth-first search for a back edge
    state, circle = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                circle.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circle, f"modules that import each other in a circle: {circle}"
