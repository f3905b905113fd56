"""The executed-instruction timeline of one ``HippiePipelineEngine`` rank (``hippie.timeline_dir``):
what ran when, for Chrome traces, the demo's picture and the benchmarks' measured costs.

Events of the last ``steps`` train_batch calls only, so a long run's memory stays flat. An
all-reduce is drawn in flight from its start (inside a backward when it started early) until
its wait returned: gloo reports no completion time.
"""
from __future__ import annotations

import collections
import json
import os
import time
from typing import Callable

from ..schedules.ir import CATEGORY, OpKind, op_name


def compute_clock(device) -> Callable[[], float]:
    """The clock instructions are timed with on ``device``: ``time.perf_counter``, after the
    compute stream's queued kernels on a CUDA device (their launch returns at once). Only the
    current stream is waited for: an all-reduce on its side stream stays in flight."""
    if getattr(device, "type", None) != "cuda":
        return time.perf_counter
    import torch

    def clock() -> float:
        torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()
    return clock


class Timeline:
    """Events ({name, kind, category, start, end, step, micro_batch}; seconds from ``t0``).
    ``now`` is the clock instructions are timed with (:func:`compute_clock`)."""

    def __init__(self, steps: int, now: Callable[[], float] = time.perf_counter):
        self.steps, self.now = steps, now
        self.events: collections.deque[dict] = collections.deque()
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()  # to align ranks' timelines (same host clock)
        self._inflight: dict[str, float] = {}  # all-reduce target -> start

    def __iter__(self):
        return iter(self.events)

    def __len__(self):
        return len(self.events)

    def mark_start(self, target: str) -> None:
        """An all-reduce of ``target`` started now, outside its declared op (early, in a backward)."""
        self._inflight[target] = time.perf_counter()

    def record(self, cmd, op, start: float, end: float, step: int) -> None:
        """``cmd``, running ``op`` (None: an instruction of DeepSpeed's own schedules), ran from
        ``start`` to ``end`` (perf_counter) in train_batch call ``step``."""
        self.events.append({"name": op_name(op) if op else repr(cmd), "kind": type(cmd).__name__,
                            "category": CATEGORY.get(op.kind, "other") if op else "other", "start": start - self.t0,
                            "end": end - self.t0, "step": step, "micro_batch": op.micro_batch if op else None})
        if op is not None and op.kind == OpKind.START_ALLREDUCE:
            self._inflight.setdefault(op.target, start)  # set earlier when the all-reduce started early
        elif op is not None and op.kind == OpKind.WAIT_ALLREDUCE and op.target in self._inflight:
            self.events.append({"name": f"allreduce({op.target})", "kind": "AllReduceInFlight", "category": "comm",
                                "start": self._inflight.pop(op.target) - self.t0, "end": end - self.t0,
                                "step": step, "micro_batch": None})

    def keep_after(self, step: int) -> None:
        """Drop the events of calls before the last ``steps`` ending with ``step``."""
        while self.events and self.events[0]["step"] <= step - self.steps:
            self.events.popleft()

    def write(self, path: str, **meta) -> str:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({**meta, "t0_unix": self.t0_unix, "steps_kept": self.steps, "events": list(self.events)}, f)
        return path
