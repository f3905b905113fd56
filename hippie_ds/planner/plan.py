"""The planner: searches pipeline configurations and writes a plan file. Pure Python.

What is searched, for P devices and a global batch G:

* pipeline depth K (a divisor of P, at most the number of layers), data-parallel width r = P/K;
* micro-batch size b (a divisor of G/r, at least ``min_micro_batch``: by default the profile's
  batch / 16, since the linear scaling of times is not trusted far below the measured batch:
  kernels lose efficiency at tiny batches, which the profile cannot show) and M = G / (r b);
* stage boundaries: the partition minimizing the slowest stage's forward+backward time
  (:func:`partition.min_bottleneck`, optimal);
* which layers every stage re-computes (:mod:`recompute`), chosen for a bottleneck target:
  a stage may spend on re-computation what keeps it under the target, so stages that are not
  the bottleneck re-compute nearly for free; targets from the unchanged bottleneck up to
  "as much as saves memory";
* the schedule (1f1b, gpipe, hippie, hippie-1f1b) and Hippie's deferred stages.

Cost model (all of it in :class:`_Config.estimate`; the simulator refines the best few):

* times and activations scale linearly with b (``profile.py``); stage s costs F_s, B_s (+ its
  re-computation), p2p c_s = latency + cut bytes / link bandwidth (intra-node when both
  stages share a node: the pipeline is placed inside nodes, data parallelism across them, as
  Hippie does); ring all-reduce of stage s: a_s = 2 (r-1)/r W_s / bw + 2 (r-1) latency over
  the inter-node link when the group spans nodes, all stages sharing it;
* compute of a flush pipeline: T_c = (M-1) max_s(F_s+B_s+2c_{s-1}+2c_s) + sum_s(F_s+B_s) +
  2 sum_s c_s (GPipe order: the forward and backward maxima separately); flush schedules
  all-reduce at the end (the link drains the work as stages finish, last stage first);
  Hippie's stage s all-reduces right after its last backward and must finish before the next
  step's first forward reaches it; a stage that cannot defers (the simulator's rule, see
  ``resolve_auto_params``), and the link must carry all stages' work once per step;
* memory per device of stage s = W_s * state_factor (fp32 profile and fp32 Adam: weights,
  gradients, two moments = 16 bytes a parameter = 4 x the profiled parameter bytes)
  + W_s for the gradient buffer of a deferred stage + activations: the peak number of
  micro-batches in flight (1f1b: min(K-s, M); gpipe: M; hippie: M, the fused last stage 1;
  from the simulator when it runs) times the bytes kept per micro-batch, plus the largest
  re-computed run (``recompute.py``). Optimizer step time is not modelled (0);
* throughput = G / step time (samples/s); single-device throughput = profile batch / the
  whole model's forward+backward; scalability = throughput / (P x single-device throughput)
  (scaling efficiency; 1 for free communication and no bubble); memory = the mean over
  devices of their peak memory (total memory / P; ``memory_metric='max'``: the largest);
  ME = scalability x throughput / memory, reported in samples/s per GB. Every configuration
  must fit the device memory (and ``memory_cap``) on every device.

Search: every (K, b, schedule) gets an upper bound of its objective (no re-computation cost,
least activation memory, no all-reduce exposure); they are visited best bound first and
skipped once the bound cannot beat the best few found. The best few are simulated
(``simulate_budget`` limits the simulated micro-batch-stages) and ranked by simulated figures.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hippie_ds.data_files import describe, read_data_file

from . import partition as part
from .cluster import Cluster
from .profile import PlannerError, Profile
from .recompute import StageRecompute

SCHEDULES = ("1f1b", "gpipe", "hippie", "hippie-1f1b")
HIPPIE_FAMILY = ("hippie", "hippie-1f1b")
DEFAULT_STATE_FACTOR = 4.0
GB = 1e9
# Bottleneck targets for re-computation, as a factor of the unchanged bottleneck (inf: every
# stage takes its least-memory choice).
# 0: no re-computation at all.
TARGETS = (0.0, 1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0, math.inf)


class PlanMismatchError(PlannerError):
    """A plan used for another model or another number of devices."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------
# The plan file

class Prediction(_Strict):
    step_time: float = Field(ge=0, description="seconds per training step (global batch)")
    throughput: float = Field(ge=0, description="samples per second")
    scalability: float = Field(ge=0, description="throughput / (devices x single-device throughput)")
    memory: float = Field(ge=0, description="memory the objective uses (bytes): mean or max per device")
    memory_max: float = Field(ge=0, description="largest per-device memory (bytes)")
    memory_per_stage: list[float] = Field(description="per-device memory of each stage (bytes)")
    me: float = Field(ge=0, description="memory efficiency: scalability x throughput / memory, samples/s per GB")
    fits: bool = Field(description="every device within its memory (and the memory cap)")
    predicted_by: Literal["simulator", "analytic"]


