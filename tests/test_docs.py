"""The docs' tables name what the code has, so that none goes stale unnoticed. Pure: the
markdown is parsed, nothing is run.

- README.md's "what each schedule buys", docs/schedules.md's schedule table and docs/precision.md's
  precision table (whose cells tests/test_precision.py backs) name every built-in schedule;
- README.md's config-key table names every key hippie_ds/config.py accepts, and nothing else; the
  schedules README.md says tests/test_dropin.py runs are the ones in that test's ``SCHEDULES``, and
  what it says Megatron-DeepSpeed needs names the schedules with virtual stages;
- README.md, docs/*.md, docs/results/*.md and hippie_ds/planner/README.md: every repository path they name (in
  backticks or as a link) exists;
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

from pydantic import BaseModel

from hippie_ds.config import HippieConfig
from hippie_ds.schedules.ir import DEEPSPEED_INSTRUCTIONS, OP_INFO, OpKind
from hippie_ds.schedules.spec import available, load_spec
from import_graph import circles, module_imports

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SCHEDULES_DOC = (ROOT / "docs" / "schedules.md").read_text()
PRECISION_DOC = (ROOT / "docs" / "precision.md").read_text()
TRAINING_DOC = (ROOT / "docs" / "training.md").read_text()
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

@pytest.mark.parametrize("doc,text,heading", [
    ("README.md", README, "## What each schedule buys"),
    ("docs/schedules.md", SCHEDULES_DOC, "## The built-in schedules"),
    ("docs/precision.md", PRECISION_DOC, "## The precision table"),
])
def test_schedule_tables_name_every_builtin_schedule(doc, text, heading):
    table = _table_after(text, heading)
    named = set(re.findall(r"`([a-z0-9-]+)`", table))
    missing = sorted(set(available()) - named)
    assert not missing, f"{doc}: the table after {heading!r} does not name {missing}"


def _config_keys(model: type[BaseModel], prefix: str) -> set[str]:
    """Every leaf key of a config section, dotted (``hippie.staleness.method``)."""
    keys = set()
    for name, field in model.model_fields.items():
        sub = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        keys |= _config_keys(sub, f"{prefix}{name}.") if sub else {prefix + name}
    return keys


def test_readme_config_table_names_every_config_key():
    # hippie.virtual_stages is filled from pipeline.virtual_stages (a user's hippie.virtual_stages is refused)
    accepted = (_config_keys(HippieConfig, "hippie.") - {"hippie.virtual_stages"}) | \
        {"pipeline.schedule", "pipeline.virtual_stages"}
    named = {_code(cells[0])[0] for cells in _rows(README, "| key | default | in short |")}
    assert named == accepted, (f"README.md's config-key table: missing {sorted(accepted - named)}, not accepted by "
                               f"hippie_ds/config.py {sorted(named - accepted)}")


def _dropin_schedules() -> list[str]:
    """tests/test_dropin.py's ``SCHEDULES``, read from its source (it imports the launcher)."""
    tree = ast.parse((ROOT / "tests" / "test_dropin.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SCHEDULES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_dropin.py has no SCHEDULES list")


def _sentence_with(text: str, needle: str) -> str:
    start = text.index(needle)
    start = max(text.rfind(". ", 0, start), text.rfind("\n\n", 0, start)) + 1
    end = text.find(". ", text.index(needle))
    return text[start:end if end >= 0 else len(text)]


@pytest.mark.parametrize("doc,text", [("README.md", README), ("docs/training.md", TRAINING_DOC)])
def test_dropin_claim_names_exactly_the_schedules_test_dropin_runs(doc, text):
    sentence = _sentence_with(text, "`tests/test_dropin.py` runs")
    claimed = {n for n in _code(sentence) if n in available()}
    expected = set(_dropin_schedules())
    assert claimed == expected, (f"{doc}: the sentence on tests/test_dropin.py names {sorted(claimed)}; its SCHEDULES "
                                 f"runs {sorted(expected)}: name exactly those")
    assert "every" not in sentence, f"{doc}: the drop-in sentence claims 'every': {sentence!r}"


def test_readme_megatron_claim_names_the_module_import_for_virtual_schedules():
    """Megatron-DeepSpeed's schedules with virtual stages need ``hippie_ds.PipelineModule``, not
    only ``initialize``: the README's sentence says so and names each of them."""
    virtual = {n for n in available() if load_spec(n).virtual_stages is not None}
    assert virtual, "no built-in schedule declares virtual_stages"
    sentence = _sentence_with(README, "Megatron-DeepSpeed's GPT runs")
    assert "`PipelineModule`" in sentence and virtual <= set(_code(sentence)), \
        f"README.md's Megatron sentence must name the PipelineModule import and {sorted(virtual)}: {sentence!r}"


# --- every repository path a document names exists ------------------------------------------

PATH_PREFIXES = ("tests/", "tools/", "hippie_ds/", "configs/", "schedules/", "docs/")
# paths of other projects that a document names, each with the words just before it that say whose
OTHER_PROJECTS = {("docs/megatron.md", "tools/preprocess_data.py"): "Megatron's own"}
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "results").glob("*.md")),
        "hippie_ds/planner/README.md"]


