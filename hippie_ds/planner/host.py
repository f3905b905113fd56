"""The host: the CPU time it takes to issue one instruction, by kind. Pure Python.

A GPU runs a kernel while its host issues the next one, so an instruction takes at least the
longer of its device time and its host time. Many small micro-batches shrink the device time of
each instruction but not its host time (the engine's handler, autograd's graph, the collective's
bookkeeping): past the point where the host cannot feed the device, more micro-batches only add
host work. The planner and the simulator therefore take, per instruction,
``max(device time, host time)``, with the host time of a kind

    fixed + per_layer x (layers the instruction runs)

and, for a backward, ``recompute_per_layer`` x the layers it re-computes on top. The optimizer
step's host time adds to the step (it issues no device time the profile knows of).

Measured where the work is: ``python -m tools.bench scaling`` records every instruction's CPU
time on the rank that ran it and fits these terms over its runs (:func:`fit_host_cost`,
``OUT/host_cost.json``). For an emulated cluster whose ranks share cores, time-dilated by D, a
rank gets ``D x cores / ranks`` cores of host, so the measured CPU is scaled by
``ranks / (cores x D)`` (:meth:`HostCost.scaled`); for a real cluster give it as measured there.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

# The instruction classes (DeepSpeed's and hippie-ds's generated ones) by host-cost kind. A class not
# named here is counted under "other" (load, weight-version bookkeeping): fitted, never charged.
KIND_OF_INSTRUCTION = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "BackwardInputPass": "backward",
    "BackwardWeightPass": "backward",
    "ForwardBackwardPass": "backward",
    "SendActivation": "p2p",
    "RecvActivation": "p2p",
    "SendGrad": "p2p",
    "RecvGrad": "p2p",
    "ISendActivation": "p2p",
    "ISendGrad": "p2p",
    "WaitSends": "p2p",
    "ReduceGrads": "allreduce",
    "ReduceTiedGrads": "allreduce",
    "StartAllReduce": "allreduce",
    "WaitAllReduce": "allreduce",
    "CopyGradsToBuffer": "allreduce",
    "OptimizerStep": "step",
    "StageOptimizerStep": "step",
    "ApplyBufferedUpdate": "step",
}
KINDS = ("forward", "backward", "p2p", "allreduce", "step")


def host_kind(instruction: str) -> str:
    """The host-cost kind of an instruction class name (``other`` when it has none)."""
    return KIND_OF_INSTRUCTION.get(instruction, "other")


class KindCost(BaseModel):
    """Host seconds of one instruction of a kind: ``fixed`` + ``per_layer`` x its layers."""

    model_config = ConfigDict(extra="forbid")

    fixed: float = Field(0.0, ge=0, description="seconds per instruction")
    per_layer: float = Field(0.0, ge=0, description="seconds per layer the instruction runs")

    def at(self, layers: float) -> float:
        return self.fixed + self.per_layer * layers


class HostCost(BaseModel):
    """What the host spends per instruction, by kind (the module docstring says how it is used)."""

    model_config = ConfigDict(extra="forbid")

    forward: KindCost = KindCost()
    backward: KindCost = KindCost()
    recompute_per_layer: float = Field(0.0, ge=0, description="extra backward seconds per re-computed layer")
    p2p: KindCost = KindCost()
    allreduce: KindCost = KindCost()
    step: KindCost = KindCost()
    source: str = Field("", description="where the figures come from (measurement, scaling)")

    def scaled(self, factor: float, why: str = "") -> "HostCost":
        """Every time x ``factor`` (e.g. ranks / (cores x D) on a dilated emulated cluster)."""

        def s(k: KindCost) -> KindCost:
            return KindCost(fixed=k.fixed * factor, per_layer=k.per_layer * factor)

        return HostCost(
            forward=s(self.forward),
            backward=s(self.backward),
            recompute_per_layer=self.recompute_per_layer * factor,
            p2p=s(self.p2p),
            allreduce=s(self.allreduce),
            step=s(self.step),
            source=f"{self.source}; x {factor:.4g}" + (f" ({why})" if why else ""),
        )

    def forward_s(self, layers: float) -> float:
        return self.forward.at(layers)

    def backward_s(self, layers: float, recomputed: float = 0.0) -> float:
        return self.backward.at(layers) + self.recompute_per_layer * recomputed

    def step_s(self, layers: float) -> float:
        return self.step.at(layers)


def floor(device: float, host: float) -> float:
    """An instruction's time: the device's, or the host's when the host cannot keep up."""
    return max(device, host)