class StagePlan(_Strict):
    stage: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1, description="one past the stage's last layer")
    checkpointed: list[int] = Field(default_factory=list, description="layers re-computed in backward")
    forward: float = Field(ge=0, description="forward time of one micro-batch (s)")
    backward: float = Field(ge=0, description="backward time of one micro-batch, without re-computation (s)")
    recompute: float = Field(ge=0, description="extra backward time of the re-computed layers (s)")
    param_bytes: float = Field(ge=0)
    activation_bytes: float = Field(ge=0, description="bytes sent to the next stage per micro-batch")
    kept_bytes: float = Field(ge=0, description="activation bytes kept per in-flight micro-batch")
    in_flight: int = Field(ge=1, description="peak micro-batches whose activations are held")
    deferred: bool = Field(False, description="all-reduce deferred to the next step (gradient buffer)")
    memory: float = Field(ge=0, description="peak memory of one device of this stage (bytes)")
    activation_memory: float = Field(0.0, ge=0, description="of which activations held for backward: in-flight "
                                                            "micro-batches x kept bytes + the largest re-computed run")


class Baseline(_Strict):
    name: str
    description: str
    pipeline_depth: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    micro_batches: int = Field(ge=1)
    schedule: str
    schedule_params: dict[str, Any] = Field(default_factory=dict)
    boundaries: list[int] = Field(default_factory=list, description="empty when skipped")
    checkpointed_layers: list[int] = Field(default_factory=list)
    prediction: Prediction | None = None
    skipped: str | None = Field(None, description="why it was not evaluated")


