"""Contiguous partitions of a layer sequence into pipeline stages. Pure Python.

A partition is DeepSpeed's ``parts`` list: K+1 increasing boundaries [0, b1, ..., N]; stage s
holds layers parts[s] .. parts[s+1]-1.

* :func:`min_bottleneck` - optimal: minimizes the largest stage weight (the pipeline's
  bottleneck). Bisection on the bottleneck value with a greedy feasibility test that jumps
  through prefix sums by binary search: O(K log N) a test, about 64-100 tests (until the bounds
  are adjacent floats), so N = 1,000 and K = 64 take well under a millisecond of arithmetic.
* :func:`chunked_partition` - virtual stages: K x v parts, stage s holding the parts a
  :class:`~hippie_ds.schedules.layout.Layout` places on it; minimizes the largest *stage* sum
  (its chunks together), heuristically: the optimal K x v-part bottleneck partition, then
  single-layer boundary moves while they lower the largest stage sum (then the sum of squares).
* :func:`brute_force` - every partition (tests).
* :func:`uniform` - DeepSpeed's ``partition_uniform``; :func:`deepspeed_parameters` - its
  ``partition_balanced`` (the 'parameters' method), reproduced exactly, ties included.
* :func:`pipedream_dp` - PipeDream's dynamic program over layer prefixes and machine counts;
  :func:`pipedream_brute_force` evaluates the same objective over every plan (tests);
  :func:`pipedream_uniform` - the same recurrence for K stages that are all replicated r times
  (the planner's 'pipedream' baseline: hippie-ds stages share one data-parallel width).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence


def prefix_sums(weights: Sequence[float]) -> list[float]:
    out = [0.0]
    for w in weights:
        out.append(out[-1] + w)
    return out


def stage_sums(weights: Sequence[float], parts: Sequence[int]) -> list[float]:
    return [sum(weights[a:b]) for a, b in zip(parts, parts[1:])]


def check_parts(parts: Sequence[int], n: int, k: int | None = None) -> None:
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != n or any(b <= a for a, b in zip(parts, parts[1:])):
        raise ValueError(f"partition {list(parts)}: expected strictly increasing boundaries from 0 to {n}")
    if k is not None and len(parts) != k + 1:
        raise ValueError(f"partition {list(parts)}: {len(parts) - 1} stages, expected {k}")


# ---------------------------------------------------------------------------------------------
# Optimal bottleneck partition


def _greedy(prefix: list[float], k: int, limit: float) -> list[int] | None:
    """Left-to-right greedy: each stage takes as many layers as fit under ``limit``. Returns
    the boundaries, or None when more than ``k`` stages would be needed."""
    n = len(prefix) - 1
    parts = [0]
    a = 0
    while a < n:
        if len(parts) > k:
            return None
        b = bisect_right(prefix, prefix[a] + limit, lo=a + 1) - 1
        # prefix[a] + limit may round differently from prefix[b] - prefix[a]; fix up exactly.
        while b > a and prefix[b] - prefix[a] > limit:
            b -= 1
        while b < n and prefix[b + 1] - prefix[a] <= limit:
            b += 1
        if b == a:
            return None  # one layer alone exceeds the limit
        parts.append(b)
        a = b
    return parts if len(parts) - 1 <= k else None


def _fill(parts: list[int], k: int) -> list[int]:
    """Split stages until there are exactly ``k`` (never raises the bottleneck): the widest stage
    gives up its last layer to a new stage."""
    parts = list(parts)
    while len(parts) - 1 < k:
        s = max(range(len(parts) - 1), key=lambda i: (parts[i + 1] - parts[i], -i))
        parts.insert(s + 1, parts[s + 1] - 1)
    return parts


def min_bottleneck(weights: Sequence[float], k: int, prefix: list[float] | None = None) -> tuple[list[int], float]:
    """The partition of ``weights`` into exactly ``k`` non-empty contiguous stages with the
    smallest maximum stage sum, and that sum. Needs 1 <= k <= len(weights)."""
    n = len(weights)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    prefix = prefix if prefix is not None else prefix_sums(weights)
    lo = max(weights)  # no partition beats the largest layer ...
    hi = prefix[-1]  # ... and one stage always fits under the total
    if k == 1 or lo >= hi:
        parts = _greedy(prefix, k, hi)
        return _fill(parts, k), max(stage_sums(weights, _fill(parts, k)))
    best = _greedy(prefix, k, lo)
    if best is not None:
        return _fill(best, k), max(stage_sums(weights, _fill(best, k)))
    # Invariant: lo infeasible, hi feasible. hi only takes achieved bottleneck values, so it
    # is exact when the loop ends (no float strictly between lo and hi).
    best = _greedy(prefix, k, hi)
    hi = max(prefix[b] - prefix[a] for a, b in zip(best, best[1:]))
    for _ in range(200):
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            break
        parts = _greedy(prefix, k, mid)
        if parts is None:
            lo = mid
        else:
            best = parts
            hi = max(prefix[b] - prefix[a] for a, b in zip(parts, parts[1:]))
    best = _fill(best, k)
    return best, max(prefix[b] - prefix[a] for a, b in zip(best, best[1:]))


def chunk_stage_sums(prefix: Sequence[float], parts: Sequence[int], owner: Sequence[int], k: int) -> list[float]:
    """Per stage: the sum of its parts (``owner[p]``: the stage holding part p)."""
    sums = [0.0] * k
    for p, (a, b) in enumerate(zip(parts, parts[1:])):
        sums[owner[p]] += prefix[b] - prefix[a]
    return sums


def chunked_partition(
    weights: Sequence[float],
    k: int,
    v: int,
    kind: str = "interleaved",
    prefix: list[float] | None = None,
    max_moves: int | None = None,
) -> tuple[list[int], float]:
    """K x v contiguous non-empty parts (``kind``: the layout placing them, ``interleaved`` or
    ``v``) whose largest stage sum is small, and that sum. Needs k * v <= len(weights).

    Not exact (a stage's parts are not contiguous, so the bisection of :func:`min_bottleneck`
    does not apply): it starts from the optimal bottleneck partition into k * v parts, whose
    stages are within v x its bottleneck, and descends while a move lowers (largest stage sum,
    sum of squared stage sums, sum of squared part sums: equal stages first, then equal chunks).
    A move shifts one boundary by one layer (a layer to the neighbouring part, on another
    stage); when none helps, a run of consecutive boundaries shifts together (a layer from one
    part to a farther one). O(moves x (k v)^2), the escapes O((k v)^3); a heavy head or
    embedding layer makes the parts around it smaller, which balanced parts alone cannot."""
    from hippie_ds.schedules.layout import Layout

    n = len(weights)
    parts_count = k * v
    if not 1 <= parts_count <= n:
        raise ValueError(f"cannot split {n} layers into {k} stages x {v} chunks = {parts_count} non-empty parts")
    prefix = prefix if prefix is not None else prefix_sums(weights)
    parts, _ = min_bottleneck(weights, parts_count, prefix)
    if v == 1:
        return parts, max(stage_sums(weights, parts))
    geometry = Layout(kind, k, v)
    owner = [geometry.place(p)[0] for p in range(parts_count)]
    scale = max(prefix[-1], 1e-300)

    def key(ps: list[int]) -> tuple[float, float, float]:
        sums = chunk_stage_sums(prefix, ps, owner, k)
        return (
            max(sums) / scale,
            sum((x / scale) ** 2 for x in sums),
            sum(((prefix[b] - prefix[a]) / scale) ** 2 for a, b in zip(ps, ps[1:])),
        )

    def better(x: tuple, y: tuple) -> bool:  # lexicographic, ties within rounding
        for a, b in zip(x, y):
            if a < b - 1e-12:
                return True
            if a > b + 1e-12:
                return False
        return False

    def shifted(i: int, j: int, d: int) -> list[int] | None:
        """Boundaries i..j moved by d, or None when a part would be empty."""
        ps = parts[:i] + [x + d for x in parts[i : j + 1]] + parts[j + 1 :]
        return ps if all(y > x for x, y in zip(ps[i - 1 : j + 2], ps[i : j + 2])) else None

    best = key(parts)
    for _ in range(max_moves if max_moves is not None else 4 * n):
        move = None
        for span in (0, None):  # single boundaries first; runs only to escape
            for i in range(1, parts_count):
                for j in [i] if span == 0 else range(i + 1, parts_count):
                    for d in (-1, 1):
                        ps = shifted(i, j, d)
                        if ps is None:
                            continue
                        got = key(ps)
                        if better(got, best) and (move is None or better(got, move[0])):
                            move = (got, ps)
            if move is not None:
                break
        if move is None:
            break
        best, parts = move
    return parts, best[0] * scale


def brute_force(weights: Sequence[float], k: int) -> tuple[list[int], float]:
    """Every partition into ``k`` stages; the one with the smallest bottleneck (ties: first)."""
    n = len(weights)
    prefix = prefix_sums(weights)
    best, best_value = None, math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        parts = [0, *cuts, n]
        value = max(prefix[b] - prefix[a] for a, b in zip(parts, parts[1:]))
        if value < best_value:
            best, best_value = parts, value
    if best is None:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    return best, best_value


# ---------------------------------------------------------------------------------------------
# DeepSpeed's methods


def uniform(num_items: int, num_parts: int) -> list[int]:
    """``deepspeed.runtime.utils.partition_uniform``: equal layer counts, the first
    ``num_items % num_parts`` stages one layer more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def deepspeed_parameters(weights: Sequence[float], num_parts: int) -> list[int]:
    """``deepspeed.runtime.utils.partition_balanced`` (DeepSpeed 0.19), the 'parameters' method
    with ``weights`` = parameter counts per layer: a dynamic program that minimizes the
    difference between the largest and the smallest stage (not the largest alone), the last
    of equally good split points winning. Same arithmetic (float64 prefix sums, the same
    comparisons), so the same result. O(N^2 K); skips split points that cannot be reached,
    which never win in DeepSpeed's loop either."""
    n, m = len(weights), num_parts
    if n <= m:
        return uniform(n, m)
    inf = math.inf
    prefix = [0.0] * (n + 1)
    acc = 0
    for i, w in enumerate(weights):  # numpy.cumsum: exact for integer counts, sequential for floats
        acc = acc + w
        prefix[i + 1] = float(acc)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        pi = prefix[i]
        for j in range(1, min(i, m) + 1):
            # k < j-1 cannot hold j-1 non-empty parts: dp_max is inf there, cost inf, and a
            # reachable k (cost finite) always follows and replaces it.
            best_cost, best_max, best_min, best_k = inf, inf, inf, 0
            for k in range(j - 1, i):
                seg = pi - prefix[k]
                pmax = dp_max[k][j - 1]
                pmin = dp_min[k][j - 1]
                max_sum = pmax if pmax > seg else seg
                min_sum = pmin if pmin < seg else seg
                cost = max_sum - min_sum
                if best_cost >= cost:
                    best_cost, best_max, best_min, best_k = cost, max_sum, min_sum, k
            dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = best_cost, best_max, best_min, best_k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


