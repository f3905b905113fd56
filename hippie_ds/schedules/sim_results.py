"""The simulator's results: timeline events, :class:`SimResult`, and the per-stage and per-call
figures assembled from a finished run (definitions in :mod:`.simulator`'s docstring). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .costs import Costs


class SimEvent(NamedTuple):
    """One interval of a timeline. ``category`` 'comm' goes on the stage's communication track
    (all-reduces, non-blocking sends in flight); every other category is the stage's stream."""

    stage: int
    name: str
    category: str
    start: float
    end: float
    micro_batch: int | None


@dataclass
class SimResult:
    schedule: str
    stages: int
    micro_batches: int
    params: dict
    step_time: float
    bubble_fraction: float
    per_stage: list[dict]
    throughput: float  # micro-batches per second over all data-parallel replicas
    events: list[SimEvent] = field(repr=False)
    data_parallel: int = 1
    iterations: int = 1
    allreduce_on_critical_path: float = 0.0  # step_time minus the step time with free all-reduces
    # Per simulated call: end, step_time, and per stage its start/end and compute start/end.
    timeline: list[dict] = field(default_factory=list, repr=False)

    def to_dict(self, events: bool = True) -> dict:
        out = {
            k: getattr(self, k)
            for k in (
                "schedule",
                "stages",
                "micro_batches",
                "params",
                "step_time",
                "bubble_fraction",
                "throughput",
                "data_parallel",
                "iterations",
                "allreduce_on_critical_path",
            )
        }
        out["per_stage"] = [dict(p) for p in self.per_stage]
        out["timeline"] = [dict(t) for t in self.timeline]
        if events:
            out["events"] = [list(e) for e in self.events]
        return out

    def summary(self) -> str:
        lines = [
            f"{self.schedule} {self.params}: {self.stages} stages x {self.micro_batches} micro-batches, "
            f"dp={self.data_parallel}: step {self.step_time:.6g} s, bubble {self.bubble_fraction:.1%}, "
            f"{self.throughput:.4g} micro-batches/s, all-reduce on critical path "
            f"{self.allreduce_on_critical_path:.6g} s",
            "stage      busy      idle  peak_mb  exp_allreduce  exp_p2p  exp_sync  allreduce  buffer_bytes",
        ]
        for p in self.per_stage:
            lines.append(
                f"{p['stage']:5d} {p['busy']:9.4g} {p['idle']:9.4g} {p['peak_activation_microbatches']:8.4g} "
                f"{p['exposed_allreduce']:14.4g} {p['exposed_p2p']:8.4g} {p['exposed_sync']:9.4g} "
                f"{p['allreduce_time']:10.4g} {p['gradient_buffer_bytes']:13.4g}"
            )
        return "\n".join(lines)


def per_stage_figures(sim, costs: Costs, step_time: float, last: int) -> list[dict]:
    """Per stage, the figures of call ``last``: busy / idle time, peak activations, gradient
    buffer, weight versions, exposed communication."""
    per_stage = []
    for s in range(costs.num_stages):
        a, sc = sim.acc[s][last], costs.stages[s]
        peak = a.peak / sim.v if sim.v > 1 else a.peak  # a chunk's micro-batch holds 1/v of the stage's activations
        ar_time = sum(ar.end - ar.start for ar in sim.allreduces if ar.stage == s and ar.iteration == last)
        exposed = a.p2p + a.allreduce + a.sync
        per_stage.append(
            {
                "stage": s,
                "busy": a.busy,
                "idle": step_time - a.busy,
                "peak_activation_microbatches": peak,
                "peak_activation_bytes": peak * sc.saved_bytes,
                "gradient_buffer_bytes": sc.param_bytes * sim.share[s, "buffer"] if sim.uses_buffer[s] else 0.0,
                "delayed_fraction": sim.share[s, "buffer"] if sim.uses_buffer[s] else 0.0,
                # weight versions held at once (1: just the current weights); the extra ones cost
                # param_bytes each (2bw: one shadow copy; pipedream: stashed versions)
                "weight_versions": a.versions,
                "extra_weight_bytes": (a.versions - 1) * sc.param_bytes,
                "exposed_allreduce": a.allreduce,
                "exposed_p2p": a.p2p,
                "exposed_sync": a.sync,
                "exposed_comm": exposed,
                "allreduce_time": ar_time,
            }
        )
    return per_stage


def call_timeline(sim, ends: list[float], step_times: list[float]) -> list[dict]:
    """Per simulated call: its end and step time, and per stage its start / end, compute start /
    end, first forward and last parameter-gradient op."""
    K = len(sim.acc)
    timeline = []
    for i in range(len(ends)):
        accs = [sim.acc[s][i] for s in range(K)]
        timeline.append(
            {
                "iteration": i,
                "end": ends[i],
                "step_time": step_times[i],
                "stage_start": [sim.starts[s][i] for s in range(K)],
                "stage_end": [sim.ends[s][i] for s in range(K)],
                "compute_start": [a.compute_start for a in accs],
                "compute_end": [a.compute_end for a in accs],
                "first_forward": [a.first_forward for a in accs],
                "last_backward": [a.last_backward for a in accs],
            }
        )
    return timeline
