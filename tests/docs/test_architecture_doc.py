"""docs/architecture.md's walk cites the code by name: every name in its table "Names this page cites"
is defined in the file it is listed with (a function, a class, a module-level name, or a method of a
class there, ``Class.method``), and every name the walk puts in backticks with a call shape is in the
table. Pure."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _cited() -> dict[str, list[str]]:
    text = DOC.read_text().split("## Names this page cites", 1)[1]
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`hippie_ds/"):
            table[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[1])
    return table


def _defined(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_every_cited_name_is_defined_where_the_page_says():
    table = _cited()
    assert len(table) >= 15, table
    missing = [
        f"{file}: {name}" for file, names in table.items() for name in names if name not in _defined(ROOT / file)
    ]
    assert not missing, "docs/architecture.md cites names its files do not define:\n" + "\n".join(missing)


def test_the_walk_cites_only_names_in_the_table():
    walk = DOC.read_text().split("## Names this page cites", 1)[0]
    listed = {name for names in _cited().values() for name in names}
    # CamelCase classes and Class.method of hippie-ds's, as the walk writes them; DeepSpeed's own are named as such
    ours = {
        n
        for n in re.findall(r"`([A-Z][A-Za-z]+(?:\.[_a-z]+)?)`", walk)
        if not n.startswith(
            ("PipelineEngine", "PipelineModule", "TrainSchedule", "DualPipeVModule", "ApplyBufferedUpdate")
        )
    }
    assert ours <= listed, f"cited in the walk but not in its table: {sorted(ours - listed)}"
