"""PipeDream's own optimizer on a graph.txt profile, re-implemented to check against its numbers.

A re-implementation (not a copy) of ``optimizer/optimizer_graph_hierarchical.py`` and the
antichain machinery of ``graph/graph.py`` from github.com/msr-fiddle/pipedream (MIT license,
Microsoft Corporation), with the same choices, so the reference plans quoted in
``profiles/README.md`` can be reproduced:

* ``Input*`` sources are zeroed and removed, ``__getitem__`` sinks removed;
* the states of the dynamic program are the *antichains* reachable from the first source (a
  downward-closed set of nodes, named by its frontier, "augmented" with the earlier nodes whose
  outputs are still needed later); a state's compute time, activation and parameter sizes are
  the sums over the state's nodes and all their predecessors; its output size is the sum of
  the activations of its augmented frontier. ``len(states)`` is the number of legal cuts;
* per level of a hierarchical machine (servers x GPUs), A[i][j][m] = best time per minibatch
  of states i..j on m+1 machines: a stage replicated r times costs
  (T + 4 (r-1) P / (bw r)) / r (divided also by the machines inside a machine at upper levels),
  and a split takes max(A[i][k][m-m'], stage(k+1..j, m')). As in PipeDream's default
  (``activation_compression_ratio=None``) the activation transfer 2 A / (bw r) is computed but
  *not* counted; ``count_transfers=True`` counts it as PipeDream does with a compression ratio
  of 1.

This module is for validation and the ``pipedream`` figures in reports; the planner's own
layer-sequence recurrence is :func:`hippie_ds.planner.partition.pipedream_dp`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .pipedream_profile import PipeDreamGraph, parse_pipedream_graph


@dataclass
class _Node:
    node_id: str
    desc: str
    compute: float  # (forward + backward) ms
    activation: float
    params: float


class _Graph:
    """Just enough of PipeDream's Graph: insertion-ordered nodes, out/in edge lists."""

    def __init__(self, graph: PipeDreamGraph) -> None:
        self.nodes: dict[str, _Node] = {}
        for n in graph.nodes:
            self.nodes[n.node_id] = _Node(n.node_id, n.desc, n.forward_ms + n.backward_ms, n.activation, n.params)
        self.edges: dict[str, list[str]] = {}
        self.in_edges: dict[str, list[str]] = {}
        for a, b in graph.edges:
            self.in_edges.setdefault(b, []).append(a)
            self.edges.setdefault(a, []).append(b)
        self._pred: dict[str, frozenset] = {}
        self._succ: dict[str, frozenset] = {}

    def sources(self) -> list[str]:
        return [n for n in self.nodes if not self.in_edges.get(n)]

    def sinks(self) -> list[str]:
        return [n for n in self.nodes if not self.edges.get(n)]

    def remove(self, node: str) -> None:
        del self.nodes[node]
        for out in self.edges.pop(node, []):
            self.in_edges[out].remove(node)
        for inn in self.in_edges.pop(node, []):
            self.edges[inn].remove(node)

    def predecessors(self, node: str) -> frozenset:
        if node not in self._pred:
            out: set[str] = set()
            for inn in self.in_edges.get(node, []):
                out.add(inn)
                out |= self.predecessors(inn)
            self._pred[node] = frozenset(out)
        return self._pred[node]

    def successors(self, node: str) -> frozenset:
        if node not in self._succ:
            out: set[str] = set()
            for o in self.edges.get(node, []):
                out.add(o)
                out |= self.successors(o)
            self._succ[node] = frozenset(out)
        return self._succ[node]

    def all_predecessors(self, antichain) -> set[str]:
        out: set[str] = set()
        for a in antichain:
            out |= self.predecessors(a)
            out.add(a)
        return out

    # -- antichains ----------------------------------------------------------------------------
    def augment(self, antichain: list[str]) -> list[str]:
        extra: set[str] = set()
        for a in antichain:
            preds = self.predecessors(a)
            for p in preds:
                for out in self.edges[p]:
                    if out not in preds and out != a:
                        extra.add(p)
        # PipeDream lists the extra nodes in set order; only the set matters downstream.
        return sorted(extra) + list(antichain)

    def deaugment(self, augmented: list[str]) -> list[str]:
        remove = {a for a in augmented for b in augmented if b in self.successors(a)}
        out: list[str] = []
        for a in augmented:
            if a not in remove and a not in out:
                out.append(a)
        return out

    def next_antichains(self, antichain: list[str]) -> list[list[str]]:
        members = set(antichain)
        augmented = self.augment(antichain)
        aug_set = set(augmented)
        out = []
        for a in augmented:
            for nxt in self.edges.get(a, []):
                if nxt in members:
                    continue
                if any(s in aug_set for s in self.successors(nxt)):
                    continue
                out.append(self.deaugment([x if x != a else nxt for x in augmented]))
        return out


