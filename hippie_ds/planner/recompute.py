"""Which layers of a stage to re-compute (per-layer activation checkpointing). Pure Python.

Memory model of one stage, per micro-batch at the profile's batch size (the planner scales it):

* a stage keeps its input (what crosses the cut before it) for every in-flight micro-batch;
* a layer that is kept keeps ``saved`` bytes: what it and its successor save for backward of
  the tensors it produced, its output included (the profiler attributes a saved tensor to the
  layer that produced it, so nothing is counted twice);
* a maximal run of re-computed layers is re-run from its input, which the stage keeps anyway
  (the stage input, or the output of the layer before the run when that is saved; otherwise
  the run's input is kept for it: ``inputs``); its layers keep nothing, except the run's
  output, which the next layer (or the next stage) still needs: ``outputs`` of its last layer;
* while one micro-batch runs its backward, the run being re-computed is materialized again:
  the largest run's saved bytes are needed once, on top (less its output: the re-run's copy is
  not the one the next layer holds).

So with ``p`` micro-batches in flight and the set X re-computed:

    activations(X, p) = p * (input + sum(saved) - sum_{l in X} saved_l
                             + sum_{runs R} (in_first(R) + out_last(R)))
                        + max_{runs R} (sum_{l in R} saved_l - out_last(R))
    extra backward time(X) = sum_{l in X} recompute_l

This is a knapsack per stage (value saved_l, weight recompute_l) with the max-run correction.
:class:`StageRecompute` orders layers by saved bytes per second of re-computation (the LP
relaxation's order: its prefixes are the vertices of the time/memory trade-off) and, for a
time budget and ``p``, picks the prefix with the least memory. Layers that save nothing are
never re-computed; free ones (zero re-compute time, e.g. views and dropout in a profile) first.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence


class StageRecompute:
    """Re-computation options of one stage (layers ``start`` .. ``end-1`` of a profile)."""

    __slots__ = ("start", "order", "cum_time", "cum_saved", "run_out", "max_run", "input", "total_saved", "_best")

    def __init__(
        self,
        start: int,
        saved: Sequence[float],
        recompute: Sequence[float],
        stage_input: float,
        outputs: Sequence[float] | None = None,
        inputs: Sequence[float] | None = None,
    ) -> None:
        self.start = start
        n = len(saved)
        # The part of a layer's saved bytes that stays when it ends a re-computed run, and what a
        # run starting at the layer keeps of its input beyond what is kept anyway.
        out = [0.0] * n if outputs is None else [min(o, s) for o, s in zip(outputs, saved)]
        inp = [0.0] * n if inputs is None else list(inputs)
        self.input = stage_input
        self.total_saved = sum(saved)
        candidates = [i for i in range(n) if saved[i] > 0]
        # Most bytes per second first (zero-time layers: infinitely good); ties: earlier layer.
        candidates.sort(key=lambda i: (-(saved[i] / recompute[i]) if recompute[i] > 0 else -float("inf"), i))
        self.order = candidates
        cum_time, cum_saved, run_out, max_run = [0.0], [0.0], [0.0], [0.0]
        # Union-find over positions to track the runs of re-computed layers as they grow.
        parent = list(range(n))
        run_sum = [0.0] * n
        run_end = list(range(n))
        active = [False] * n

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        best_run = ends = 0.0
        for i in candidates:
            left, right = i > 0 and active[i - 1], i + 1 < n and active[i + 1]
            # i ends a run unless i+1 is active, and stops i-1 from ending one; i starts a run
            # unless i-1 is active, and stops i+1 from starting one.
            ends += (0.0 if right else out[i]) - (out[i - 1] if left else 0.0)
            ends += (0.0 if left else inp[i]) - (inp[i + 1] if right else 0.0)
            active[i] = True
            run_sum[i] = saved[i]
            for j in (i - 1, i + 1):
                if 0 <= j < n and active[j]:
                    a, b = find(i), find(j)
                    if a != b:
                        parent[b] = a
                        run_sum[a] += run_sum[b]
                        run_end[a] = max(run_end[a], run_end[b])
            root = find(i)
            # Merging runs never lowers this (saved >= out), so the running max is the max.
            best_run = max(best_run, run_sum[root] - out[run_end[root]])
            cum_time.append(cum_time[-1] + recompute[i])
            cum_saved.append(cum_saved[-1] + saved[i])
            run_out.append(ends)
            max_run.append(best_run)
        self.cum_time, self.cum_saved, self.run_out, self.max_run = cum_time, cum_saved, run_out, max_run
        self._best: dict[int, list[int]] = {}

    @property
    def options(self) -> int:
        """Number of prefixes (0 = nothing re-computed)."""
        return len(self.cum_time)

    def activations(self, k: int, p: int) -> float:
        """Activation bytes (profile batch) with the first ``k`` layers of the order re-computed
        and ``p`` micro-batches in flight."""
        return p * self.kept(k) + self.max_run[k]

    def kept(self, k: int) -> float:
        """Bytes kept per in-flight micro-batch (the stage input and the kept layers)."""
        return max(self.input + self.total_saved - self.cum_saved[k] + self.run_out[k], 0.0)  # no rounding residue

    def time(self, k: int) -> float:
        return self.cum_time[k]

    def _best_upto(self, p: int) -> list[int]:
        """best[k] = the prefix <= k with the least activation memory for ``p`` (ties: fewer)."""
        best = self._best.get(p)
        if best is None:
            best, arg, low = [], 0, float("inf")
            for k in range(self.options):
                mem = self.activations(k, p)
                if mem < low * (1 - 1e-12):
                    arg, low = k, mem
                best.append(arg)
            self._best[p] = best
        return best

    def choose(self, p: int, budget: float) -> int:
        """The prefix with the least memory whose re-computation time is <= ``budget``."""
        if budget < 0:
            return 0
        limit = bisect_right(self.cum_time, budget * (1 + 1e-12)) - 1
        return self._best_upto(p)[max(limit, 0)]

    def least(self, p: int) -> float:
        """The least activation memory over all prefixes (a bound for pruning)."""
        return self.activations(self._best_upto(p)[-1], p)

    def layers(self, k: int) -> list[int]:
        """Profile indices of the layers the prefix ``k`` re-computes, ascending."""
        return sorted(self.start + i for i in self.order[:k])


def activations_of(
    selected: Sequence[int],
    start: int,
    saved: Sequence[float],
    stage_input: float,
    p: int,
    outputs: Sequence[float] | None = None,
    inputs: Sequence[float] | None = None,
) -> float:
    """The memory model for an arbitrary set of re-computed layers (profile indices), written
    out run by run: for tests and for checking a plan's choice."""
    n = len(saved)
    on = [start + i in set(selected) for i in range(n)]
    out = [0.0] * n if outputs is None else [min(o, s) for o, s in zip(outputs, saved)]
    inp = [0.0] * n if inputs is None else list(inputs)
    kept = sum(s for i, s in enumerate(saved) if not on[i])
    best, i = 0.0, 0
    while i < n:
        if not on[i]:
            i += 1
            continue
        j = i
        while j + 1 < n and on[j + 1]:
            j += 1
        kept += inp[i] + out[j]
        best = max(best, sum(saved[i : j + 1]) - out[j])
        i = j + 1
    return p * (stage_input + kept) + best


