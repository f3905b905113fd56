"""The simulator's discrete-event machinery: a minimal process-based kernel and the resources
stages contend for (p2p channels, the shared inter-node link that all-reduces split), and what a
run keeps per stage (``_StageState``, ``_Acc``). Pure Python; :mod:`hippie_ds.schedules.simulator` runs schedules on
it."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator

from .grad_buffer import GradBuffer
from .ir import OpKind


class SimulationError(RuntimeError):
    """The schedule cannot be simulated (deadlock, mismatched p2p, wrong cost shape)."""


# ---------------------------------------------------------------------------------------------
# A minimal process-based event kernel: a process is a generator that yields a delay (float)
# or a _Signal to wait for; events are handled in time order (ties in insertion order).


class _Signal:
    __slots__ = ("time", "waiters")

    def __init__(self) -> None:
        self.time: float | None = None
        self.waiters: list = []


class _Kernel:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def fire(self, sig: _Signal) -> None:
        sig.time = self.now
        for gen in sig.waiters:
            self.at(self.now, self.step, gen)
        sig.waiters = []

    def spawn(self, gen: Iterator) -> None:
        self.at(self.now, self.step, gen)

    def step(self, gen: Iterator) -> None:
        while True:
            try:
                req = next(gen)
            except StopIteration:
                return
            if isinstance(req, _Signal):
                if req.time is None:
                    req.waiters.append(gen)
                    return
            elif req > 0:
                self.at(self.now + req, self.step, gen)
                return

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


# ---------------------------------------------------------------------------------------------
# Communication resources


class _Transfer:
    __slots__ = ("mb", "done", "start", "end")

    def __init__(self, mb: int | None) -> None:
        self.mb = mb
        self.done = _Signal()
        self.start: float | None = None
        self.end: float | None = None


class _Channel:
    """FIFO p2p channel in one direction; whichever side posts second starts the transfer."""

    def __init__(self, kernel: _Kernel, name: str, duration: float) -> None:
        self.k, self.name, self.duration = kernel, name, duration
        self.waiting = {"send": deque(), "recv": deque()}

    def post(self, side: str, mb: int | None) -> _Transfer:
        other = self.waiting["recv" if side == "send" else "send"]
        if not other:
            tr = _Transfer(mb)
            self.waiting[side].append(tr)
            return tr
        tr = other.popleft()
        if tr.mb != mb:
            raise SimulationError(
                f"channel {self.name}: {side} of micro-batch {mb} matched with micro-batch "
                f"{tr.mb}: sends and receives are not in the same order"
            )
        tr.start = self.k.now
        self.k.at(self.k.now + self.duration, self._complete, tr)
        return tr

    def _complete(self, tr: _Transfer) -> None:
        tr.end = self.k.now
        self.k.fire(tr.done)


class _AllReduce:
    __slots__ = ("stage", "target", "work", "remaining", "latency", "start", "end", "done", "iteration")

    def __init__(self, stage: int, target: str, work: float, latency: float, start: float) -> None:
        self.stage, self.target, self.work, self.remaining, self.latency = stage, target, work, work, latency
        self.start, self.end = start, None
        self.done = _Signal()
        self.iteration: int | None = None  # the call whose WAIT consumed it


class _Link:
    """The data-parallel link. ``work`` is seconds at full bandwidth; with ``shared`` the n
    all-reduces in flight progress at 1/n each (fluid max-min fair sharing)."""

    def __init__(self, kernel: _Kernel, shared: bool) -> None:
        self.k, self.shared = kernel, shared
        self.active: list[_AllReduce] = []
        self.last = 0.0
        self.version = 0  # invalidates planned completions after a rate change

    def start(self, ar: _AllReduce) -> None:
        if ar.work <= 0:
            self.k.at(self.k.now + ar.latency, self._finish, ar)
            return
        self._advance()
        self.active.append(ar)
        self._plan()

    def _rate(self) -> float:
        return 1.0 / len(self.active) if self.shared else 1.0

    def _advance(self) -> None:
        dt = self.k.now - self.last
        if dt > 0 and self.active:
            rate = self._rate()
            for ar in self.active:
                ar.remaining -= dt * rate
        self.last = self.k.now

    def _plan(self) -> None:
        self.version += 1
        if self.active:
            nxt = min(ar.remaining for ar in self.active)
            self.k.at(self.k.now + max(nxt, 0.0) / self._rate(), self._tick, self.version)

    def _tick(self, version: int) -> None:
        if version != self.version:
            return
        self._advance()
        least = min(ar.remaining for ar in self.active)
        # The planned one(s) are done up to rounding; equal-sized peers finish together.
        done = [ar for ar in self.active if ar.remaining <= least + 1e-12 * max(ar.work, 1e-300)]
        for ar in done:
            self.active.remove(ar)
            ar.remaining = 0.0
            self.k.at(self.k.now + ar.latency, self._finish, ar)
        self._plan()

    def _finish(self, ar: _AllReduce) -> None:
        ar.end = self.k.now
        self.k.fire(ar.done)


# ---------------------------------------------------------------------------------------------
# Per-stage state of a run.


class _Acc:
    """Per stage and call: what the figures are made of."""

    __slots__ = (
        "busy",
        "p2p",
        "allreduce",
        "sync",
        "peak",
        "compute_start",
        "compute_end",
        "first_forward",
        "last_backward",
        "versions",
    )

    def __init__(self) -> None:
        self.busy = self.p2p = self.allreduce = self.sync = 0.0
        self.peak = 0
        self.versions = 1  # weight versions held at once (current + stashed)
        self.compute_start = self.compute_end = self.first_forward = self.last_backward = None


class _StageState:
    def __init__(self) -> None:
        self.live = 0  # micro-batches whose forward started and backward has not ended
        self.isends: list[_Transfer] = []
        self.pending: dict[str, list[_AllReduce]] = {"grads": [], "buffer": []}
        self.buffer = GradBuffer()  # the deferred stage's gradient buffer (state only; sizes are costs')
        self.collective_count: dict[OpKind, int] = {}
        self.stashed: set[int] = set()  # weight versions kept besides the current one
        self.started_early = False  # the 'grads' all-reduce was started inside the last backward
        self.chunk_share = 0.0  # the share of the 'grads' all-reduce already started by start_allreduce(chunk)
