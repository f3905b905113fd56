"""PipeDream ``graph.txt`` profiles (the published per-layer profiles of its models): parsing,
the linear order the planner uses, and conversion to a hippie-ds :class:`.profile.Profile`.
Pure Python."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .profile import LayerProfile, Profile, ProfileError


# Minibatch sizes of the published profiles (read off their tensor sizes; profiles/README.md).
PIPEDREAM_BATCH_SIZES = {"vgg16": 128, "gnmt": 32, "gnmt_large": 128}


@dataclass
class GraphNode:
    node_id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation: float  # summed over a tuple output, as PipeDream's optimizer does
    params: float
    line: int


@dataclass
class PipeDreamGraph:
    nodes: list[GraphNode]  # file order
    edges: list[tuple[str, str]]  # (producer, consumer), file order
    path: str


_META = re.compile(r"(\w+)=(\[[^\]]*\]|[^,\s]+)")


def _number(text: str, where: str, key: str) -> float:
    text = text.strip()
    try:
        if text.startswith("["):
            return sum(float(x) for x in text.strip("[]").split(";") if x.strip())
        return float(text)
    except ValueError:
        raise ProfileError(f"{where}: {key}={text!r} is not a number") from None


def parse_pipedream_graph(path: str | Path) -> PipeDreamGraph:
    """Nodes and edges of a PipeDream ``graph.txt`` (one node a line, then tab-indented edges)."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile file {str(path)!r} does not exist")
    nodes: list[GraphNode] = []
    edges: list[tuple[str, str]] = []
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{no}"
        if raw.startswith("\t") or raw.startswith(" "):
            parts = raw.strip().split(" -- ")
            if len(parts) != 2 or not all(parts):
                raise ProfileError(f"{where}: expected an edge 'nodeA -- nodeB', got {raw.strip()!r}")
            edges.append((parts[0].strip(), parts[1].strip()))
            continue
        parts = raw.split(" -- ")
        if parts and parts[-1].startswith("stage_id="):
            parts = parts[:-1]
        if len(parts) < 3:
            raise ProfileError(
                f"{where}: expected 'nodeN -- description -- forward_compute_time=..., "
                f"backward_compute_time=..., activation_size=..., parameter_size=...', "
                f"got {raw[:80]!r}"
            )
        meta = dict(_META.findall(parts[-1]))
        missing = [
            k
            for k in ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
            if k not in meta
        ]
        if missing:
            raise ProfileError(f"{where}: node {parts[0]}: missing {', '.join(missing)}")
        values = {
            k: _number(meta[k], where, k)
            for k in ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
        }
        bad = [k for k, v in values.items() if not v >= 0]
        if bad:
            raise ProfileError(f"{where}: node {parts[0]}: {bad[0]}={values[bad[0]]} must be >= 0")
        nodes.append(
            GraphNode(
                parts[0].strip(),
                " -- ".join(parts[1:-1]).strip(),
                values["forward_compute_time"],
                values["backward_compute_time"],
                values["activation_size"],
                values["parameter_size"],
                no,
            )
        )
    if not nodes:
        raise ProfileError(f"{path}: no nodes: not a PipeDream graph.txt profile")
    ids = {n.node_id for n in nodes}
    if len(ids) != len(nodes):
        seen: set[str] = set()
        dup = next(n for n in nodes if n.node_id in seen or seen.add(n.node_id))
        raise ProfileError(f"{path}:{dup.line}: node {dup.node_id} is defined twice")
    for a, b in edges:
        for x in (a, b):
            if x not in ids:
                raise ProfileError(f"{path}: edge {a} -- {b}: unknown node {x}")
    return PipeDreamGraph(nodes, edges, str(path))