class ChunkedRecompute:
    """Re-computation options of a stage holding ``v`` model chunks (virtual stages), one
    :class:`StageRecompute` each. A choice is a tuple of per-chunk prefixes (the int 0: nothing
    re-computed); ``p`` is a tuple of per-chunk in-flight micro-batches. Activations add up over
    the chunks (each keeps its micro-batches' bytes), the re-materialized run is the largest
    chunk's (one backward at a time). The options are one merged order: each chunk's layers in
    its own order, interleaved by bytes saved per second of re-computation weighted by that
    chunk's in-flight count (the LP order of the summed knapsack)."""

    __slots__ = ("chunks", "v", "_merged")

    def __init__(self, chunks: Sequence[StageRecompute]) -> None:
        self.chunks = list(chunks)
        self.v = len(self.chunks)
        self._merged: dict[tuple[int, ...], tuple[list[tuple[int, ...]], list[float]]] = {}

    def _k(self, k) -> tuple[int, ...]:
        if isinstance(k, int):
            if k:
                raise ValueError(f"re-computation choice {k!r} of a {self.v}-chunk stage: expected per-chunk prefixes")
            return (0,) * self.v
        return tuple(k)

    @property
    def options(self) -> int:
        return sum(c.options - 1 for c in self.chunks) + 1

    def time(self, k) -> float:
        return sum(c.time(x) for c, x in zip(self.chunks, self._k(k)))

    def kept(self, k) -> float:
        """Bytes kept per in-flight micro-batch, all chunks together."""
        return sum(c.kept(x) for c, x in zip(self.chunks, self._k(k)))

    def activations(self, k, p: Sequence[int]) -> float:
        k = self._k(k)
        return sum(q * c.kept(x) for c, x, q in zip(self.chunks, k, p)) + max(
            c.max_run[x] for c, x in zip(self.chunks, k)
        )

    def layers(self, k) -> list[int]:
        return sorted(i for c, x in zip(self.chunks, self._k(k)) for i in c.layers(x))

    def _options(self, p: Sequence[int]) -> tuple[list[tuple[int, ...]], list[float]]:
        """The merged prefixes for in-flight ``p`` and their re-computation times."""
        key = tuple(p)
        got = self._merged.get(key)
        if got is None:
            steps = []
            for ci, c in enumerate(self.chunks):
                for j in range(c.options - 1):
                    dt, ds = c.cum_time[j + 1] - c.cum_time[j], c.cum_saved[j + 1] - c.cum_saved[j]
                    steps.append((-(p[ci] * ds / dt) if dt > 0 else -float("inf"), ci, j))
            steps.sort()  # within a chunk the ratios descend already: its prefixes stay in order
            at = [0] * self.v
            prefixes, times = [tuple(at)], [0.0]
            for _, ci, _j in steps:
                at[ci] += 1
                prefixes.append(tuple(at))
                times.append(self.time(prefixes[-1]))
            got = self._merged[key] = (prefixes, times)
        return got

    def choose(self, p: Sequence[int], budget: float) -> tuple[int, ...]:
        """The merged prefix with the least memory whose re-computation time is <= ``budget``."""
        prefixes, times = self._options(p)
        if budget < 0:
            return prefixes[0]
        limit = bisect_right(times, budget * (1 + 1e-12)) - 1
        best, low = prefixes[0], float("inf")
        for k in prefixes[: max(limit, 0) + 1]:
            mem = self.activations(k, p)
            if mem < low * (1 - 1e-12):
                best, low = k, mem
        return best

    def least(self, p: Sequence[int]) -> float:
        return min(self.activations(k, p) for k in self._options(p)[0])
