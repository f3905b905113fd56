"""The import graph the structure tests read (tests/structure/test_structure.py, tests/docs/test_docs.py): which of a
package's modules a module imports, and the circles of such a graph."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_imports(module: str, package: str) -> set[str]:
    """The modules of ``package`` (a top-level folder) that ``module`` (a path from the root)
    imports, at any depth of its code (an import inside a function is an arrow of the structure too)."""
    path = ROOT / module
    parent = path.parent.relative_to(ROOT).parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(parent[: len(parent) - node.level + 1]) if node.level else []
            base += node.module.split(".") if node.module else []
            targets = [base + [a.name] for a in node.names]
        else:
            continue
        for parts in targets:
            while parts and parts[0] == package:  # the longest prefix that is a module
                candidate = "/".join(parts)
                if (ROOT / f"{candidate}.py").is_file():
                    out.add(f"{candidate}.py")
                    break
                if (
                    (ROOT / candidate / "__init__.py").is_file()
                    and len(parts) > 1
                    and not (ROOT / "/".join(parts[:-1] + [parts[-1] + ".py"])).is_file()
                ):
                    out.add(f"{candidate}/__init__.py")
                    break
                parts = parts[:-1]
    out.discard(module)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> the modules it imports): a depth-first search for
    back edges, each circle as the path that closes it."""
    state, found = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                found.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found