# ---------------------------------------------------------------------------------------------
# PipeDream's dynamic program


@dataclass
class PipeDreamResult:
    time: float  # A(N, M): the slowest stage (or transfer) of the best plan
    parts: list[int]  # stage boundaries
    replication: list[int]  # machines of each stage


def _stage_time(compute: float, params: float, m: int, bandwidth: float, combine: str) -> float:
    """T(i -> j, m): a stage replicated ``m`` times, with W^m = 4 (m-1) |W| / (bw m) the
    data-parallel weight synchronisation (PipeDream's constant: a ring all-reduce moves
    2 (m-1)/m |W| each way). combine 'sum' is PipeDream's code, 'max' the paper's formula."""
    sync = 4 * (m - 1) * params / (bandwidth * m)
    return (compute + sync) / m if combine == "sum" else max(compute, sync) / m


def pipedream_dp(
    compute: Sequence[float],
    params: Sequence[float],
    cut_bytes: Sequence[float],
    machines: int,
    bandwidth: float,
    combine: str = "sum",
    transfers: bool = True,
) -> PipeDreamResult:
    """PipeDream's recurrence over layer prefixes j and machine counts m:

        A(j, m) = min( T(1 -> j, m),
                       min_{i < j, m' < m} max(A(i, m - m'), 2 C_i, T(i+1 -> j, m')) )

    with T as in :func:`_stage_time`, C_i = cut_bytes[i-1] / bandwidth (the activation crossing
    the cut after layer i; ``transfers=False`` leaves it out). Every plan uses exactly
    ``machines`` machines. O(N^2 M^2). Ties: the smaller i, then the smaller m'."""
    n = len(compute)
    if machines < 1 or n < 1:
        raise ValueError("need at least one layer and one machine")
    pc, pp = prefix_sums(compute), prefix_sums(params)
    inf = math.inf
    # A[j][m]: layers 0..j-1 on m machines; choice[j][m] = (i, m') or None (one stage).
    A = [[inf] * (machines + 1) for _ in range(n + 1)]
    choice: list[list[tuple[int, int] | None]] = [[None] * (machines + 1) for _ in range(n + 1)]
    for j in range(1, n + 1):
        for m in range(1, machines + 1):
            best = _stage_time(pc[j], pp[j], m, bandwidth, combine)
            arg = None
            for i in range(1, j):
                comm = 2 * cut_bytes[i - 1] / bandwidth if transfers else 0.0
                c_i, p_i = pc[j] - pc[i], pp[j] - pp[i]
                for mp in range(1, m):
                    prev = A[i][m - mp]
                    t = _stage_time(c_i, p_i, mp, bandwidth, combine)
                    value = prev if prev > t else t
                    if comm > value:
                        value = comm
                    if value < best:
                        best, arg = value, (i, mp)
            A[j][m] = best
            choice[j][m] = arg
    parts, reps = [n], []
    j, m = n, machines
    while choice[j][m] is not None:
        i, mp = choice[j][m]
        reps.append(mp)
        parts.append(i)
        j, m = i, m - mp
    reps.append(m)
    parts.append(0)
    return PipeDreamResult(A[n][machines], parts[::-1], reps[::-1])


