"""What ran when on one ``HippiePipelineEngine`` rank: :class:`InstructionEvent`, what the public
instruction hook (``engine.add_instruction_hook``) receives after each instruction, and the
:class:`Timeline` that hook keeps when ``hippie.timeline_dir`` is set, for Chrome traces, the demo's
picture and measured cost files (``hippie-ds costs --timeline``).

Events of the last ``steps`` train_batch calls only, so a long run's memory stays flat. An
all-reduce is drawn in flight from its start (inside a backward when it started early) until
its wait returned: gloo reports no completion time.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ...schedules.ir import CATEGORY, OP_INFO, Op, op_name


@dataclass(frozen=True)
class InstructionEvent:
    """One instruction a rank ran in ``train_batch`` or ``drain``: ``kind`` its class name
    (``ForwardPass``, ``ISendGrad``, ...), ``op`` the schedule's op it ran (None for an instruction
    of DeepSpeed's own schedules), ``start``/``end`` on the engine's compute clock
    (:func:`compute_clock`, seconds), ``step`` the index of its ``train_batch`` call."""

    kind: str
    op: Optional[Op]
    start: float
    end: float
    step: int
    instruction: object = None

    @property
    def name(self) -> str:
        return op_name(self.op) if self.op is not None else repr(self.instruction)


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


def time_stock_handlers(engine, record: Callable[[type, dict, float, float], None]) -> None:
    """Time a stock ``PipelineEngine``'s instructions (which has no instruction hook): this instance's
    ``_INSTRUCTION_MAP`` (looked up before the class's) wraps each handler to call
    ``record(instruction class, its kwargs, start, end)`` on :func:`compute_clock`'s clock. The one
    place outside the engine that rebinds DeepSpeed's map (the bench times stock 1F1B with it)."""
    now = compute_clock(engine.device)

    def timed(cls, handler):
        def run(self, **kwargs):
            start = now()
            handler(self, **kwargs)
            record(cls, kwargs, start, now())

        return run

    from ..ds.engine import wrap_handlers

    wrap_handlers(engine, timed)


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

    def __call__(self, event: InstructionEvent) -> None:
        """Record ``event`` (the engine's instruction hook)."""
        op, start, end, step = event.op, event.start, event.end, event.step
        self.events.append(
            {
                "name": event.name,
                "kind": event.kind,
                "category": CATEGORY.get(op.kind, "other") if op else "other",
                "start": start - self.t0,
                "end": end - self.t0,
                "step": step,
                "micro_batch": op.micro_batch if op else None,
            }
        )
        phase = OP_INFO[op.kind].allreduce if op is not None else ""
        if phase == "start":
            self._inflight.setdefault(op.target, start)  # set earlier when the all-reduce started early
        elif phase == "wait" and op.target in self._inflight:
            self.events.append(
                {
                    "name": f"allreduce({op.target})",
                    "kind": "AllReduceInFlight",
                    "category": "comm",
                    "start": self._inflight.pop(op.target) - self.t0,
                    "end": end - self.t0,
                    "step": step,
                    "micro_batch": None,
                }
            )

    def keep_after(self, step: int) -> None:
        """Drop the events of calls before the last ``steps`` ending with ``step``."""
        while self.events and self.events[0]["step"] <= step - self.steps:
            self.events.popleft()

    def write(self, path: str, **meta) -> str:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({**meta, "t0_unix": self.t0_unix, "steps_kept": self.steps, "events": list(self.events)}, f)
        return path
