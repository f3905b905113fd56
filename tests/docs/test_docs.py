"""The docs' tables name what the code has, so that none goes stale unnoticed. Pure: the
markdown is parsed, nothing is run.

- README.md's "what each schedule buys", docs/schedules.md's schedule table and docs/precision.md's
  precision table (whose cells tests/adapter/precision/test_precision.py backs) name every built-in schedule;
- docs/training.md's config-key table names every key hippie_ds/config.py accepts, and nothing else; the
  schedules README.md says tests/real_clients/test_dropin.py runs are the ones in that test's ``SCHEDULES``, and
  what it says Megatron-DeepSpeed needs names the schedules with virtual stages;
- README.md, docs/*.md, docs/results/*.md and hippie_ds/planner/README.md: every repository path they name (in
  backticks or as a link) exists;
- docs/reference.md: the op table has one row per ``OpKind``, checked against its ``OP_INFO``
  entry; the ``hippie-ds schedule list`` output lists exactly the built-in schedules;
- docs/architecture.md: the layer table ("Layers") puts every module of ``hippie_ds/`` in exactly one
  layer, and names no module that does not exist (so does hippie_ds/planner/README.md for the planner);
  the modules import down its rows;
- README.md's and docs/results.md's figures against the results files they cite: tests/docs/test_doc_figures.py.
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

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SCHEDULES_DOC = (ROOT / "docs" / "schedules.md").read_text()
PRECISION_DOC = (ROOT / "docs" / "precision.md").read_text()
TRAINING_DOC = (ROOT / "docs" / "training.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
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


@pytest.mark.parametrize(
    "doc,text,heading",
    [
        ("README.md", README, "## What each schedule buys"),
        ("docs/schedules.md", SCHEDULES_DOC, "## The built-in schedules"),
        ("docs/precision.md", PRECISION_DOC, "## The precision table"),
    ],
)
def test_schedule_tables_name_every_builtin_schedule(doc, text, heading):
    table = _table_after(text, heading)
    named = set(re.findall(r"`([a-z0-9-]+)`", table))
    missing = sorted(set(available()) - named)
    assert not missing, f"{doc}: the table after {heading!r} does not name {missing}"


def _config_keys(model: type[BaseModel], prefix: str) -> set[str]:
    """Every leaf key of a config section, dotted (``hippie.staleness.method``)."""
    keys = set()
    for name, field in model.model_fields.items():
        sub = next(
            (
                a
                for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
        keys |= _config_keys(sub, f"{prefix}{name}.") if sub else {prefix + name}
    return keys


def test_config_key_table_names_every_config_key():
    # hippie.virtual_stages is filled from pipeline.virtual_stages (a user's hippie.virtual_stages is refused)
    accepted = (_config_keys(HippieConfig, "hippie.") - {"hippie.virtual_stages"}) | {
        "pipeline.schedule",
        "pipeline.virtual_stages",
    }
    named = {_code(cells[0])[0] for cells in _rows(TRAINING_DOC, "| key | values | default | meaning |")}
    assert named == accepted, (
        f"docs/training.md's config-key table: missing {sorted(accepted - named)}, not "
        f"accepted by hippie_ds/config.py {sorted(named - accepted)}"
    )


def _dropin_schedules() -> list[str]:
    """tests/real_clients/test_dropin.py's ``SCHEDULES``, read from its source (it imports the launcher)."""
    tree = ast.parse((ROOT / "tests" / "real_clients" / "test_dropin.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SCHEDULES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/real_clients/test_dropin.py has no SCHEDULES list")


def _sentence_with(text: str, needle: str) -> str:
    start = text.index(needle)
    start = max(text.rfind(". ", 0, start), text.rfind("\n\n", 0, start)) + 1
    end = text.find(". ", text.index(needle))
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.parametrize("doc,text", [("README.md", README), ("docs/training.md", TRAINING_DOC)])
def test_dropin_claim_names_exactly_the_schedules_test_dropin_runs(doc, text):
    sentence = _sentence_with(text, "`tests/real_clients/test_dropin.py` runs")
    claimed = {n for n in _code(sentence) if n in available()}
    expected = set(_dropin_schedules())
    assert claimed == expected, (
        f"{doc}: the sentence on tests/real_clients/test_dropin.py names {sorted(claimed)}; its SCHEDULES "
        f"runs {sorted(expected)}: name exactly those"
    )
    assert "every" not in sentence, f"{doc}: the drop-in sentence claims 'every': {sentence!r}"


def test_readme_megatron_claim_names_the_module_import_for_virtual_schedules():
    """Megatron-DeepSpeed's schedules with virtual stages need ``hippie_ds.PipelineModule``, not
    only ``initialize``: the README's sentence says so and names each of them."""
    virtual = {n for n in available() if load_spec(n).virtual_stages is not None}
    assert virtual, "no built-in schedule declares virtual_stages"
    sentence = _sentence_with(README, "Megatron-DeepSpeed's GPT runs")
    assert "`PipelineModule`" in sentence and virtual <= set(_code(sentence)), (
        f"README.md's Megatron sentence must name the PipelineModule import and {sorted(virtual)}: {sentence!r}"
    )


# --- every repository path a document names exists ------------------------------------------

PATH_PREFIXES = ("tests/", "tools/", "hippie_ds/", "configs/", "schedules/", "docs/")
# paths of other projects that a document names, each with the words just before it that say whose
OTHER_PROJECTS = {
    ("docs/megatron.md", "tools/preprocess_data.py"): "Megatron's own",
    ("docs/migration.md", "tools/preprocess_data.py"): "Megatron's",
}
DOCS = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "results").glob("*.md")),
    "hippie_ds/planner/README.md",
]


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
        if word.startswith(PATH_PREFIXES) and not re.search(
            r"[*{}<>]|\.\.\.|(?<![A-Za-z])(?!README)[A-Z]{2,}(?![a-z])", word
        ):
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
            assert re.search(re.escape(owner) + r"\s+`" + re.escape(path), text), (
                f"{doc} no longer names {path} as {owner!r}: update OTHER_PROJECTS in tests/docs/test_docs.py"
            )
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
    assert not missing, (
        f"docs/reference.md's op table (section 'Ops', header {OP_HEADER!r}) has no "
        f"row for {missing}: add one per op kind from its OP_INFO entry in "
        "hippie_ds/schedules/ir.py"
    )
    unknown = sorted(set(rows) - {k.value for k in OpKind})
    assert not unknown, f"docs/reference.md's op table names ops that OpKind does not have: {unknown}"


