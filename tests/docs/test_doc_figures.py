"""README's and the results page's figures against the results files they cite. Pure: the
markdown and the cited files are read (a ``FILE@COMMIT`` source through ``git show``), nothing is run.

- README.md and docs/results.md: every figure cited by a ``<!-- figures FILE ... -->`` block equals
  what its results file holds, and a cited cell cites every number in it;
- docs/results.md: every table with figures is tagged measured, emulated or simulated on each row and
  cites every figure it gives; README's schedule table has a figures block.
"""

import ast
import json
import re
import subprocess

import pytest

from test_docs import ROOT, _cells

# The format
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
# table or paragraph just above). The EXPRs' values, to the digits written, are a run of the numbers
# written in the cell, in order (all of TEXT's numbers): ``-1.35`` is a sign, ``1.35-1.55`` a range. A
# cell may be cited in parts, by lines of blocks of different sources; every number of a cited cell
# must be cited by one of them. An EXPR is arithmetic
# (+ - * / and parentheses, min, max, abs) over ``{dotted.json.path}`` values of the source (a list index is
# a number), or ``"quoted text"`` that a
# text source (markdown, txt, tsv) contains, whose numbers are the values, or ``=N``: a number in the
# cell that is context, not a figure (a seed count, a node count). A table of docs/results.md with
# figures has a ``kind`` column (measured, emulated or simulated on each row) and cites every number of
# its figure columns (the others: CONTEXT_COLUMNS). A figure whose source is gone, moved in the file or
# changed fails. README's headline table is meant to be generated in this format from
# docs/bench/scaling/{vgg16,gnmt16}/results.json (``{summary.by_nodes.4.hippie-1f1b.vs_1f1b}`` ...).


FIGURE_DOCS = ["README.md", "docs/results.md"]
KINDS = ("measured", "emulated", "simulated")
FUNCTIONS = {"min": min, "max": max, "abs": abs}
CONTEXT_COLUMNS = (
    "kind",
    "setup",
    "source",
    "schedule",
    "model",
    "shape",
    "what",
    "run",
    "question",
    "commit",
    "machine",
    "command",
    "example",
    "optimizer",
    "link",
    "study",
    "page",
    "status",
    "codebase",
)