@dataclass
class State:
    antichain: list[str]  # augmented antichain
    compute_time: float = 0.0  # seconds, all nodes up to and including the antichain
    activation_size: float = 0.0
    parameter_size: float = 0.0
    output_activation_size: float = 0.0
    predecessors: list[int] = field(default_factory=list)  # states with an edge into this one


def antichain_states(graph: PipeDreamGraph | str | Path) -> tuple[list[State], "_Graph"]:
    """PipeDream's states (antichain DAG in its topological order), after its input/sink
    clean-up. ``len(states)`` = the number of legal cuts."""
    if not isinstance(graph, PipeDreamGraph):
        graph = parse_pipedream_graph(graph)
    gr = _Graph(graph)
    for s in gr.sources():
        if gr.nodes[s].desc.startswith("Input"):
            gr.remove(s)
    for s in gr.sinks():
        if gr.nodes[s].desc.startswith("__getitem__"):
            gr.remove(s)
    antichains, dag_edges, dag_order = _antichain_dag(gr)
    order = _pipedream_topological_order(dag_edges, dag_order)
    states = []
    for u in order:
        aug = gr.augment(antichains[u])
        st = State(antichain=aug)
        st.output_activation_size = sum(gr.nodes[a].activation for a in aug)
        for p in gr.all_predecessors(aug):
            node = gr.nodes[p]
            st.compute_time += node.compute / 1000.0
            st.activation_size += node.activation
            st.parameter_size += node.params
        states.append(st)
    # PipeDream uses every (transitive) predecessor state as a possible split point.
    position = {u: i for i, u in enumerate(order)}
    incoming: dict[int, list[int]] = {}
    for u, vs in dag_edges.items():
        for v in vs:
            if u not in incoming.setdefault(v, []):
                incoming[v].append(u)
    closure: dict[int, set[int]] = {}
    for u in order:  # topological: a state's predecessors come first
        pre: set[int] = set()
        for p in incoming.get(u, []):
            pre.add(position[p])
            pre |= closure[p]
        closure[u] = pre
    for u, st in zip(order, states):
        st.predecessors = sorted(closure[u])
    return states, gr


def _antichain_dag(gr: "_Graph") -> tuple[list[list[str]], dict[int, list[int]], list[int]]:
    """Breadth-first enumeration of the antichains from the first source, as PipeDream's
    antichain_dag: (antichains, DAG edges by antichain id, PipeDream's node insertion order)."""
    start = [gr.sources()[0]]
    key = lambda ac: tuple(sorted(ac))  # noqa: E731
    ids: dict[tuple, int] = {key(start): 0}
    antichains: list[list[str]] = [start]
    dag_edges: dict[int, list[int]] = {0: []}
    dag_order: list[int] = [0]
    expanded: set[tuple] = set()
    queue = [start]
    while queue:
        ac = queue.pop(0)
        k = key(ac)
        if k in expanded:
            continue
        expanded.add(k)
        for nxt in gr.next_antichains(ac):
            nk = key(nxt)
            if nk not in ids:
                ids[nk] = len(antichains)
                antichains.append(nxt)
            src, dst = ids[k], ids[nk]
            for x in (src, dst):
                if x not in dag_edges:
                    dag_edges[x] = []
                if x not in dag_order:
                    dag_order.append(x)
            dag_edges[src].append(dst)
            queue.append(nxt)
    return antichains, dag_edges, dag_order


