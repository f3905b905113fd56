"""The planner's analytic cost model of a pipeline configuration (see :mod:`hippie_ds.planner.plan`
for the formulas): layouts, step time, memory. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from . import partition as part
from .cluster import Cluster
from .host import floor
from .plan_file import GB
from .profile import PlannerError, Profile
from .recompute import ChunkedRecompute, StageRecompute
from .traits import schedule_traits
from .split_bounds import split_backward_time, split_stage_times

# Copies of its delayed gradient's size a deferred stage holds (hippie_ds.adapter.gradients.stage,
# adapter.staleness.prediction): the gradient buffer, and the default staleness correction's
# ("extrapolate-made") delta of the delayed weights, one buffer between steps.
DEFERRAL_COPIES = 2

# ---------------------------------------------------------------------------------------------
# Cost model


@dataclass
class _Layout:
    """A pipeline depth and a partition, with everything per stage at the profile's batch size."""

    K: int
    r: int
    parts: list[int]
    fwd: list[float]
    bwd: list[float]
    wgt: list[float]  # W of a split backward: the first stage's whole backward (its data
    # needs no gradient), else its layers' backward_weight
    wgt_recomputed: list[list[list[float]]]  # [s][c][k]: of that, what re-computing prefix k of chunk c
    # moves into the input pass (a re-entrant checkpoint's
    # backward does it all)
    params: list[float]
    cut_out: list[float]  # bytes crossing the cut after the stage (0 for the last; with
    # chunks, the largest of its chunks' outgoing cuts)
    inter_link: list[bool]  # the link to the next stage crosses nodes for some replica
    rec: list  # StageRecompute, or ChunkedRecompute with chunks
    ar_work: list[float]  # seconds of all-reduce work at full link bandwidth (+ latency)
    ar_inter: bool  # the data-parallel groups span nodes
    v: int = 1  # model chunks per stage (virtual stages); parts has K v + 1 entries
    kind: str = "interleaved"  # their layout (hippie_ds.schedules.layout)
    working: list[float] = field(default_factory=list)  # the largest working memory of one of the stage's
    # layers (the loss's on the last part)

    def moved(self, s: int, k) -> float:
        """W of stage s that re-computing ``k`` moves into the input pass."""
        if self.v == 1:
            return self.wgt_recomputed[s][0][k]
        ks = self.rec[s]._k(k)
        return sum(self.wgt_recomputed[s][c][x] for c, x in enumerate(ks))

    def chunk_ranges(self, s: int) -> list[tuple[int, int]]:
        """[first, end) layers of each chunk of stage s, by chunk."""
        from ..schedules.layout import Layout

        return [(self.parts[p], self.parts[p + 1]) for p in Layout(self.kind, self.K, self.v).chunks(s)]

    @property
    def ar_total(self) -> float:
        return sum(self.ar_work)


@dataclass
class _Estimate:
    step: float
    memory: list[float]  # per stage, bytes per device
    in_flight: list[int]
    deferred: list[int]
    predicted_by: str = "analytic"
    # Steps to a loss relative to no staleness, the delayed layers priced at the measured
    # staleness price; a priced objective ranks by it (objectives.py).
    steps_factor: float = 1.0