def _numbers(text: str) -> list[tuple[float, str]]:
    """The numbers written in ``text``, in order, each with its digits as written: ``-1.35`` is
    negative after a space or bracket, ``1.35-1.55`` a range of two positive numbers. Code spans and
    link targets are dropped first, and digits inside a word (``2bw``, ``4x4``, ``1e-3``) are no
    figures; a unit right after a number (``x``, ``%``, ``GB``, ``MB``, ``ms``, ``s``, ``pt``) is."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    out = []
    for m in re.finditer(
        r"(?<![\w.])(?<![A-Za-z_]-)([-+\u2212]?)(\d+(?:,\d{3})*(?:\.\d+)?)"
        r"((?:x|GB|MB|GiB|MiB|ms|us|s|pt)?)(?![\w]|\.\d)",
        text,
    ):
        value = float(m.group(2).replace(",", ""))
        out.append((-value if m.group(1) in ("-", "\u2212") else value, m.group(2)))
    return out


def _git_show(path: str, commit: str) -> str | None:
    try:
        return subprocess.run(
            ["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
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
    node, parts = data, dotted.split(".")
    while parts:
        key = parts.pop(0)
        if isinstance(node, list):
            node = node[int(key)]
            continue
        # a key may hold dots itself (a run named "2bw:extrapolate-made+ef=0.5"): the shortest that is a key
        while isinstance(node, dict) and key not in node and parts:
            key += "." + parts.pop(0)
        if isinstance(node, dict) and key in node:
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
    allowed = (
        ast.Expression,
        ast.BinOp,
        ast.UnaryOp,
        ast.Constant,
        ast.Name,
        ast.Load,
        ast.Call,
        ast.Add,
        ast.Sub,
        ast.Mult,
        ast.Div,
        ast.USub,
        ast.UAdd,
    )
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
    return abs(value - written) <= 0.5 * 10**-decimals * (1 + 1e-9) + 1e-12


def _figure_blocks(doc: str):
    """(line number, source spec, lines, the text just above: its table or paragraph) per block."""
    text = (ROOT / doc).read_text()
    for m in re.finditer(r"<!-- figures (\S+)\n(.*?)-->", text, flags=re.S):
        above = text[: m.start()].rstrip("\n")
        blocks_above = re.split(r"\n\s*\n", above)
        chunk = blocks_above[-1]
        # several blocks may follow one table: skip back over them
        i = len(blocks_above) - 1
        while chunk.lstrip().startswith("<!-- figures") and i > 0:
            i -= 1
            chunk = blocks_above[i]
        chunk = re.sub(r"<!-- figures .*?-->", "", chunk, flags=re.S)
        lines = [line.strip() for line in m.group(2).splitlines() if line.strip()]
        yield text[: m.start()].count("\n") + 1, m.group(1), lines, chunk


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
                assert len(numbers) == len(expected), (
                    f"{written!r} has {len(numbers)} numbers, the block gives {len(expected)}"
                )
                start = 0
            else:  # a run of the cell's numbers, in order
                fits = [
                    i
                    for i in range(len(numbers) - len(expected) + 1)
                    if all(v is None or _matches(*numbers[i + k], v) for k, v in enumerate(expected))
                ]
                assert fits, (
                    f"{written!r}: no run of its numbers {[d for _, d in numbers]} is the source's "
                    f"{['(context)' if v is None else f'{v:.6g}' for v in expected]}"
                )
                start = fits[0]
                key = (doc, written)
                covered.setdefault(key, set()).update(range(start, start + len(expected)))
            for (written_value, digits), value in zip(numbers[start:], expected):
                assert value is None or _matches(written_value, digits, value), (
                    f"{written!r}: {written_value:g} is not the source's {value:.6g}"
                )
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
            yield i + 1, _cells(lines[i]), [_cells(line) for line in lines[i + 2 : j]], "\n".join(lines[j:])
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
        figures = any(
            _numbers(cell)
            for row in body
            for i, cell in enumerate(row[1:], start=1)
            if header[i].lower().split()[0] not in CONTEXT_COLUMNS
        )
        if not kind and not figures:
            continue  # a table of links or words, no figures
        if not kind:
            problems.append(f"docs/results.md:{line}: the table has no `kind` column")
            continue
        cited = set()
        blocks = re.match(r"\s*((?:<!-- figures .*?-->\s*)+)", after, flags=re.S)
        for row_cited, columns in re.findall(
            r"^(.+?)\s*\|\s*(.+?)\s*\|", blocks.group(1) if blocks else "", flags=re.M
        ):
            cited |= {(row_cited, column.strip()) for column in columns.split(" + ")}
        for row in body:
            if not any(k in row[kind[0]] for k in KINDS):
                problems.append(f"docs/results.md:{line}: row {row[0]!r} is not tagged measured, emulated or simulated")
            for i, cell in enumerate(row[1:], start=1):
                if header[i].lower().split()[0] in CONTEXT_COLUMNS or not _numbers(cell):
                    continue
                if not any((r == row[0] or r in row[0]) and (c == header[i] or c in header[i]) for r, c in cited):
                    problems.append(
                        f"docs/results.md:{line}: row {row[0]!r}, column {header[i]!r}: no figure block cites {cell!r}"
                    )
    assert not problems, "\n".join(problems)


def test_readme_schedule_table_figures_are_cited():
    """README's schedule table cites each figure it gives (a figures block after the table)."""
    _, _, lines, _ = next(
        ((n, s, found, c) for n, s, found, c in _figure_blocks("README.md") if "| schedule | what it buys" in c),
        (None, None, None, None),
    )
    assert lines, "README.md's schedule table has no figures block after it"