def _new_instruction_classes() -> set[str]:
    """The instruction classes hippie-ds adds: adapter/stage/instructions.py generates one per table name
    that is not DeepSpeed's (tests/schedules/test_op_table.py checks both sets against DeepSpeed)."""
    return {
        name
        for info in OP_INFO.values()
        for name in (info.instruction, info.nonblocking_instruction)
        if name and name not in DEEPSPEED_INSTRUCTIONS
    }


@pytest.mark.parametrize("kind", list(OpKind), ids=lambda k: k.value)
def test_reference_op_table_row_matches_op_info(kind):
    rows = _op_rows()
    if kind.value not in rows:
        pytest.skip("missing row: test_reference_op_table_names_every_op_kind reports it")
    _, label, role_category, placed_by, roughly, instruction, flags = rows[kind.value]
    info = OP_INFO[kind]
    where = f"docs/reference.md's op table, row `{kind.value}`"
    assert _code(label) == ([info.short] if info.short else []), (
        f"{where}: the label cell should be {'`' + info.short + '`' if info.short else 'empty'} (OP_INFO short)"
    )
    assert info.micro_batch == bool(info.short), f"OP_INFO[{kind}]: a micro-batch op has a label, others none"
    assert role_category == f"{info.role} / {info.category}", (
        f"{where}: role / category should be '{info.role} / {info.category}'"
    )
    assert ("`prologue`" in placed_by) == info.placeable, (
        f"{where}: placed by should {'' if info.placeable else 'not '}name `prologue` (OP_INFO placeable)"
    )
    assert roughly.startswith(info.doc), f"{where}: the roughly cell should start with OP_INFO's doc {info.doc!r}"
    expected = [info.instruction] + ([info.nonblocking_instruction] if info.nonblocking_instruction else [])
    assert _code(instruction) == expected, f"{where}: the instruction cell should name {expected}, in that order"
    stock = info.instruction not in _new_instruction_classes()
    assert ("DeepSpeed's" in instruction) == stock, (
        f"{where}: `{info.instruction}` is {'DeepSpeed' if stock else 'hippie-ds'}'s (adapter/stage/instructions.py)"
    )
    assert _code(flags) == [f for f in FLAGS if getattr(info, f)], (
        f"{where}: flags should be {[f for f in FLAGS if getattr(info, f)]} (OP_INFO)"
    )