class _Model:
    """Profile + cluster + options: builds layouts and estimates configurations."""

    def __init__(
        self,
        profile: Profile,
        cluster: Cluster,
        global_batch: int,
        state_factor: float,
        memory_metric: str,
        memory_cap: float,
    ) -> None:
        self.profile, self.cluster, self.G = profile, cluster, global_batch
        self.state_factor, self.metric, self.cap = state_factor, memory_metric, memory_cap
        layers = profile.layers
        self.n = len(layers)
        self.b0 = profile.batch_size
        self.fwd = [x.forward for x in layers]
        self.bwd = [x.backward for x in layers]
        self.wgt = [x.weight_time for x in layers]
        self.extra = [x.split_time for x in layers]  # the engine's split backward beyond the whole one
        self.any_split_extra = any(self.extra)
        # the first part's whole backward runs as W unless the profile timed a split of its first layer
        self.first_whole = layers[0].split_extra is None
        self.rc = [x.recompute_time for x in layers]
        self.saved = [x.saved for x in layers]
        self.out = [x.output_bytes for x in layers]
        self.out_saved = [x.output_saved is not False for x in layers]
        self.params = [x.param_bytes for x in layers]
        # A module tied across layers (TiedLayerSpec) counts at its first use; every other stage
        # that uses it holds a copy (parameters, gradients, optimizer state, all-reduce).
        self.tied_at = [x.tied_key for x in layers]
        self.tied_first: dict[str, tuple[int, float]] = {}
        for i, x in enumerate(layers):
            if x.tied_key is not None and x.tied_key not in self.tied_first:
                self.tied_first[x.tied_key] = (i, x.param_bytes)
        self.cuts = profile.cuts()
        self.working = profile.working()
        loss = profile.loss
        # The loss runs on the last model part: its times join the last layer's (it is never
        # re-computed: self.rc stays the layer's), its saved bytes what that part keeps.
        self.loss_saved, self.loss_working = (0.0, 0.0) if loss is None else (loss.saved, profile.loss_working())
        if loss is not None:
            self.fwd[-1] += loss.forward
            self.bwd[-1] += loss.backward
            self.wgt[-1] += loss.weight_time
        # Stage 0 keeps its loaded input per in-flight micro-batch (0 when the profile omits it).
        self.data_bytes = layers[0].input_bytes or 0.0
        self.work = [f + b for f, b in zip(self.fwd, self.bwd)]
        self.prefix_work = part.prefix_sums(self.work)
        total = self.prefix_work[-1]
        if total <= 0:
            raise PlannerError(f"profile {profile.model!r}: every layer has zero forward and backward time")
        self.single_throughput = self.b0 / total
        self.P = cluster.devices
        self._layouts: dict[tuple, _Layout] = {}

    # -- layouts --------------------------------------------------------------------------------
    def layout(self, K: int, parts: Sequence[int] | None = None, v: int = 1, kind: str = "interleaved") -> _Layout:
        """Depth K with ``parts`` (K v + 1 boundaries; default: the balanced partition), v model
        chunks per stage placed by layout ``kind``; per-stage figures sum the stage's chunks."""
        from ..schedules.layout import Layout

        if parts is None:
            parts = (
                part.min_bottleneck(self.work, K, self.prefix_work)[0]
                if v == 1
                else part.chunked_partition(self.work, K, v, kind, self.prefix_work)[0]
            )
        parts = list(parts)
        key = (K, v, kind, tuple(parts))
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        c = self.cluster
        r = self.P // K
        geometry = Layout(kind, K, v)
        fwd, bwd, wgt, wgt_rec, params, cut_out, inter, rec, ar, working = [], [], [], [], [], [], [], [], [], []
        dpn = c.devices_per_node
        # Stage s of replica q runs on device q*K + s: its group spans nodes unless all r fit in one.
        spans_nodes = r > 1 and ((r - 1) * K) // dpn != 0
        ar_bw = c.inter_node_bandwidth if spans_nodes else c.intra_node_bandwidth
        for s in range(K):
            ranges = [(parts[p], parts[p + 1]) for p in geometry.chunks(s)]
            fwd.append(sum(sum(self.fwd[a:b]) for a, b in ranges))
            bwd.append(sum(sum(self.bwd[a:b]) for a, b in ranges))
            w = sum(self.stage_params(ranges).values())
            params.append(w)
            working.append(
                max(
                    [x for a, b in ranges for x in self.working[a:b]]
                    + [self.loss_working if any(b == self.n for _, b in ranges) else 0.0]
                )
            )
            cut_out.append(max(self.cuts[b - 1] if b < self.n else 0.0 for a, b in ranges))
            # Device d = q*K + s (pipeline innermost): does replica q's link s -> s+1 cross nodes?
            has_next = ranges[0][1] < self.n if v == 1 else s < K - 1
            inter.append(has_next and any((q * K + s) // dpn != (q * K + s + 1) // dpn for q in range(r)))
            chunk_recs, weight, moved_all = [], 0.0, []
            for a, b in ranges:
                chunk_recs.append(self._stage_recompute(a, b))
                first = a == 0 and self.first_whole  # the model's first part: its data needs no gradient,
                # its whole backward is W
                weight += sum(self.bwd[a:b]) if first else sum(self.wgt[a:b])
                moved = [0.0]
                for i in chunk_recs[-1].order:
                    moved.append(moved[-1] + (0.0 if first else self.wgt[a + i]))
                moved_all.append(moved)
            rec.append(chunk_recs[0] if v == 1 else ChunkedRecompute(chunk_recs))
            wgt.append(weight)
            wgt_rec.append(moved_all)
            ar.append(0.0 if r == 1 else 2 * (r - 1) / r * w / ar_bw + 2 * (r - 1) * c.latency)
        lay = _Layout(
            K, r, parts, fwd, bwd, wgt, wgt_rec, params, cut_out, inter, rec, ar, spans_nodes, v, kind, working
        )
        self._layouts[key] = lay
        return lay

    def stage_params(self, ranges) -> dict[int, float]:
        """{layer: parameter bytes as the stage running ``ranges`` holds them}: a tied module whose
        first use is on another stage counts at this stage's first use of it (its copy)."""
        out, seen = {}, set()
        for a, b in ranges:
            for i in range(a, b):
                out[i], key = self.params[i], self.tied_at[i]
                if key is not None and key not in seen:
                    seen.add(key)
                    first, size = self.tied_first[key]
                    out[i] += 0.0 if any(x <= first < y for x, y in ranges) else size
        return out

    def _stage_recompute(self, a: int, b: int) -> StageRecompute:
        """Re-computation options of layers a .. b-1 run as one part."""
        stage_input = self.cuts[a - 1] if a > 0 else self.data_bytes
        # The engine holds the part's output until its backward, saved by a layer or not; the
        # last part also what the loss saved.
        held_output = (0.0 if self.out_saved[b - 1] else self.out[b - 1]) + (self.loss_saved if b == self.n else 0.0)
        outs = [o if kept else 0.0 for o, kept in zip(self.out[a:b], self.out_saved[a:b])]
        # A run after a layer whose output nobody saves keeps that output as its input.
        ins = [0.0] + [0.0 if self.out_saved[i - 1] else self.out[i - 1] for i in range(a + 1, b)]
        return StageRecompute(a, self.saved[a:b], self.rc[a:b], stage_input + held_output, outs, ins)

    def p2p(self, lay: _Layout, s: int, f: float) -> float:
        if s < 0 or s >= lay.K - 1:
            return 0.0
        bw = self.cluster.inter_node_bandwidth if lay.inter_link[s] else self.cluster.intra_node_bandwidth
        return self.cluster.message_latency + f * lay.cut_out[s] / bw

    @staticmethod
    def in_flight(schedule: str, K: int, M: int) -> list:
        """Micro-batches of activations each stage holds at most (asked of the schedule); with
        virtual stages a tuple per stage, each chunk's count."""
        traits = schedule_traits(schedule, K, M)
        return list(traits.in_flight_chunks if traits.virtual_stages > 1 else traits.in_flight)

    # -- time -----------------------------------------------------------------------------------
    def compute_time(self, lay: _Layout, schedule: str, f: float, M: int, ks: Sequence[int]):
        """(T_c, per-stage forward, backward incl. re-computation, p2p) for one step.

        With v chunks per stage (virtual stages) F, B and W are one chunk's, 1/v of the stage's
        (as the simulator times a chunk op), and the formulas run on v M chunk micro-batches:
        interleaved 1F1B with equal stages takes M (F+B) + (K-1)(F+B)/v, the bubble shrunk v
        times; a split backward (zb-v) the zero-bubble bounds with v M micro-batches. A
        micro-batch crosses K v - 1 part boundaries: the fill counts every link v times."""
        K, v = lay.K, lay.v
        F = [f * x / v for x in lay.fwd]
        B = [f * (lay.bwd[s] + lay.rec[s].time(ks[s])) / v for s in range(K)]
        host = self.cluster.host
        if host is not None:  # an instruction takes at least what its host spends issuing it
            n = self.stage_layers(lay)
            F = [floor(F[s], host.forward_s(n[s] / v)) for s in range(K)]
            B = [floor(B[s], host.backward_s(n[s] / v, len(lay.rec[s].layers(ks[s])) / v)) for s in range(K)]
        c = [self.p2p(lay, s, f) for s in range(K)]
        around = [(c[s - 1] if s else 0.0) + c[s] for s in range(K)]
        fill = sum(F) + sum(B) + 2 * v * sum(c)
        traits = schedule_traits(schedule, K, M)
        M = M * v
        if traits.splits_backward and not traits.continuous:
            I, W = split_stage_times(self, lay, f, ks, B)  # as the engine runs them: its extra cost in I
            return split_backward_time(F, I, W, c, M, traits.in_flight), F, B, c
        if traits.interleaved:  # 1F1B order: one forward and one backward per micro-batch
            cycle = max(F[s] + B[s] + 2 * around[s] for s in range(K))
        else:  # GPipe order: the forward and backward maxima separately
            cycle = max(F[s] + around[s] for s in range(K)) + max(B[s] + around[s] for s in range(K))
        if traits.continuous:  # the pipeline stays full: no fill or drain per step
            return M * cycle, F, B, c
        return (M - 1) * cycle + fill, F, B, c

    def stage_layers(self, lay: _Layout) -> list[int]:
        """Layers per stage (all its chunks)."""
        return [sum(b - a for a, b in lay.chunk_ranges(s)) for s in range(lay.K)]

    def host_step(self, lay: _Layout) -> float:
        """What the slowest stage's host spends issuing its optimizer step (0 without a host cost)."""
        host = self.cluster.host
        return max(host.step_s(n) for n in self.stage_layers(lay)) if host is not None else 0.0

    def step_time(
        self, lay: _Layout, schedule: str, f: float, M: int, ks: Sequence[int], deferred: Sequence[int] | None = None
    ) -> tuple[float, list[int]]:
        """Analytic step time and the deferred stages (given, or by the rule), with the host's
        optimizer step."""
        step, chosen = self._pipeline_time(lay, schedule, f, M, ks, deferred)
        return step + self.host_step(lay), chosen

    def _pipeline_time(
        self, lay: _Layout, schedule: str, f: float, M: int, ks: Sequence[int], deferred: Sequence[int] | None
    ) -> tuple[float, list[int]]:
        K = lay.K
        T, F, B, c = self.compute_time(lay, schedule, f, M, ks)
        a = lay.ar_work
        traits = schedule_traits(schedule, K, M)
        drain = [B[s] + c[s] for s in range(K)]
        if traits.splits_backward:  # the postponed W's fill the drain: stages finish closer together
            drain = [max(0.0, i - w + c[s]) for s, (i, w) in enumerate(zip(*split_stage_times(self, lay, f, ks, B)))]
        ready, acc = [], T
        for s in range(K):  # stage s's last backward ends before stage s-1's by B_{s-1} + c
            if s:
                acc -= drain[s - 1]
            ready.append(acc)
        if traits.continuous:  # all-reduces overlap the next micro-batches; the link must carry them
            return max(T, sum(a[s] * traits.updates_per_batch[s] for s in range(K))), []
        if not traits.defers:
            finish, work = T, 0.0
            for s in range(K):  # link drains work that starts at ready[s] and later
                work += a[s]
                finish = max(finish, ready[s] + work)
            return finish, []
        offset, acc = [], 0.0
        for s in range(K):  # when the next step's first forward reaches stage s
            offset.append(acc)
            acc += F[s] + c[s]
        rule = deferred is None
        chosen = set(deferred or ())
        delay, link_free = 0.0, -math.inf
        for s in range(K - 1, -1, -1):  # earliest ready first
            if a[s] <= 0:
                continue
            done = max(ready[s], link_free) + a[s]
            late = done - (T + offset[s])
            if rule and late > 1e-12 * T:
                chosen.add(s)
                continue
            if s not in chosen:
                link_free = done
                delay = max(delay, late)
        return max(T + max(delay, 0.0), lay.ar_total), sorted(chosen)

    # -- memory ---------------------------------------------------------------------------------
    def memory(
        self,
        lay: _Layout,
        f: float,
        in_flight: Sequence[int],
        ks: Sequence[int],
        deferred: Sequence[int],
        weight_versions: Sequence[int] | None = None,
        delayed_share: dict[int, float] | None = None,
    ) -> list[float]:
        """Per device (the formula, :mod:`.plan`): weights and optimizer state, what a deferred stage
        holds for its delayed share of the gradient (``delayed_share``: {stage: share of its gradient
        bytes}; a stage not in it delays all), extra weight versions (2bw, pipedream), activations
        held for backward and the largest working memory of one layer's forward+backward."""
        share = {s: 1.0 for s in deferred} | {s: x for s, x in (delayed_share or {}).items() if s in deferred}
        extra = [v - 1 for v in weight_versions] if weight_versions else [0] * lay.K
        return [
            lay.params[s] * (self.state_factor + extra[s])
            + lay.params[s] * share.get(s, 0.0) * DEFERRAL_COPIES
            + f * (lay.rec[s].activations(ks[s], in_flight[s]) + lay.working[s])
            for s in range(lay.K)
        ]

    def working_memory(self, lay: _Layout, f: float) -> list[float]:
        """Per device, the working-memory term of :meth:`memory`: the largest one layer's forward+backward
        needs above what it keeps (no saved tensor: a count of those leaves it out)."""
        return [f * lay.working[s] for s in range(lay.K)]

    def least_memory(self, lay: _Layout, f: float, in_flight: Sequence[int]) -> list[float]:
        """Per device, a lower bound of :meth:`memory`: no deferral or extra weight versions, the
        re-computation with the least activation memory."""
        return [
            lay.params[s] * self.state_factor + f * (lay.rec[s].least(in_flight[s]) + lay.working[s])
            for s in range(lay.K)
        ]

    def summarize_memory(self, mem: Sequence[float]) -> float:
        return max(mem) if self.metric == "max" else sum(mem) / len(mem)

    # -- objective ------------------------------------------------------------------------------
    def figures(self, step: float, mem: Sequence[float]) -> tuple[float, float, float, float]:
        thr = self.G / step if step > 0 else math.inf
        scal = thr / (self.P * self.single_throughput)
        m = self.summarize_memory(mem)
        return thr, scal, m, scal * thr / (m / GB) if m > 0 else math.inf


@dataclass(order=True)
class _Candidate:
    score: float
    key: tuple = field(compare=False)
    lay: _Layout = field(compare=False, repr=False)
    b: int = field(compare=False)
    M: int = field(compare=False)
    schedule: str = field(compare=False)
    ks: list[int] = field(compare=False)
    est: _Estimate = field(compare=False)


def _divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]