def _pipedream_topological_order(dag_edges: dict[int, list[int]], dag_order: list[int]) -> list[int]:
    """PipeDream's topological sort: DFS from each node in insertion order (descriptions are all
    empty), children in edge order, prepending each finished node."""
    marked: set[int] = set()
    order: list[int] = []

    def visit(u: int) -> None:
        stack = [(u, iter(dag_edges.get(u, [])))]
        marked.add(u)
        while stack:
            node, it = stack[-1]
            for v in it:
                if v not in marked:
                    marked.add(v)
                    stack.append((v, iter(dag_edges.get(v, []))))
                    break
            else:
                stack.pop()
                order.insert(0, node)

    for u in dag_order:
        if u not in marked:
            visit(u)
    return order


@dataclass
class PipeDreamPlan:
    time_per_minibatch: float  # seconds, PipeDream's predicted pipeline time
    stages: list[tuple[int, int]]  # (first state, end state) of every stage
    replication: list[int]  # machines per stage (all levels multiplied)
    single_machine_time: float  # seconds, the whole model on one GPU
    data_parallel_time: float  # PipeDream's estimate for plain data parallelism
    num_states: int


def _level(C, P, out_act, pred_mask, machines, within, bandwidth, final, straight, count_transfers, rows=None):
    """One level of PipeDream's compute_partitioning, vectorized over (k, j) with numpy.

    ``C``/``P``: (n+1) x n compute time / parameter bytes of states i..j (row 0: from the start,
    row i: after state i-1), inf where undefined. Returns T[i, j, m] (inf where PipeDream has
    None) for the rows asked (all, or only row 0 at the final level), and for each solved row the
    choice (k, machines left, machines of the last stage) as int arrays (k = -1: one stage).
    PipeDream's loop is O(n^3 m^2); the inner minimum over k is the vectorized part. Ties: the
    first k (PipeDream takes the first in a set's iteration order, so equal times, maybe another
    split)."""
    import numpy as np

    n = C.shape[1]
    T = np.full((C.shape[0], n, machines), np.inf)
    P = np.where(np.isfinite(P), P, 0.0)  # C is inf where undefined; inf * 0 would give nan
    ms = range(1) if straight else range(machines)
    for m in ms:
        T[:, :, m] = (C + (4 * m * P) / (bandwidth * (m + 1)) / within) / (m + 1)
    # Last stage k+1..j on mp machines (no division by `within` here, as in PipeDream).
    last = {}
    for mp in range(1, 2 if straight else machines):
        L = (C[1:, :] + (4 * (mp - 1) * P[1:, :]) / (bandwidth * mp)) / mp
        L = np.where(pred_mask, L, np.inf)  # k must be a predecessor state of j
        if count_transfers:
            L = np.maximum(L, (2.0 * out_act / (bandwidth * mp))[:, None])
            out_j = np.where(np.arange(n) < n - 1, 2.0 * out_act / (bandwidth * mp), 0.0)
            L = np.maximum(L, out_j[None, :])
        last[mp] = L
    solve = range(C.shape[0] if not final else 1) if rows is None else rows
    keep = final or rows is not None  # a full non-final pass would hold O(n^2 m) choices per row
    choices = {}
    for i in solve:
        if i >= n:
            continue
        ck = np.full((n, machines), -1, dtype=np.int64)
        cm = np.full((n, machines), -1, dtype=np.int64)
        cu = np.zeros((n, machines), dtype=np.int64)
        for m in ms:
            cu[:, m] = m + 1
        for m in range(1, machines):
            best = T[i, :, m].copy()
            for mp in range(1, 2 if straight else m + 1):
                prev = T[i, i:, m - mp]  # over k >= i
                vals = np.maximum(prev[:, None], last[mp][i:, :])  # (k, j)
                k_best = np.argmin(vals, axis=0)
                v_best = vals[k_best, np.arange(n)]
                better = v_best < best
                better[: i + 1] = False
                best = np.where(better, v_best, best)
                ck[:, m] = np.where(better, k_best + i, ck[:, m])
                cm[:, m] = np.where(better, m - mp, cm[:, m])
                cu[:, m] = np.where(better, mp, cu[:, m])
            T[i, :, m] = best
        if keep:
            choices[i] = (ck, cm, cu)
    return T, choices