def _named_paths(doc: str) -> set[str]:
    """Repository paths ``doc`` names: a backticked token outside code blocks that starts with a top-level folder
    (its first word; ``:function`` and ``::test`` cut off; placeholders such as ``NAME`` or ``*``
    left out), and link targets (relative to the
    document; anchors and web addresses left out)."""
    text = (ROOT / doc).read_text()
    paths = set()
    for token in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        word = token.split()[0] if token.split() else ""
        word = re.split(r"::|:(?=[A-Za-z_])", word)[0].rstrip(".,;")
        if word.startswith(PATH_PREFIXES) and not re.search(r"[*{}<>]|\.\.\.|(?<![A-Za-z])(?!README)[A-Z]{2,}(?![a-z])", word):
            paths.add(word)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#")[0]
        if target and "://" not in target:
            paths.add((Path(doc).parent / target).as_posix())
    return paths


@pytest.mark.parametrize("doc", DOCS)
def test_named_repository_paths_exist(doc):
    import os.path
    text = (ROOT / doc).read_text()
    for (where, path), owner in OTHER_PROJECTS.items():
        if where == doc:
            assert re.search(re.escape(owner) + r"\s+`" + re.escape(path), text), \
                f"{doc} no longer names {path} as {owner!r}: update OTHER_PROJECTS in tests/test_docs.py"
    other = {path for (where, path) in OTHER_PROJECTS if where == doc}
    missing = sorted(p for p in _named_paths(doc) - other if not (ROOT / os.path.normpath(p)).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``; a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


@pytest.mark.parametrize("doc", DOCS)
def test_link_anchors_exist(doc):
    text = re.sub(r"```.*?```", "", (ROOT / doc).read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "#" not in target or "://" in target:
            continue
        file, anchor = target.split("#", 1)
        path = (ROOT / doc).parent / file if file else ROOT / doc
        if path.suffix == ".md" and path.is_file() and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{doc} links to anchors that no heading has: {broken}"


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
    """The instruction classes hippie-ds adds: adapter/instructions.py generates one per table name
    that is not DeepSpeed's (tests/test_op_table.py checks both sets against DeepSpeed)."""
    return {name for info in OP_INFO.values() for name in (info.instruction, info.nonblocking_instruction)
            if name and name not in DEEPSPEED_INSTRUCTIONS}


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

def test_imports_go_down_the_layer_table_and_never_in_a_circle():
    """A module imports from its own layer and the rows above it in extending.md's layer table
    (from pure to DeepSpeed-bound), never from a row below, and no modules import each other in a
    circle. Packages' __init__ files re-export their package and are left out."""
    rank = {}
    for i, cells in enumerate(_rows(EXTENDING, LAYER_HEADER)):
        for module in _named_modules(cells[1]):
            rank[module] = (i, cells[0])
    graph = {m: {t for t in module_imports(m, "hippie_ds") if t in rank} for m in rank if (ROOT / m).is_file()}
    upward = sorted(f"{m} ({rank[m][1]}) imports {t} ({rank[t][1]})"
                    for m, targets in graph.items() for t in targets if rank[t][0] > rank[m][0])
    assert not upward, "imports against the layer order of docs/extending.md:\n" + "\n".join(upward)
    circle = circles(graph)
    assert not circle, f"modules that import each other in a circle: {circle}"


# --- figures: README's and the results pages' figures against the files they cite ----------------
#
# A figure is cited by an HTML comment (invisible when rendered) right after its table or paragraph:
#
#   <!-- figures docs/bench/scaling/vgg16-issue34/results.json
#   `hippie-1f1b` | vs stock 1F1B | {summary.by_nodes.4.hippie-1f1b.vs_1f1b} {...vs_1f1b_min} {...vs_1f1b_max}
#   "0.86x (0.77-0.94)" = 1/{summary.schedules.hippie.ratio_to_1f1b} ...
#   -->
#
# The first line names one source file (repository path; ``FILE@COMMIT`` reads it as that commit
# holds it, for a figure of a run whose file a newer run has since replaced). Each further line is
# either ``ROW | COLUMN | EXPR...`` (the cell of the table just above whose first cell is, or else
# contains, ROW and whose header cell is, or else contains, COLUMN, each matching one; ``COL1 + COL2``
# takes the row's cells in turn) or ``"TEXT" = EXPR...`` (TEXT appears in the
# table or paragraph just above). The numbers written in the cell (or TEXT), in order, are the EXPRs'
# values to the digits written: ``-1.35`` is a sign, ``1.35-1.55`` a range. An EXPR is arithmetic
# (+ - * / and parentheses, min, max, abs) over ``{dotted.json.path}`` values of the source (a list index is
# a number), or ``"quoted text"`` that a
# text source (markdown, txt, tsv) contains, whose numbers are the values, or ``=N``: a number in the
# cell that is context, not a figure (a seed count, a node count). A results page's table (one with a
# ``kind`` column) must cite every number of its figure columns, and tag each row measured, emulated or
# simulated; a figure whose source is gone, moved in the file, or changed fails.

import json
import subprocess

FIGURE_DOCS = ["README.md", "docs/results.md"]
KINDS = ("measured", "emulated", "simulated")
FUNCTIONS = {"min": min, "max": max, "abs": abs}
CONTEXT_COLUMNS = ("kind", "setup", "source", "schedule", "model", "shape", "what", "run", "question",
                   "commit", "machine", "command", "example", "optimizer", "link", "study", "page", "status",
                   "codebase")


def _numbers(text: str) -> list[tuple[float, str]]:
    """The numbers written in ``text``, in order, each with its digits as written: ``-1.35`` is
    negative after a space or bracket, ``1.35-1.55`` a range of two positive numbers. Code spans and
    link targets are dropped first, and digits inside a word (``2bw``, ``4x4``, ``1e-3``) are no
    figures; a unit right after a number (``x``, ``%``, ``GB``, ``MB``, ``ms``, ``s``, ``pt``) is."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    out = []
    for m in re.finditer(r"(?<![\w.])(?<![A-Za-z_]-)([-+\u2212]?)(\d+(?:,\d{3})*(?:\.\d+)?)((?:x|GB|MB|GiB|MiB|ms|us|s|pt)?)(?![\w]|\.\d)", text):
        value = float(m.group(2).replace(",", ""))
        out.append((-value if m.group(1) in ("-", "\u2212") else value, m.group(2)))
    return out


def _git_show(path: str, commit: str) -> str | None:
    try:
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _source(spec: str):
    """(text, json or None) of a block's source; None when it is gone."""
    path, _, commit = spec.partition("@")
    if commit:
        text = _git_show(path, commit)
        if text is None:
            pytest.skip(f"{spec}: no git history here to read it from")
    else:
        file = ROOT / path
        if not file.is_file():
            return None
        text = file.read_text()
    try:
        return text, json.loads(text)
    except ValueError:
        return text, None


def _lookup(data, dotted: str):
    node = data
    for key in dotted.split("."):
        if isinstance(node, list):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise KeyError(f"{{{dotted}}}: no key {key!r}")
    if not isinstance(node, (int, float)) or isinstance(node, bool):
        raise KeyError(f"{{{dotted}}} is {type(node).__name__}, not a number")
    return float(node)


def _evaluate(expr: str, text: str, data) -> list[float] | None:
    """An EXPR's values (one, or a quoted text's numbers); None for ``=N`` (context)."""
    if expr.startswith("="):
        return None
    if expr.startswith('"'):
        quoted = expr.strip('"')
        assert quoted in text, f"the source does not contain {quoted!r}"
        return [v for v, _ in _numbers(quoted)]
    assert data is not None, f"{expr}: the source is not JSON"
    values = {}

    def sub(m):
        name = f"_v{len(values)}"
        values[name] = _lookup(data, m.group(1))
        return name
    code = re.sub(r"\{([^}]+)\}", sub, expr)
    tree = ast.parse(code, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Call,
               ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.UAdd)
    for node in ast.walk(tree):
        assert isinstance(node, allowed), f"{expr}: only arithmetic over {{paths}}"
        if isinstance(node, ast.Call):
            assert getattr(node.func, "id", None) in FUNCTIONS, f"{expr}: only {sorted(FUNCTIONS)}"
        if isinstance(node, ast.Name):
            assert node.id in values or node.id in FUNCTIONS, f"{expr}: unknown name {node.id}"
    return [float(eval(compile(tree, "<figure>", "eval"), {"__builtins__": {}, **FUNCTIONS}, values))]


def _matches(written: float, digits: str, value: float) -> bool:
    """``written`` (its ``digits`` as written) is ``value`` to the digits written."""
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return abs(value - written) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def _figure_blocks(doc: str):
    """(line number, source spec, lines, the text just above: its table or paragraph) per block."""
    text = (ROOT / doc).read_text()
    for m in re.finditer(r"<!-- figures (\S+)\n(.*?)-->", text, flags=re.S):
        above = text[:m.start()].rstrip("\n")
        blocks_above = re.split(r"\n\s*\n", above)
        chunk = blocks_above[-1]
        # several blocks may follow one table: skip back over them
        i = len(blocks_above) - 1
        while chunk.lstrip().startswith("<!-- figures") and i > 0:
            i -= 1
            chunk = blocks_above[i]
        chunk = re.sub(r"<!-- figures .*?-->", "", chunk, flags=re.S)
        lines = [line.strip() for line in m.group(2).splitlines() if line.strip()]
        yield text[:m.start()].count("\n") + 1, m.group(1), lines, chunk


def _cell(chunk: str, row: str, column: str) -> str:
    table = [line for line in chunk.splitlines() if line.startswith("|")]
    assert table, "no table just above the block"
    header = _cells(table[0])
    body = [_cells(line) for line in table[2:]]
    cols = [i for i, h in enumerate(header) if h == column] or [i for i, h in enumerate(header) if column in h]
    assert len(cols) == 1, f"column {column!r} matches {len(cols)} header cells of {header}"
    rows = [r for r in body if r[0] == row] or [r for r in body if row in r[0]]
    assert len(rows) == 1, f"row {row!r} matches {len(rows)} rows"
    return rows[0][cols[0]]


def _check_block(doc, line, spec, lines, chunk, covered: dict) -> list[str]:
    """Problems of one block; ``covered`` collects, per cited table cell, which of its numbers the
    block's lines matched (a cell may be cited in parts, by blocks of different sources)."""
    problems = []
    source = _source(spec)
    if source is None:
        return [f"{doc}:{line}: the source {spec} is gone"]
    text, data = source
    for entry in lines:
        try:
            expected = []
            if entry.startswith('"'):
                written, _, exprs = entry.partition('" =')
                written = written[1:]
                assert written in chunk, f"{written!r} is not in the text above the block"
            else:
                row, columns, exprs = (part.strip() for part in entry.split("|", 2))
                written = " ".join(_cell(chunk, row, column.strip()) for column in columns.split(" + "))
            for expr in re.findall(r'"[^"]*"|\S+', exprs):
                values = _evaluate(expr, text, data)
                expected.extend([None] if values is None else values)
            numbers = _numbers(written)
            if entry.startswith('"'):
                assert len(numbers) == len(expected), \
                    f"{written!r} has {len(numbers)} numbers, the block gives {len(expected)}"
                start = 0
            else:  # a run of the cell's numbers, in order
                fits = [i for i in range(len(numbers) - len(expected) + 1)
                        if all(v is None or _matches(*numbers[i + k], v) for k, v in enumerate(expected))]
                assert fits, (f"{written!r}: no run of its numbers {[d for _, d in numbers]} is the source's "
                              f"{['(context)' if v is None else f'{v:.6g}' for v in expected]}")
                start = fits[0]
                key = (doc, written)
                covered.setdefault(key, set()).update(range(start, start + len(expected)))
            for (written_value, digits), value in zip(numbers[start:], expected):
                assert value is None or _matches(written_value, digits, value), \
                    f"{written!r}: {written_value:g} is not the source's {value:.6g}"
        except (AssertionError, KeyError, ValueError, IndexError, SyntaxError) as e:
            problems.append(f"{doc}:{line}: {entry[:80]!r}: {e}")
    return problems


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_cited_figures_match_their_sources(doc):
    """Every cited figure equals its source; a cited cell cites every number in it."""
    problems, covered = [], {}
    for line, spec, lines, chunk in _figure_blocks(doc):
        problems += _check_block(doc, line, spec, lines, chunk, covered)
    for (_, written), indexes in covered.items():
        numbers = _numbers(written)
        loose = [numbers[i][1] for i in range(len(numbers)) if i not in indexes]
        if loose:
            problems.append(f"{doc}: {written[:80]!r}: no block cites {loose} (a context number is cited as =N)")
    assert not problems, "figures that differ from the files they cite:\n" + "\n".join(problems)


def _tables(text: str):
    """(line number, header cells, body rows, the text after the table) of each table in ``text``."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|[-:| ]+\|?", lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            yield i + 1, _cells(lines[i]), [_cells(line) for line in lines[i + 2:j]], "\n".join(lines[j:])
            i = j
        else:
            i += 1


def test_results_page_tables_cite_and_tag_every_figure():
    """Every table of docs/results.md has a ``kind`` column (measured, emulated or simulated on each row)
    and figure blocks that cite every number of its figure columns (the others: context columns such
    as kind, setup, source)."""
    text = (ROOT / "docs" / "results.md").read_text()
    problems = []
    for line, header, body, after in _tables(text):
        kind = [i for i, h in enumerate(header) if h.lower() == "kind"]
        figures = any(_numbers(cell) for row in body for i, cell in enumerate(row[1:], start=1)
                      if header[i].lower().split()[0] not in CONTEXT_COLUMNS)
        if not kind and not figures:
            continue  # a table of links or words, no figures
        if not kind:
            problems.append(f"docs/results.md:{line}: the table has no `kind` column")
            continue
        cited = set()
        blocks = re.match(r"\s*((?:<!-- figures .*?-->\s*)+)", after, flags=re.S)
        for row_cited, columns in re.findall(r"^(.+?)\s*\|\s*(.+?)\s*\|", blocks.group(1) if blocks else "", flags=re.M):
            cited |= {(row_cited, column.strip()) for column in columns.split(" + ")}
        for row in body:
            if not any(k in row[kind[0]] for k in KINDS):
                problems.append(f"docs/results.md:{line}: row {row[0]!r} is not tagged measured, emulated or simulated")
            for i, cell in enumerate(row[1:], start=1):
                if header[i].lower().split()[0] in CONTEXT_COLUMNS or not _numbers(cell):
                    continue
                if not any((r == row[0] or r in row[0]) and (c == header[i] or c in header[i]) for r, c in cited):
                    problems.append(f"docs/results.md:{line}: row {row[0]!r}, column {header[i]!r}: no figure block cites {cell!r}")
    assert not problems, "\n".join(problems)


def test_readme_schedule_table_figures_are_cited():
    """README's schedule table cites each figure it gives (a figures block after the table)."""
    _, _, lines, _ = next(((n, s, l, c) for n, s, l, c in _figure_blocks("README.md") if "| schedule | what it buys" in c),
                          (None, None, None, None))
    assert lines, "README.md's schedule table has no figures block after it"