def test_reference_schedule_list_names_every_builtin_schedule():
    """The ``hippie-ds schedule list`` example output lists the built-ins, one per line."""
    lines = REFERENCE[REFERENCE.index("$ hippie-ds schedule list") :].splitlines()[1:]
    output = lines[: next(i for i, line in enumerate(lines) if not line.strip())]
    assert output and output[0].split()[0] == "schedule", "docs/reference.md: `schedule list` output has no header"
    listed = [line.split()[0] for line in output[1:]]
    assert listed == available(), (
        f"docs/reference.md's `hippie-ds schedule list` output (section 'CLI') lists {listed}; the "
        f"built-ins are {available()}: paste the command's output there"
    )


# --- module tables ----------------------------------------------------------------------------


def _modules() -> set[str]:
    """Every module of hippie_ds/ (packages' __init__ and __main__ aside), as paths from the root."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "hippie_ds").rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }


def _named_modules(cell: str, context: str = "") -> set[str]:
    """The modules a table cell names, as paths from the root. ``hippie_ds/...`` paths are taken
    as they are and set the folder for the bare names after them (`hippie_ds/adapter/`:
    `engine.py`, ...); a name with a folder of the package (`adapter/profiling/memory.py`) is under
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
        if "/" in token and not token.startswith("hippie_ds/"):  # adapter/profiling/memory.py; benchmarks/... is tools'
            token = "hippie_ds/" + token if (ROOT / "hippie_ds" / token.split("/")[0]).is_dir() else token
        elif "/" not in token:
            token = context + token
        if token.startswith("hippie_ds/"):
            named.add(token)
        context = token.rsplit("/", 1)[0] + "/"
    return named


def test_architecture_layer_table_puts_every_module_in_one_layer():
    where: dict[str, list[str]] = {}
    for cells in _rows(ARCHITECTURE, LAYER_HEADER):
        for module in _named_modules(cells[1]):
            where.setdefault(module, []).append(cells[0])
    missing = sorted(_modules() - set(where))
    assert not missing, (
        f"docs/architecture.md's layer table (header {LAYER_HEADER!r}) does not name {missing}: "
        "add each to the 'modules' cell of its layer's row, with what it holds"
    )
    twice = {m: layers for m, layers in where.items() if len(layers) > 1}
    assert not twice, f"docs/architecture.md's layer table names modules in more than one layer: {twice}"
    stale = sorted(set(where) - _modules())
    assert not stale, f"docs/architecture.md's layer table names modules that do not exist: {stale}"


@pytest.mark.parametrize(
    "doc,text,header,context",
    [
        ("docs/architecture.md (Layers)", ARCHITECTURE, LAYER_HEADER, ""),
        ("hippie_ds/planner/README.md", PLANNER_README, "| module | what |", "hippie_ds/planner/"),
    ],
)
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
    """A module imports from its own layer and the rows above it in architecture.md's layer table
    (from pure to DeepSpeed-bound), never from a row below, and no modules import each other in a
    circle. Packages' __init__ files re-export their package and are left out."""
    rank = {}
    for i, cells in enumerate(_rows(ARCHITECTURE, LAYER_HEADER)):
        for module in _named_modules(cells[1]):
            rank[module] = (i, cells[0])
    graph = {m: {t for t in module_imports(m, "hippie_ds") if t in rank} for m in rank if (ROOT / m).is_file()}
    upward = sorted(
        f"{m} ({rank[m][1]}) imports {t} ({rank[t][1]})"
        for m, targets in graph.items()
        for t in targets
        if rank[t][0] > rank[m][0]
    )
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)
    circle = circles(graph)
    assert not circle, f"modules that import each other in a circle: {circle}"