class Plan(_Strict):
    """A plan file: what to run and what it is predicted to do."""

    format_version: Literal[1] = 1
    model: str
    num_layers: int = Field(ge=1)
    fingerprint: str = Field(min_length=1, description="hash of the profile's layer names and parameter sizes")
    profile_batch_size: int = Field(ge=1)
    cluster: Cluster
    world_size: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    objective: Literal["me", "throughput"]
    memory_metric: Literal["mean", "max"] = "mean"
    memory_cap: float | None = Field(None, gt=0)
    pipeline_depth: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    micro_batches: int = Field(ge=1)
    schedule: str
    schedule_params: dict[str, Any] = Field(default_factory=dict)
    boundaries: list[int] = Field(description="DeepSpeed parts: [0, b1, ..., num_layers]")
    checkpointed_layers: list[int] = Field(default_factory=list)
    stages: list[StagePlan]
    prediction: Prediction
    single_device_throughput: float = Field(gt=0, description="samples/s of one device, the scalability reference")
    baselines: list[Baseline] = Field(default_factory=list)
    assumptions: dict[str, Any] = Field(default_factory=dict)
    search: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        k, n = self.pipeline_depth, self.num_layers
        b = self.boundaries
        if len(b) != k + 1 or b[0] != 0 or b[-1] != n or any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"boundaries {b}: need {k + 1} strictly increasing entries from 0 to {n}")
        if k * self.data_parallel != self.world_size:
            raise ValueError(f"pipeline_depth {k} x data_parallel {self.data_parallel} != world_size {self.world_size}")
        if self.micro_batch_size * self.micro_batches * self.data_parallel != self.global_batch:
            raise ValueError(f"micro_batch_size {self.micro_batch_size} x micro_batches {self.micro_batches} x "
                             f"data_parallel {self.data_parallel} != global_batch {self.global_batch}")
        bad = [i for i in self.checkpointed_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"checkpointed_layers {bad}: outside 0..{n - 1}")
        if len(self.stages) != k:
            raise ValueError(f"{len(self.stages)} stage entries for pipeline_depth {k}")
        for s, st in enumerate(self.stages):
            if (st.stage, st.first_layer, st.end_layer) != (s, b[s], b[s + 1]):
                raise ValueError(f"stages[{s}] covers layers {st.first_layer}..{st.end_layer - 1}, boundaries say "
                                 f"{b[s]}..{b[s + 1] - 1}")
        return self

    # -- use ------------------------------------------------------------------------------------
    def check_matches(self, profile: Profile | None = None, *, num_layers: int | None = None,
                      fingerprint: str | None = None, world_size: int | None = None) -> None:
        """Raise :class:`PlanMismatchError` when the plan was made for another model (layer count
        or fingerprint) or another number of devices."""
        if profile is not None:
            num_layers = profile.num_layers if num_layers is None else num_layers
            fingerprint = profile.fingerprint() if fingerprint is None else fingerprint
        if num_layers is not None and num_layers != self.num_layers:
            raise PlanMismatchError(f"the plan is for {self.model!r} with {self.num_layers} layers; this model has "
                                    f"{num_layers}: the plan was made for another model")
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise PlanMismatchError(f"the plan is for {self.model!r} (fingerprint {self.fingerprint}); this model's "
                                    f"layer names or parameter sizes differ (fingerprint {fingerprint}): the plan "
                                    "was made for another model")
        if world_size is not None and world_size != self.world_size:
            raise PlanMismatchError(f"the plan is for {self.world_size} devices ({self.pipeline_depth} stages x "
                                    f"{self.data_parallel} replicas); this job has {world_size}")

    def deepspeed_config(self) -> dict:
        """The config keys this plan sets (merge into a DeepSpeed config for hippie-ds)."""
        hippie: dict[str, Any] = {"placement": "pipeline_in_node"}
        params = dict(self.schedule_params)
        if "deferred_stages" in params:
            hippie["deferred_stages"] = params.pop("deferred_stages")
        if params:
            hippie["schedule_params"] = params
        return {"train_batch_size": self.global_batch, "train_micro_batch_size_per_gpu": self.micro_batch_size,
                "gradient_accumulation_steps": self.micro_batches, "pipeline": {"schedule": self.schedule},
                "hippie": hippie}

    def summary(self) -> str:
        return format_summary(self)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write a plan as JSON (.json) or YAML (.yaml/.yml)."""
    path = Path(path)
    data = plan.model_dump(mode="json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(json.dumps(data, indent=1) + "\n")


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    data = read_data_file(path, "plan", PlannerError)
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise PlannerError("invalid plan:\n  " + "\n  ".join(describe(exc, str(path)))) from None


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
    params: list[float]
    cut_out: list[float]            # bytes crossing the cut after the stage (0 for the last)
    inter_link: list[bool]          # the link to the next stage crosses nodes for some replica
    rec: list[StageRecompute]
    ar_work: list[float]            # seconds of all-reduce work at full link bandwidth (+ latency)
    ar_inter: bool                  # the data-parallel groups span nodes

    @property
    def ar_total(self) -> float:
        return sum(self.ar_work)


@dataclass
class _Estimate:
    step: float
    memory: list[float]             # per stage, bytes per device
    in_flight: list[int]
    deferred: list[int]
    predicted_by: str = "analytic"


class _Model:
    """Profile + cluster + options: builds layouts and estimates configurations."""

    def __init__(self, profile: Profile, cluster: Cluster, global_batch: int, state_factor: float,
                 memory_metric: str, memory_cap: float) -> None:
        self.profile, self.cluster, self.G = profile, cluster, global_batch
        self.state_factor, self.metric, self.cap = state_factor, memory_metric, memory_cap
        layers = profile.layers
        self.n = len(layers)
        self.b0 = profile.batch_size
        self.fwd = [x.forward for x in layers]
        self.bwd = [x.backward for x in layers]
        self.rc = [x.recompute_time for x in layers]
        self.saved = [x.saved for x in layers]
        self.out = [x.output_bytes for x in layers]
        self.out_saved = [x.output_saved is not False for x in layers]
        self.params = [x.param_bytes for x in layers]
        self.cuts = profile.cuts()
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
    def layout(self, K: int, parts: Sequence[int] | None = None) -> _Layout:
        parts = list(parts) if parts is not None else part.min_bottleneck(self.work, K, self.prefix_work)[0]
        key = (K, tuple(parts))
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        c = self.cluster
        r = self.P // K
        fwd, bwd, params, cut_out, inter, rec, ar = [], [], [], [], [], [], []
        dpn = c.devices_per_node
        # Stage s of replica q runs on device q*K + s: its group spans nodes unless all r fit in one.
        spans_nodes = r > 1 and ((r - 1) * K) // dpn != 0
        ar_bw = c.inter_node_bandwidth if spans_nodes else c.intra_node_bandwidth
        for s, (a, b) in enumerate(zip(parts, parts[1:])):
            fwd.append(sum(self.fwd[a:b]))
            bwd.append(sum(self.bwd[a:b]))
            w = sum(self.params[a:b])
            params.append(w)
            cut_out.append(self.cuts[b - 1] if b < self.n else 0.0)
            # Device d = q*K + s (pipeline innermost): does replica q's link s -> s+1 cross nodes?
            inter.append(b < self.n and any((q * K + s) // dpn != (q * K + s + 1) // dpn for q in range(r)))
            stage_input = self.cuts[a - 1] if a > 0 else self.data_bytes
            # The engine holds the stage's output until its backward, saved by a layer or not.
            held_output = 0.0 if self.out_saved[b - 1] else self.out[b - 1]
            outs = [o if kept else 0.0 for o, kept in zip(self.out[a:b], self.out_saved[a:b])]
            # A run after a layer whose output nobody saves keeps that output as its input.
            ins = [0.0] + [0.0 if self.out_saved[i - 1] else self.out[i - 1] for i in range(a + 1, b)]
            rec.append(StageRecompute(a, self.saved[a:b], self.rc[a:b], stage_input + held_output, outs, ins))
            ar.append(0.0 if r == 1 else 2 * (r - 1) / r * w / ar_bw + 2 * (r - 1) * c.latency)
        lay = _Layout(K, r, parts, fwd, bwd, params, cut_out, inter, rec, ar, spans_nodes)
        self._layouts[key] = lay
        return lay

    def p2p(self, lay: _Layout, s: int, f: float) -> float:
        if s < 0 or s >= lay.K - 1:
            return 0.0
        bw = self.cluster.inter_node_bandwidth if lay.inter_link[s] else self.cluster.intra_node_bandwidth
        return self.cluster.latency + f * lay.cut_out[s] / bw

    @staticmethod
    def in_flight(schedule: str, K: int, M: int) -> list[int]:
        if schedule in ("1f1b", "hippie-1f1b"):
            return [min(K - s, M) for s in range(K)]
        if schedule == "gpipe":
            return [M] * K
        return [M] * (K - 1) + [1]  # hippie: GPipe order, the last stage fuses F and B

    # -- time -----------------------------------------------------------------------------------
    def compute_time(self, lay: _Layout, schedule: str, f: float, M: int, ks: Sequence[int]):
        """(T_c, per-stage forward, backward incl. re-computation, p2p) for one step."""
        K = lay.K
        F = [f * x for x in lay.fwd]
        B = [f * (lay.bwd[s] + lay.rec[s].time(ks[s])) for s in range(K)]
        c = [self.p2p(lay, s, f) for s in range(K)]
        around = [(c[s - 1] if s else 0.0) + c[s] for s in range(K)]
        fill = sum(F) + sum(B) + 2 * sum(c)
        if schedule in ("1f1b", "hippie-1f1b"):
            cycle = max(F[s] + B[s] + 2 * around[s] for s in range(K))
        else:
            cycle = max(F[s] + around[s] for s in range(K)) + max(B[s] + around[s] for s in range(K))
        return (M - 1) * cycle + fill, F, B, c

    def step_time(self, lay: _Layout, schedule: str, f: float, M: int, ks: Sequence[int],
                  deferred: Sequence[int] | None = None) -> tuple[float, list[int]]:
        """Analytic step time and the deferred stages (given, or by the rule)."""
        K = lay.K
        T, F, B, c = self.compute_time(lay, schedule, f, M, ks)
        a = lay.ar_work
        ready, acc = [], T
        for s in range(K):  # stage s's last backward ends before stage s-1's by B_{s-1} + c
            if s:
                acc -= B[s - 1] + c[s - 1]
            ready.append(acc)
        if schedule not in HIPPIE_FAMILY:
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
    def memory(self, lay: _Layout, f: float, in_flight: Sequence[int], ks: Sequence[int],
               deferred: Sequence[int]) -> list[float]:
        d = set(deferred)
        return [lay.params[s] * self.state_factor + (lay.params[s] if s in d else 0.0)
                + f * lay.rec[s].activations(ks[s], in_flight[s]) for s in range(lay.K)]

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


# ---------------------------------------------------------------------------------------------
# Search

def _choose_recompute(model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str,
                      targets: Sequence[float] = TARGETS) -> tuple[float, list[int], _Estimate] | None:
    """The best re-computation choice (over bottleneck targets) for a fixed configuration:
    (score, prefix per stage, estimate), or None when nothing fits."""
    K, f = lay.K, b / model.b0
    p = model.in_flight(schedule, K, M)
    zero = [0] * K
    _, F, B, c = model.compute_time(lay, schedule, f, M, zero)
    around = [(c[s - 1] if s else 0.0) + c[s] for s in range(K)]
    base = [F[s] + B[s] + 2 * around[s] for s in range(K)]
    bottleneck = max(base)
    best, seen = None, set()
    for t in targets:
        if t == 0:
            ks = list(zero)
        elif math.isinf(t):
            ks = [lay.rec[s].choose(p[s], math.inf) for s in range(K)]
        else:
            ks = [lay.rec[s].choose(p[s], (bottleneck * t - base[s]) / f) for s in range(K)]
        key = tuple(ks)
        if key in seen:
            continue
        seen.add(key)
        step, deferred = model.step_time(lay, schedule, f, M, ks)
        mem = model.memory(lay, f, p, ks, deferred)
        if max(mem) > model.cap:
            continue
        thr, _, _, me = model.figures(step, mem)
        score = me if objective == "me" else thr
        if best is None or score > best[0] * (1 + 1e-12):
            best = (score, ks, _Estimate(step, mem, p, deferred))
    return best


def _bound(model: _Model, lay: _Layout, schedule: str, b: int, M: int, objective: str) -> float | None:
    """An upper bound of the objective of (layout, b, schedule) over re-computation and
    deferral choices; None when even the least memory does not fit."""
    K, f = lay.K, b / model.b0
    p = model.in_flight(schedule, K, M)
    step, _ = model.step_time(lay, schedule, f, M, [0] * K, deferred=range(K))  # all hidden
    if schedule not in HIPPIE_FAMILY:
        step, _ = model.step_time(lay, schedule, f, M, [0] * K)
    least = [lay.params[s] * model.state_factor + f * lay.rec[s].least(p[s]) for s in range(K)]
    if max(least) > model.cap:
        return None
    thr, _, _, me = model.figures(step, least)
    return me if objective == "me" else thr


@dataclass
class _SearchResult:
    best: list[_Candidate]
    evaluated: int
    bounded: int
    least_memory: float


def _search(model: _Model, schedules: Sequence[str], objective: str, depths: Sequence[int] | None,
            micro_batch_sizes: Sequence[int] | None, min_micro_batch: int, keep: int) -> _SearchResult:
    n, P, G = model.n, model.P, model.G
    combos = []
    least_memory = math.inf
    for K in (depths or _divisors(P)):
        if K > n or P % K:
            continue
        r = P // K
        if G % r:
            continue
        lay = model.layout(K)
        for b in _divisors(G // r):
            if (micro_batch_sizes and b not in micro_batch_sizes) or (not micro_batch_sizes and b < min_micro_batch):
                continue
            M = G // (r * b)
            for sched in schedules:
                bound = _bound(model, lay, sched, b, M, objective)
                if bound is None:
                    f = b / model.b0
                    p = model.in_flight(sched, K, M)
                    least_memory = min(least_memory, max(lay.params[s] * model.state_factor
                                                         + f * lay.rec[s].least(p[s]) for s in range(K)))
                    continue
                combos.append((bound, K, b, M, sched, lay))
    combos.sort(key=lambda x: (-x[0], x[1], x[2], SCHEDULES.index(x[4]) if x[4] in SCHEDULES else 9))
    best: list[_Candidate] = []
    evaluated = 0
    for bound, K, b, M, sched, lay in combos:
        if len(best) >= keep and bound <= best[-1].score:
            break
        evaluated += 1
        got = _choose_recompute(model, lay, sched, b, M, objective)
        if got is None:
            continue
        score, ks, est = got
        best.append(_Candidate(score, (K, b, sched), lay, b, M, sched, ks, est))
        best.sort(key=lambda c: (-c.score, model.summarize_memory(c.est.memory), c.lay.K, c.b))
        del best[keep:]
    return _SearchResult(best, evaluated, len(combos), least_memory)


# ---------------------------------------------------------------------------------------------
# Simulation of a candidate

def _costs(model: _Model, lay: _Layout, b: int, ks: Sequence[int]):
    """hippie_ds Costs for a configuration, through Costs.from_layers. A stage's
    activation_bytes is what crosses its cut (branched graphs: several tensors); a link that
    crosses nodes is expressed as proportionally more bytes on the intra-node p2p bandwidth."""
    from ..schedules.costs import CommCost, Costs

    c, f = model.cluster, b / model.b0
    layer_costs = []
    for s, (a, e) in enumerate(zip(lay.parts, lay.parts[1:])):
        chosen = set(lay.rec[s].layers(ks[s]))
        scale = c.intra_node_bandwidth / c.inter_node_bandwidth if lay.inter_link[s] else 1.0
        for i in range(a, e):
            layer_costs.append({
                "forward": f * model.fwd[i], "backward": f * model.bwd[i],
                "recompute": f * model.rc[i] if i in chosen else 0.0,
                "param_bytes": model.params[i],
                "output_bytes": f * lay.cut_out[s] * scale if i == e - 1 else 0.0,
            })
    comm = CommCost(p2p_bandwidth=c.intra_node_bandwidth, p2p_latency=c.latency,
                    allreduce_bandwidth=c.inter_node_bandwidth if lay.ar_inter else c.intra_node_bandwidth,
                    allreduce_latency=c.latency, data_parallel=lay.r, shared_link=True)
    return Costs.from_layers(layer_costs, lay.parts, comm)


def _simulate(model: _Model, lay: _Layout, b: int, M: int, schedule: str, ks: Sequence[int],
              deferred: Sequence[int], auto_limit: int) -> _Estimate:
    """Simulate a configuration: deferred stages by the simulator's rule when affordable
    (``auto_limit`` micro-batch-stages of repeated simulation), else ``deferred`` (the
    analytic rule's choice)."""
    from ..schedules import compile as compile_schedule
    from ..schedules.simulator import resolve_auto_params, simulate

    costs = _costs(model, lay, b, ks)
    params: dict[str, Any] = {}
    if schedule in HIPPIE_FAMILY:
        if lay.K * M * (lay.K + 1) * 3 <= auto_limit:
            params = resolve_auto_params(schedule, lay.K, M, costs, {"deferred_stages": "auto"})
        else:
            params = {"deferred_stages": list(deferred)}
    compiled = compile_schedule(schedule, lay.K, M, validate=False, **params)
    iterations = 3 if schedule in HIPPIE_FAMILY else 1  # flush schedules repeat identically
    res = simulate(compiled, costs, iterations=iterations, critical_path=False)
    p = [max(1, x["peak_activation_microbatches"]) for x in res.per_stage]
    d = list(compiled.params.get("deferred_stages", []))
    mem = model.memory(lay, b / model.b0, p, ks, d)
    return _Estimate(res.step_time, mem, p, d, "simulator")


def _sim_cost(lay: _Layout, M: int, schedule: str) -> int:
    return lay.K * M * (3 if schedule in HIPPIE_FAMILY else 1)


# ---------------------------------------------------------------------------------------------
# Public entry point

def make_plan(profile: Profile, cluster: Cluster, global_batch: int, *, objective: str = "me",
              memory_cap: float | None = None, schedules: Sequence[str] = SCHEDULES,
              depths: Sequence[int] | None = None, micro_batch_sizes: Sequence[int] | None = None,
              min_micro_batch: int | None = None, state_factor: float = DEFAULT_STATE_FACTOR, memory_metric: str = "mean",
              simulate_top: int = 4, simulate_budget: int = 4096, baselines: bool = True,
              baseline_budget: float = 2e6) -> Plan:
    """Plan ``profile`` on ``cluster`` for ``global_batch`` samples a step.

    ``objective`` 'me' maximizes memory efficiency, 'throughput' throughput; both under the
    device memory and ``memory_cap``. ``depths`` / ``micro_batch_sizes`` restrict the search;
    ``min_micro_batch`` (default profile batch // 16, at least 1) bounds the micro-batch size
    from below unless ``micro_batch_sizes`` lists sizes.
    ``simulate_top`` best analytic candidates are simulated, within ``simulate_budget``
    micro-batch-stages each (larger ones keep their analytic figures). ``baseline_budget``
    caps the O(N^2 K) partition baselines (N^2 K operations); larger ones are skipped."""
    t0 = time.perf_counter()
    if objective not in ("me", "throughput"):
        raise PlannerError(f"objective {objective!r}: expected 'me' or 'throughput'")
    if memory_metric not in ("mean", "max"):
        raise PlannerError(f"memory metric {memory_metric!r}: expected 'mean' or 'max'")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise PlannerError(f"schedule(s) {', '.join(unknown) or '(none)'}: the planner knows {', '.join(SCHEDULES)}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"global batch {global_batch!r}: must be an integer >= 1")
    cap = cluster.device_memory if memory_cap is None else min(memory_cap, cluster.device_memory)
    model = _Model(profile, cluster, global_batch, state_factor, memory_metric, cap)
    P = cluster.devices
    if not any(P % K == 0 and K <= model.n and global_batch % (P // K) == 0 for K in (depths or _divisors(P))):
        raise PlannerError(f"global batch {global_batch} cannot be split over {P} devices: no pipeline depth K "
                           f"(dividing {P}, at most {model.n} layers{', among ' + str(list(depths)) if depths else ''}) "
                           f"leaves a data-parallel width P/K that divides it")

    if min_micro_batch is None:
        min_micro_batch = max(1, profile.batch_size // 16)
    found = _search(model, list(schedules), objective, depths, micro_batch_sizes, min_micro_batch,
                    keep=max(simulate_top, 1))
    if not found.best:
        least = found.least_memory
        detail = f" the least any configuration needs is {least / GB:.3g} GB per device" if math.isfinite(least) else ""
        if not found.bounded and not math.isfinite(found.least_memory):
            raise PlannerError(f"no micro-batch size to search: the global batch {global_batch} per data-parallel "
                               f"replica has no divisor >= {min_micro_batch} (--min-micro-batch) among the "
                               "allowed sizes")
        raise PlannerError(f"{profile.model!r} does not fit: no configuration of {P} devices with "
                           f"{cap / GB:.3g} GB each (re-computing everything that helps) holds it;{detail}. "
                           "Use more devices, more memory, or a smaller global batch")

    # Refine the best few with the simulator.
    simulated = 0
    ranked = []
    for cand in found.best[:max(simulate_top, 0)]:
        if _sim_cost(cand.lay, cand.M, cand.schedule) > simulate_budget:
            continue
        est = _simulate(model, cand.lay, cand.b, cand.M, cand.schedule, cand.ks, cand.est.deferred,
                        auto_limit=simulate_budget)
        simulated += 1
        if max(est.memory) > cap:
            continue
        thr, _, _, me = model.figures(est.step, est.memory)
        ranked.append((me if objective == "me" else thr, cand, est))
    if ranked:
        # Equal objective values (within rounding): prefer less memory, then a shallower pipeline.
        ranked.sort(key=lambda x: (-round(x[0], 9), model.summarize_memory(x[2].memory), x[1].lay.K, x[1].b))
        _, chosen, est = ranked[0]
    else:
        chosen, est = found.best[0], found.best[0].est

    plan_baselines = _baselines(model, chosen, est, objective, simulate_budget, baseline_budget) if baselines else []
    return _to_plan(model, chosen, est, objective, memory_cap, plan_baselines, {
        "seconds": round(time.perf_counter() - t0, 4), "configurations_bounded": found.bounded,
        "configurations_evaluated": found.evaluated, "simulated": simulated,
        "schedules": list(schedules), "depths": list(depths) if depths else "divisors of the device count",
        "micro_batch_sizes": list(micro_batch_sizes) if micro_batch_sizes else f">= {min_micro_batch}",
    })


def _prediction(model: _Model, est: _Estimate) -> Prediction:
    thr, scal, m, me = model.figures(est.step, est.memory)
    return Prediction(step_time=est.step, throughput=thr, scalability=scal, memory=m, memory_max=max(est.memory),
                      memory_per_stage=list(est.memory), me=me, fits=max(est.memory) <= model.cap,
                      predicted_by=est.predicted_by)


def _to_plan(model: _Model, cand: _Candidate, est: _Estimate, objective: str, memory_cap: float | None,
             baselines: list[Baseline], search: dict) -> Plan:
    lay, f = cand.lay, cand.b / model.b0
    stages, checkpointed = [], []
    deferred = set(est.deferred)
    for s, (a, e) in enumerate(zip(lay.parts, lay.parts[1:])):
        rec = lay.rec[s]
        layers = rec.layers(cand.ks[s])
        checkpointed += layers
        kept = rec.kept(cand.ks[s])
        stages.append(StagePlan(stage=s, first_layer=a, end_layer=e, checkpointed=layers, forward=f * lay.fwd[s],
                                backward=f * lay.bwd[s], recompute=f * rec.time(cand.ks[s]),
                                param_bytes=lay.params[s], activation_bytes=f * lay.cut_out[s], kept_bytes=f * kept,
                                in_flight=est.in_flight[s], deferred=s in deferred, memory=est.memory[s],
                                activation_memory=f * rec.activations(cand.ks[s], est.in_flight[s])))
    params = {"deferred_stages": sorted(deferred)} if cand.schedule in HIPPIE_FAMILY else {}
    return Plan(model=model.profile.model, num_layers=model.n, fingerprint=model.profile.fingerprint(),
                profile_batch_size=model.b0, cluster=model.cluster, world_size=model.P, global_batch=model.G,
                objective=objective, memory_metric=model.metric, memory_cap=memory_cap, pipeline_depth=lay.K,
                data_parallel=lay.r, micro_batch_size=cand.b, micro_batches=cand.M, schedule=cand.schedule,
                schedule_params=params, boundaries=list(lay.parts), checkpointed_layers=sorted(checkpointed),
                stages=stages, prediction=_prediction(model, est), single_device_throughput=model.single_throughput,
                baselines=baselines, search=search,
                assumptions={
                    "state_factor": model.state_factor,
                    "state_factor_meaning": "training-state bytes per profiled parameter byte (4: fp32 weights, "
                                            "gradients and two Adam moments)",
                    "time_scaling": "times and activations linear in the micro-batch size",
                    "saved_bytes": "per layer as in the profile (PipeDream profiles: the output activation)",
                    "placement": "pipeline inside nodes, data parallelism across nodes",
                    "memory_metric": f"{model.metric} per-device peak memory",
                    "me_unit": "samples/s per GB",
                })


# ---------------------------------------------------------------------------------------------
# Baselines

def _baselines(model: _Model, cand: _Candidate, est: _Estimate, objective: str, sim_budget: int,
               budget: float) -> list[Baseline]:
    out = [_data_parallel(model)]
    lay, b, M = cand.lay, cand.b, cand.M
    simulate = est.predicted_by == "simulator"

    def evaluate(name, description, layout, schedule, ks=None, recompute=True):
        if ks is None and recompute:
            got = _choose_recompute(model, layout, schedule, b, M, objective)
            ks = got[1] if got else [0] * layout.K
        ks = ks if ks is not None else [0] * layout.K
        f = b / model.b0
        step, deferred = model.step_time(layout, schedule, f, M, ks)
        if simulate and _sim_cost(layout, M, schedule) <= sim_budget:
            e = _simulate(model, layout, b, M, schedule, ks, deferred, auto_limit=sim_budget)
        else:
            p = model.in_flight(schedule, layout.K, M)
            e = _Estimate(step, model.memory(layout, f, p, ks, deferred), p, deferred)
        checkpointed = sorted(i for s in range(layout.K) for i in layout.rec[s].layers(ks[s]))
        params = {"deferred_stages": e.deferred} if schedule in HIPPIE_FAMILY else {}
        return Baseline(name=name, description=description, pipeline_depth=layout.K, data_parallel=layout.r,
                        micro_batch_size=b, micro_batches=M, schedule=schedule, schedule_params=params,
                        boundaries=list(layout.parts), checkpointed_layers=checkpointed,
                        prediction=_prediction(model, e))

    out.append(evaluate("gpipe+dp", "GPipe with data parallelism: same depth, width and micro-batches as the plan, "
                                    "balanced stages, no re-computation, all-reduce at the end of the step",
                        lay, "gpipe", recompute=False))
    n, K = model.n, lay.K
    partitions = [("uniform", "DeepSpeed 'uniform' partition (equal layer counts)",
                   lambda: part.uniform(n, K), 0)]
    partitions.append(("parameters", "DeepSpeed 'parameters' partition (partition_balanced over parameter counts)",
                       lambda: part.deepspeed_parameters([round(w / 4) for w in model.params], K), n * n * K))
    c = model.cluster
    ar_bw = c.inter_node_bandwidth if c.nodes > 1 and lay.r > 1 else c.intra_node_bandwidth
    partitions.append(("pipedream", "PipeDream's dynamic program for K stages each replicated r times "
                                    "(compute + 4(r-1)W/(bw r), transfers 2A/(bw r))",
                       lambda: part.pipedream_uniform(model.work, model.params, model.cuts, K, lay.r, ar_bw,
                                                      c.intra_node_bandwidth)[0], n * n * K / 2))
    for name, description, make, cost in partitions:
        description += f"; the plan's schedule ({cand.schedule}), depth, width and micro-batches, re-computation " \
                       "re-chosen"
        if K == 1:
            continue
        if cost > budget:
            out.append(Baseline(name=name, description=description, pipeline_depth=K, data_parallel=lay.r,
                                micro_batch_size=b, micro_batches=M, schedule=cand.schedule,
                                skipped=f"O(N^2 K) = {cost:.3g} operations exceeds the baseline budget {budget:.3g}"))
            continue
        parts = make()
        if len(parts) != K + 1 or any(y <= x for x, y in zip(parts, parts[1:])):
            out.append(Baseline(name=name, description=description, pipeline_depth=K, data_parallel=lay.r,
                                micro_batch_size=b, micro_batches=M, schedule=cand.schedule,
                                skipped=f"partition {parts} has empty stages"))
            continue
        out.append(evaluate(name, description, model.layout(K, parts), cand.schedule))
    return out


def _data_parallel(model: _Model) -> Baseline:
    """Plain data parallelism on every device, all-reduce overlapped with the last micro-batch's
    backward (bucketed, as PyTorch DDP). Micro-batch = G/P if it fits, else the fewest
    accumulation steps that fit."""
    P, G = model.P, model.G
    description = ("data parallelism on all devices, gradient all-reduce overlapped with the backward of the last "
                   "micro-batch, no re-computation")
    if G % P:
        return Baseline(name="dp", description=description, pipeline_depth=1, data_parallel=P, micro_batch_size=1,
                        micro_batches=1, schedule="1f1b", skipped=f"global batch {G} is not divisible by {P} devices")
    lay = model.layout(1, [0, model.n])
    per = G // P
    choice = None
    for b in sorted(_divisors(per), reverse=True):
        f, M = b / model.b0, per // b
        mem = model.memory(lay, f, [1], [0], [])
        choice = (b, M, f, mem)
        if mem[0] <= model.cap:
            break
    b, M, f, mem = choice
    compute_b = f * lay.bwd[0]
    step = M * f * (lay.fwd[0] + lay.bwd[0]) + max(0.0, lay.ar_work[0] - compute_b)
    pred = _prediction(model, _Estimate(step, mem, [1], []))
    return Baseline(name="dp", description=description, pipeline_depth=1, data_parallel=P, micro_batch_size=b,
                    micro_batches=M, schedule="1f1b", boundaries=[0, model.n], prediction=pred)


# ---------------------------------------------------------------------------------------------
# Summary

def _gb(x: float) -> str:
    return f"{x / GB:.3g}"


def _short(xs: Sequence[int], limit: int = 40) -> str:
    if len(xs) <= limit:
        return str(list(xs))
    return "[" + ", ".join(map(str, xs[:limit // 2])) + f", ... ({len(xs) - limit} more) ..., " + \
        ", ".join(map(str, xs[-limit // 2:])) + "]"


def _ranges(xs: Sequence[int]) -> str:
    if not xs:
        return "-"
    out, start, prev = [], xs[0], xs[0]
    for x in list(xs[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def format_summary(plan: Plan, max_stage_rows: int = 24) -> str:
    """A readable summary: the configuration, one line a stage (the first and last ones of a deep
    pipeline), and the plan beside its baselines."""
    p = plan.prediction
    lines = [
        f"plan for {plan.model} ({plan.num_layers} layers) on {plan.cluster.describe()}",
        f"objective {plan.objective}{' under ' + _gb(plan.memory_cap) + ' GB' if plan.memory_cap else ''}: "
        f"{plan.pipeline_depth} stage(s) x {plan.data_parallel} data-parallel, schedule {plan.schedule}"
        + (f" deferred_stages={_ranges(plan.schedule_params['deferred_stages']) or 'none'}"
           if "deferred_stages" in plan.schedule_params else "")
        + f", global batch {plan.global_batch} = {plan.data_parallel} x {plan.micro_batches} micro-batches of "
          f"{plan.micro_batch_size}",
        f"boundaries {_short(plan.boundaries)}; re-computed layers {_ranges(plan.checkpointed_layers)} "
        f"({len(plan.checkpointed_layers)})",
        "",
    ]
    rows = [["stage", "layers", "fwd ms", "bwd ms", "recomp ms", "params MB", "in flight", "kept MB/mb",
             "deferred", "memory GB"]]
    shown = plan.stages
    if len(shown) > max_stage_rows:
        half = max_stage_rows // 2
        shown = shown[:half] + [None] + shown[-half:]
    for st in shown:
        if st is None:
            rows.append(["...", f"({len(plan.stages) - 2 * half} more)"])
            continue
        rows.append([str(st.stage), f"{st.first_layer}-{st.end_layer - 1}", f"{st.forward * 1e3:.4g}",
                     f"{st.backward * 1e3:.4g}", f"{st.recompute * 1e3:.4g}", f"{st.param_bytes / 1e6:.4g}",
                     str(st.in_flight), f"{st.kept_bytes / 1e6:.4g}", "yes" if st.deferred else "-",
                     _gb(st.memory)])
    lines.append(_table(rows))
    lines.append("")
    rows = [["", "stages x dp", "schedule", "mb x M", "step ms", "samples/s", "scalability",
             f"mem GB ({plan.memory_metric})", "max GB", "ME", "vs DP ME", "fits"]]
    dp = next((b.prediction for b in plan.baselines if b.name == "dp" and b.prediction), None)

    def row(name, depth, width, schedule, b, M, pred):
        rel = f"{pred.me / dp.me:.2f}x" if dp and dp.me > 0 else "-"
        return [name, f"{depth} x {width}", schedule, f"{b} x {M}", f"{pred.step_time * 1e3:.4g}",
                f"{pred.throughput:.4g}", f"{pred.scalability:.3f}", _gb(pred.memory), _gb(pred.memory_max),
                f"{pred.me:.4g}", rel, "yes" if pred.fits else "NO"]

    rows.append(row("plan", plan.pipeline_depth, plan.data_parallel, plan.schedule, plan.micro_batch_size,
                    plan.micro_batches, p))
    skipped = []
    for b in plan.baselines:
        if b.prediction is None:
            skipped.append(f"{b.name}: skipped, {b.skipped}")
            continue
        rows.append(row(b.name, b.pipeline_depth, b.data_parallel, b.schedule, b.micro_batch_size, b.micro_batches,
                        b.prediction))
    lines.append(_table(rows))
    lines.extend(skipped)
    lines.append(f"ME = scalability x throughput / memory (samples/s per GB); single device {plan.single_device_throughput:.4g} "
                 f"samples/s; figures by {p.predicted_by}; planned in {plan.search.get('seconds', 0):.3g} s")
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(width)]
    out = []
    for r in rows:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(out)