def pipedream_plan_time(
    compute, params, cut_bytes, parts, replication, bandwidth, combine="sum", transfers=True
) -> float:
    """The objective PipeDream's recurrence minimizes, for one plan."""
    pc, pp = prefix_sums(compute), prefix_sums(params)
    value = 0.0
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        value = max(value, _stage_time(pc[b] - pc[a], pp[b] - pp[a], replication[s], bandwidth, combine))
        if s and transfers:
            value = max(value, 2 * cut_bytes[a - 1] / bandwidth)
    return value


def pipedream_brute_force(compute, params, cut_bytes, machines, bandwidth, combine="sum", transfers=True) -> float:
    """The best value of :func:`pipedream_plan_time` over every partition and every split of
    ``machines`` into per-stage counts (tests)."""
    n = len(compute)
    best = math.inf
    for k in range(1, min(n, machines) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            parts = [0, *cuts, n]
            for split in itertools.combinations(range(1, machines), k - 1):
                counts = [b - a for a, b in zip((0, *split), (*split, machines))]
                best = min(
                    best, pipedream_plan_time(compute, params, cut_bytes, parts, counts, bandwidth, combine, transfers)
                )
    return best


def pipedream_uniform(
    compute: Sequence[float],
    params: Sequence[float],
    cut_bytes: Sequence[float],
    stages: int,
    replicas: int,
    bandwidth: float,
    p2p_bandwidth: float | None = None,
    combine: str = "sum",
) -> tuple[list[int], float]:
    """PipeDream's recurrence restricted to ``stages`` stages that are each replicated
    ``replicas`` times: A_k(j) = min_i max(A_{k-1}(i), 2 C_i / r, T(i+1 -> j, r)). ``bandwidth``
    is the data-parallel link, ``p2p_bandwidth`` the pipeline link (default the same); the
    transfer is divided by r as in PipeDream's code (r replicas share the minibatch). O(N^2 K)."""
    n = len(compute)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    p2p = p2p_bandwidth or bandwidth
    pc, pp = prefix_sums(compute), prefix_sums(params)
    inf = math.inf
    r = replicas

    def t(a, b):
        return _stage_time(pc[b] - pc[a], pp[b] - pp[a], r, bandwidth, combine)

    prev = [t(0, j) if j else inf for j in range(n + 1)]
    arg = [[0] * (n + 1)]
    for k in range(2, stages + 1):
        cur = [inf] * (n + 1)
        a_k = [0] * (n + 1)
        for j in range(k, n - (stages - k) + 1):
            best, best_i = inf, 0
            for i in range(k - 1, j):
                v = prev[i]
                if v >= best:
                    continue
                comm = 2 * cut_bytes[i - 1] / (p2p * r)
                if comm > v:
                    v = comm
                st = t(i, j)
                if st > v:
                    v = st
                if v < best:
                    best, best_i = v, i
            cur[j], a_k[j] = best, best_i
        prev = cur
        arg.append(a_k)
    parts = [n]
    for k in range(stages - 1, 0, -1):
        parts.append(arg[k][parts[-1]])
    parts.append(0)
    return parts[::-1], prev[n]