def apply_to_costs(costs, host: HostCost, layers: list[int], recomputed: list[int], v: int = 1):
    """The simulator's ``costs`` (hippie_ds.schedules.costs.Costs, one stage per pipeline stage of
    ``layers`` layers, ``recomputed`` of them re-computed, in ``v`` chunks) with the host's floor on
    each stage's forward and backward, its optimizer step added and its all-reduce issue at least
    the host's. A send or receive's host time is the cluster's message latency
    (:attr:`.cluster.Cluster.message_latency`), in the p2p cost already."""
    stages = []
    for s, st in enumerate(costs.stages):
        backward = max(st.backward, host.backward_s(layers[s] / v, recomputed[s] / v) - st.recompute)
        stages.append(
            st.model_copy(
                update={
                    "forward": floor(st.forward, host.forward_s(layers[s] / v)),
                    "backward": backward,
                    "optimizer_time": st.optimizer_time + host.step_s(layers[s]),
                    "allreduce_issue_time": max(st.allreduce_issue_time, host.allreduce.fixed),
                }
            )
        )
    return costs.model_copy(update={"stages": stages})


class Sample(NamedTuple):
    """One rank's CPU for one kind of instruction over a run: ``count`` instructions that ran
    ``layers`` layers each (``recomputed`` of them re-computed, for a backward), ``cpu_s`` in all."""

    kind: str
    layers: int
    recomputed: int
    count: int
    cpu_s: float


def _least_squares(rows: list[tuple[list[float], float, float]]) -> list[float]:
    """Non-negative weighted least squares of y ~ x . beta (rows: (x, y, weight)), by normal equations
    on the columns that stay positive (at most 3 columns: solved exactly). Pure."""
    n = len(rows[0][0]) if rows else 0
    active = [j for j in range(n) if any(x[j] for x, _, _ in rows)]
    while active:
        a = [[sum(w * x[i] * x[j] for x, _, w in rows) for j in active] for i in active]
        b = [sum(w * x[i] * y for x, y, w in rows) for i in active]
        beta = _solve(a, b)
        if beta is None:  # collinear columns: drop the last and retry
            active = active[:-1]
            continue
        neg = [j for j, v in zip(active, beta) if v < 0]
        if not neg:
            out = [0.0] * n
            for j, v in zip(active, beta):
                out[j] = v
            return out
        active = [j for j in active if j not in neg[:1]]
    return [0.0] * n


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular. Pure."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-18 * max(1.0, max(abs(v) for row in m for v in row[:n])):
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_host_cost(samples: Iterable[Sample], source: str = "") -> HostCost:
    """The host cost that best explains ``samples`` (per kind: CPU per instruction ~ fixed +
    per_layer x layers [+ recompute_per_layer x re-computed layers for a backward]), each sample
    weighted by its instruction count; terms are kept non-negative. Pure."""
    by_kind: dict[str, list[Sample]] = {}
    for s in samples:
        if s.count > 0:
            by_kind.setdefault(s.kind, []).append(s)
    fields: dict = {}
    recompute = 0.0
    for kind in KINDS:
        rows = by_kind.get(kind, [])
        if not rows:
            continue
        if kind == "backward":
            beta = _least_squares([([1.0, s.layers, s.recomputed], s.cpu_s / s.count, s.count) for s in rows])
            recompute = beta[2]
        elif kind in ("forward", "step"):
            beta = _least_squares([([1.0, s.layers], s.cpu_s / s.count, s.count) for s in rows])
        else:  # p2p and all-reduce: per instruction
            beta = [sum(s.cpu_s for s in rows) / sum(s.count for s in rows), 0.0]
        fields[kind] = KindCost(fixed=beta[0], per_layer=beta[1])
    return HostCost(**fields, recompute_per_layer=recompute, source=source)