def linear_order(graph: PipeDreamGraph) -> list[int]:
    """A stable topological order of the graph's nodes (indices into ``graph.nodes``): among
    ready nodes the one first in the file, then every source (an input, GNMT's ``hidden``)
    moved to just before its first consumer ("side inputs belong with their first consumer")."""
    import heapq

    index = {n.node_id: i for i, n in enumerate(graph.nodes)}
    succ: list[list[int]] = [[] for _ in graph.nodes]
    indeg = [0] * len(graph.nodes)
    for a, b in graph.edges:
        succ[index[a]].append(index[b])
        indeg[index[b]] += 1
    sources = [i for i, d in enumerate(indeg) if d == 0]
    ready = list(sources)
    heapq.heapify(ready)
    order = []
    left = list(indeg)
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            left[j] -= 1
            if left[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(graph.nodes):
        stuck = [graph.nodes[i].node_id for i in range(len(graph.nodes)) if left[i] > 0]
        raise ProfileError(f"{graph.path}: the graph has a cycle through {', '.join(stuck[:5])}")
    rest = [i for i in order if not (indeg[i] == 0 and succ[i])]
    for s in sorted((i for i in sources if succ[i]), key=lambda i: order.index(i)):
        pos = {v: k for k, v in enumerate(rest)}
        first = min(pos[j] for j in succ[s])
        rest.insert(first, s)
    return rest


def read_pipedream(path: str | Path, batch_size: int | None = None, model: str | None = None) -> Profile:
    """A :class:`Profile` from a PipeDream ``graph.txt``.

    * layers: every node, in :func:`linear_order`; ``Input*`` nodes get zero time (their time
      is data loading); times are milliseconds per minibatch in the file, seconds here;
    * ``output_bytes`` = ``activation_size`` (a tuple output's items summed);
      ``saved_bytes``: the profile does not say what a layer keeps for backward, so its output
      size is used as the estimate (over-counts in-place layers such as ReLU(inplace));
      ``input_bytes``: the summed outputs of its producers;
    * ``cut_bytes[i]``: every node's output that crosses the cut after position i, i.e. the node
      is at position <= i and one of its consumers is after i;
    * ``batch_size``: the profiled minibatch (VGG-16 128, GNMT-8 32, GNMT-16 128, known from the
      file name); for other files it must be given.
    """
    graph = parse_pipedream_graph(path)
    stem = Path(path).stem
    name = model or (stem if stem != "graph" else Path(path).parent.name or stem)
    if batch_size is None:
        batch_size = PIPEDREAM_BATCH_SIZES.get(stem) or PIPEDREAM_BATCH_SIZES.get(name)
        if batch_size is None:
            raise ProfileError(
                f"{path}: the minibatch size this PipeDream profile was measured at is not known "
                f"(known: {', '.join(sorted(PIPEDREAM_BATCH_SIZES))}); give it "
                "(--profile-batch N)"
            )
    order = linear_order(graph)
    pos = {node: k for k, node in enumerate(order)}
    index = {n.node_id: i for i, n in enumerate(graph.nodes)}
    consumers: dict[int, list[int]] = {}
    producers: dict[int, list[int]] = {}
    for a, b in graph.edges:
        consumers.setdefault(index[a], []).append(index[b])
        producers.setdefault(index[b], []).append(index[a])
    n = len(order)
    # A node's output crosses cuts pos(node) .. last_consumer_pos - 1: a difference array.
    delta = [0.0] * (n + 1)
    for i, node in enumerate(graph.nodes):
        if i in consumers:
            last = max(pos[j] for j in consumers[i])
            if last > pos[i]:
                delta[pos[i]] += node.activation
                delta[last] -= node.activation
    cuts, running = [], 0.0
    for k in range(n - 1):
        running += delta[k]
        cuts.append(max(running, 0.0))
    layers = []
    for i in order:
        node = graph.nodes[i]
        is_input = node.desc.startswith("Input") and i not in producers
        fwd, bwd = (0.0, 0.0) if is_input else (node.forward_ms / 1e3, node.backward_ms / 1e3)
        layers.append(
            LayerProfile(
                name=f"{node.node_id}:{node.desc.split('(')[0].strip() or node.node_id}",
                forward=fwd,
                backward=bwd,
                output_bytes=node.activation,
                input_bytes=sum(graph.nodes[p].activation for p in producers.get(i, [])),
                param_bytes=node.params,
            )
        )
    return Profile(model=name, batch_size=batch_size, layers=layers, cut_bytes=cuts, source=str(path))
