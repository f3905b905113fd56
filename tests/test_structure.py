"""The package's shape (docs/extending.md): each module imports only from its own layer and the
purer ones, the pure layers import neither torch nor DeepSpeed, no modules import each other in a
circle, and no module of the package or the tools is over 400 lines."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# from pure to DeepSpeed-bound, as docs/extending.md's table orders them
LAYERS = {"formatting": 0, "data_files": 0, "config": 1, "schedules": 2, "planner": 3, "adapter": 4, "_compat": 4,
          "checkpoint_state": 4, "profiler": 5, "cli": 6}
PURE = 3  # layers up to the planner: no torch, no DeepSpeed
MAX_LINES = 400


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.glob("hippie_ds/**/*.py")}


def _layer(module: str) -> int:
    return 6 if module == "hippie_ds" else LAYERS[module.split(".")[1]]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (a lazy import is a dependency too); ``from
    pkg import sub`` counts as ``pkg.sub`` alone."""
    me = _name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
            found |= subs or {base}
    return found


def test_every_module_is_in_a_layer():
    assert sorted(m for m in MODULES if m != "hippie_ds" and m.split(".")[1] not in LAYERS) == []


def test_modules_import_only_their_own_layer_and_purer_ones():
    wrong = [f"{m} -> {i}" for m, p in MODULES.items() for i in _imports(p) if i in MODULES and _layer(i) > _layer(m)]
    assert wrong == []


def test_pure_layers_import_neither_torch_nor_deepspeed():
    wrong = [f"{m}: {i}" for m, p in MODULES.items() if _layer(m) <= PURE for i in _imports(p)
             if i.split(".")[0] in ("torch", "deepspeed")]
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    assert _cycles(graph) == []
    graph["hippie_ds.config"].add("hippie_ds.schedules")  # the check finds one when there is one
    graph["hippie_ds.schedules"].add("hippie_ds.config")
    assert _cycles(graph) == [["hippie_ds.config", "hippie_ds.schedules"]]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in [*ROOT.glob("hippie_ds/**/*.py"), *ROOT.glob("tools/**/*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