def _splits(choice, start, end, machines):
    """Stages (start, end) and machines of each, from one solved row (analyze_partitioning)."""
    ck, cm, cu = choice
    j, m = end - 1, machines - 1
    splits, reps = [], []
    while ck[j, m] >= 0:
        k = int(ck[j, m])
        splits.append(k + 1)
        reps.append(int(cu[j, m]))
        j, m = k, int(cm[j, m])
    reps.append(int(cu[j, m]))
    splits.reverse()
    reps.reverse()
    bounds = [start] + splits + [end]
    return list(zip(bounds, bounds[1:])), reps


def pipedream_optimizer(
    profile: str | Path | PipeDreamGraph,
    machines: list[int],
    bandwidths: list[float],
    straight: bool = False,
    count_transfers: bool = True,
) -> PipeDreamPlan:
    """Run PipeDream's hierarchical optimizer: ``machines`` per level (e.g. [4, 4]: 4 GPUs a
    server, 4 servers), ``bandwidths`` per level in bytes/s (e.g. [100e9, 12.5e9])."""
    if len(machines) != len(bandwidths) or not machines:
        raise ValueError("machines and bandwidths need one entry per level")
    import numpy as np

    states, _ = antichain_states(profile)
    n = len(states)
    ct = np.array([s.compute_time for s in states])
    pt = np.array([s.parameter_size for s in states])
    # Row 0: states 0..j; row i >= 1: states i..j, i.e. state j minus state i-1 (j >= i).
    C = np.full((n + 1, n), np.inf)
    P = np.full((n + 1, n), np.inf)
    C[0], P[0] = ct, pt
    for i in range(1, n):
        C[i, i:] = ct[i:] - ct[i - 1]
        P[i, i:] = pt[i:] - pt[i - 1]
    out_act = np.array([s.output_activation_size for s in states])
    pred_mask = np.zeros((n, n), dtype=bool)  # [k, j]: state k is a (transitive) predecessor of j
    for j, s in enumerate(states):
        pred_mask[s.predecessors, j] = True

    tables = []
    within = 1
    for level, (m, bw) in enumerate(zip(machines, bandwidths)):
        T, choices = _level(
            C,
            P,
            out_act,
            pred_mask,
            m,
            within,
            bw,
            final=(level == len(machines) - 1),
            straight=straight,
            count_transfers=count_transfers,
        )
        tables.append((T, choices, m, within, bw, level == len(machines) - 1, C.copy()))
        within = m
        C = T[:, :, -1].copy()

    # Walk the levels from the top: each stage of a level is split by the level below.
    ranges = [((0, n), 1)]
    for level in range(len(tables) - 1, -1, -1):
        T, choices, m, w, bw, final, C_level = tables[level]
        new = []
        for (start, end), rep in ranges:
            if start not in choices:  # a row the level did not keep the choices of
                _, extra = _level(
                    C_level,
                    P,
                    out_act,
                    pred_mask,
                    m,
                    w,
                    bw,
                    final=False,
                    straight=straight,
                    count_transfers=count_transfers,
                    rows=[start],
                )
                choices.update(extra)
            sub, reps = _splits(choices[start], start, end, m)
            new.extend((rng, rep * r) for rng, r in zip(sub, reps))
        ranges = new

    total = states[-1].compute_time
    p_total = states[-1].parameter_size
    dp_time, within = total, 1
    for m, bw in zip(machines, bandwidths):
        dp_time = (dp_time + (4 * (m - 1) * p_total) / (bw * m) / within) / m
        within = m
    return PipeDreamPlan(
        time_per_minibatch=float(tables[-1][0][0, n - 1, machines[-1] - 1]),
        stages=[r for r, _ in ranges],
        replication=[rep for _, rep in ranges],
        single_machine_time=total,
        data_parallel_time=dp_time,
        num_states=n,
    )
