"""fp16 under the schedules that never flush (``2bw``, ``pipedream``): one pipeline-wide overflow
decision per update, voted asynchronously (:class:`AsyncVotes`).

Their stages update apart, and a stage's update u can come before another stage has run the
backward that update u applies on that stage (2bw's last stage updates batch t before stage 0 has
run batch t's last backward). A blocking vote at each update would deadlock against the
pipeline's own sends, so the vote is asynchronous and its result is waited for where it is first
needed. The rule, per update u (the u-th update of every stage: batch u for 2bw, micro-batch u of
the run for pipedream):

- **The vote.** At its update op, each rank flags the gradient it is about to apply (its
  data-parallel all-reduced gradient of u: any non-finite value) and starts a MAX all-reduce of the
  flag over the whole job, on a process group of its own (every rank starts votes 0, 1, 2, ... in
  that order, so they pair up whatever runs between them).
- **Held until decided.** A stage whose update op comes, on the schedule's timeline, no earlier
  than every other stage's update u (2bw's and pipedream's stage 0: its backward is the batch's or
  micro-batch's last) waits for the vote there and applies or skips at once. Any other stage keeps
  the gradient aside (a copy: one gradient of the stage) and applies or skips update u just before
  the first op that needs its result: a compute op or ``stash_weights`` of a version after u, or
  its next update op; ``drain()`` (hence ``save_checkpoint``, ``eval_batch``) resolves what is
  still held. Until then the stage's current version is W(u): the compute ops between run on
  versions up to u, as declared.
- **A skipped update is skipped on every stage**, the version counter advances all the same (the
  new version equals the old one), and each rank counts it in ``skipped_steps``.
- **One scale, moved once per batch.** Every rank resolves updates 0, 1, 2, ... in order, each
  through the wrapper's step with the decided flag. The dynamic loss scale moves once per batch, as
  stock's does: at the batch's last update, by whether any of its updates overflowed (2bw: every
  update; pipedream: the M-th, the others' steps leave the scale and its iteration count as they
  are, ``ds.fp16.scale_moves``). Moving it at every micro-batch update would grow it M times as
  fast; without ZeRO the loss is not scaled, nothing overflows and the scale only grows while the
  wrapper divides every gradient by it, so pipedream's gradients sank below Adam's ``eps`` and the
  loss rose (tests/adapter/precision/test_fp16_gpt.py). The same trajectory on every rank, and the scale
  update u unscales by is the one the single-process rule gives it
  (tests/distributed/reference_fp16.py). The LR schedule steps once per ``train_batch`` call, as
  for these schedules in fp32 and bf16 (a skipped update does not hold it back).
- **pipedream without ZeRO: unscaled by 1.** DeepSpeed 0.19's backward does not scale the loss
  for ``FP16_UnfusedOptimizer`` / ``FP16_Optimizer``, yet their step divides the gradient by the
  scale. Stock (and every schedule stepping once per batch, 2bw included) keeps that; a micro-batch
  update's gradient, grad(loss / M), divided by S as well lies M x S below the fp32 rule's, and a
  torch Adam's L2 weight decay, added to it and applied M times a batch, swamped it (|wd p| / |g|
  about 230 on Megatron-DeepSpeed's GPT, whose loss then rose to ln V). So pipedream's
  step divides by 1 (``ds.fp16.unscaled``): the fp32 rule's gradient, rounded to fp16, clipped by its
  own norm; the scale still moves once per batch and only decides skips.

Where a stage waits must not be before another stage's update u on the timeline, nor in an earlier
``train_batch`` call (a call ends with DeepSpeed's pipeline-wide loss broadcast, which the
waiting stage would never reach): :func:`vote_problem` checks it from the compiled schedule
(waits at the same timeline step are allowed: a step's receives and sends come before its compute
op, and an update after it). 2bw passes at every shape (only its stage 0 waits at its update op;
the others hold one gradient each, resolved at their next update op, which comes after stage 0's
on the timeline). pipedream passes at 1 and 2 stages (its stage 1 then waits for stage 0's
backward of micro-batch u before its forward of u + 1: those two no longer overlap) and is refused
at 3 stages or more, with or without ``vertical_sync``: stage 2 would need micro-batch u's
decision (for its forward of u + 1, or with vertical sync for its update u + 1) before stage 0
has run u's backward, or in the call before it does.

A module tied across stages (its tie sum lags L updates, adapter/gradients/tied.py): the flag covers what the
update applies, the lagged sum of update u - L included; a skipped update drops that sum, as the
hippie family drops a deferred stage's buffer.

On ``FP16_UnfusedOptimizer`` (ZeRO stage 0, a torch optimizer) and on ZeRO-1 as written
(``DeepSpeedZeroOptimizer``), whose backward multiplies the loss by the optimizer's current scale
on the last stage, so that every stage's gradient of a micro-batch carries the scale the last
stage had when it ran that micro-batch's backward. With S(j) the scale after decisions 0 .. j - 1
(the same on every rank), the last stage runs update u's backwards having resolved r(u) updates, a
count fixed by the schedule (:func:`loss_scale_updates`: 2bw r(u) = u - 1, the last stage resolving
update u - 1 only after batch u's backwards; pipedream at 2 stages r(u) = u; counted from the
update that starts a fresh pipeline, after a drain or a checkpoint load): so at its update op
each stage multiplies its gradient by S(u) / S(r(u)) (a power of two: exact unless it overflows)
before it flags it, and every gradient of update u enters the vote and the step carrying S(u), as
in a single-process rule that computes the update with the scale of its step. A schedule whose
last stage would run one update's backwards under two scales is refused. A module tied across
stages: the lagged tie sum of update u - L, started at that update with the scale its gradients
carried, S(r(u - L)), is multiplied by S(u) / S(r(u - L)) when update u applies it (each update's
carried scale is kept until its sum is applied; a drain brings the sums still in flight to the scale
it leaves, which a checkpoint saved then holds), and the tied part and the rest are then clipped
apart as their unscaled values would be (``max_norm`` clip x S(u)).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from deepspeed import comm as dist
from torch._utils import _unflatten_dense_tensors

from ...schedules.ir import (
    COMPUTE_KINDS,
    UPDATE_KINDS,
    WEIGHT_GRAD_KINDS,
    WEIGHT_KINDS,
    CompiledSchedule,
    weight_version,
)
from ..ds import fp16 as ds_fp16
from ..module.tensor_calls import flat_copy


def _timeline(compiled: CompiledSchedule, stage: int, calls: int) -> list[tuple[int, int, str, int]]:
    """Stage ``stage``'s update and version-using ops over ``calls`` calls from a fresh pipeline:
    (timeline step, call, "update" with its index u | "use" with the absolute version | "backward"
    with the update that applies its gradient, the stage's next)."""
    period, per_batch = compiled.period, compiled.updates_per_batch[stage]
    out, count = [], 0
    for call in range(calls):
        for t, ops in enumerate(compiled.streams[stage]):
            for op in ops:
                batch = call + op.batch
                if batch < 0:  # filling: the engine skips it
                    continue
                at = call * period + compiled.offsets[stage] + t
                if op.kind in UPDATE_KINDS:
                    out.append((at, call, "update", count))
                    count += 1
                elif op.version is not None and op.kind in COMPUTE_KINDS | WEIGHT_KINDS:  # free: older ones
                    out.append((at, call, "use", weight_version(batch, per_batch, op.version)))
                if op.kind in WEIGHT_GRAD_KINDS:
                    out.append((at, call, "backward", count))
    return out


def vote_points(compiled: CompiledSchedule, calls: int = 6) -> dict[int, dict[int, tuple]]:
    """Per stage, per update u: ((step, call) of its update op, (step, call) of the first op that
    needs its result: a use of a version after u, or update u + 1; None past the simulated calls)."""
    points = {}
    for s in range(compiled.stages):
        events = _timeline(compiled, s, calls)
        per = {}
        for i, (at, call, kind, u) in enumerate(events):
            if kind != "update":
                continue
            need = next(
                ((a, c) for a, c, k, x in events[i + 1 :] if (k == "use" and x > u) or (k == "update" and x == u + 1)),
                None,
            )
            per[u] = ((at, call), need)
        points[s] = per
    return points


def _not_after(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """(step, call) ``a`` is no later than ``b`` on the timeline and in no later call."""
    return a[0] <= b[0] and a[1] <= b[1]


def waits_at_update(compiled: CompiledSchedule, stage: int) -> bool:
    """True when ``stage``'s update u comes no earlier than every stage's update u (timeline and
    call): it waits for the vote at its update op and holds nothing."""
    points = vote_points(compiled)
    common = set.intersection(*(set(p) for p in points.values()))
    return all(_not_after(points[o][u][0], points[stage][u][0]) for u in common for o in points)


def vote_problem(compiled: CompiledSchedule) -> str | None:
    """None when every stage can learn each update's decision before it needs it without waiting
    for a contribution made later (module docstring); else why not, in words."""
    points = vote_points(compiled)
    common = set.intersection(*(set(p) for p in points.values()))
    for u in sorted(common):
        for s, per in points.items():
            need = per[u][1]
            if need is None:
                continue
            for o in points:
                made = points[o][u][0]
                if not _not_after(made, need):
                    when = "in a later train_batch call" if made[1] > need[1] else "later on the timeline"
                    return (
                        f"stage {s} needs the overflow decision of update {u} (its next weights) at timeline "
                        f"step {need[0]}, but stage {o} flags that update at step {made[0]}, {when}"
                    )
    return None


def loss_scale_updates(compiled: CompiledSchedule, calls: int = 6) -> tuple[list[int], int] | str:
    """From a fresh pipeline: (r(u) for the first updates, the lag d with r(u) = u - d after them):
    how many updates the last stage (which scales the loss) has resolved when it runs the backwards
    update u applies. A string (why) where one update's backwards would see two counts."""
    s = compiled.stages - 1
    events = _timeline(compiled, s, calls)
    immediate = waits_at_update(compiled, s)
    resolved_at = {}  # update v -> index of the event before which (immediate: at which, after its backward) it is
    for i, (_, _, kind, u) in enumerate(events):
        if kind != "update":
            continue
        if immediate:
            resolved_at[u] = i
            continue
        for j in range(i + 1, len(events)):
            k, x = events[j][2], events[j][3]
            if (k == "use" and x > u) or (k == "update" and x == u + 1):
                resolved_at[u] = j
                break
    last = max(resolved_at, default=-1)  # past it the simulated calls end
    counts: dict[int, set[int]] = {}
    for i, (_, _, kind, u) in enumerate(events):
        if kind == "backward" and u <= last:
            counts.setdefault(u, set()).add(sum(1 for at in resolved_at.values() if at < i))
    for u, seen in counts.items():
        if len(seen) > 1:
            return (
                f"the last stage would run the backwards of update {u} under {len(seen)} loss scales (after "
                f"{sorted(seen)} decisions)"
            )
    table = [counts[u].pop() for u in sorted(counts)]
    lag = len(table) - 1 - table[-1]
    return table, lag


class AsyncVotes:
    """One stage's fp16 updates under a schedule that never flushes (module docstring). ``apply(overflow,
    lrs)`` takes the update whose gradient is in place (the engine's versioned per-stage step);
    ``device``: where the vote's flag lives; ``optimizer``: the fp16 wrapper whose scale moves;
    ``on_skip()``: an update was skipped (the engine counts it as DeepSpeed's ``skipped_steps``)."""

    def __init__(
        self,
        device,
        optimizer,
        on_skip,
        store,
        apply,
        immediate: bool,
        current,
        carried=None,
        per_batch: int = 1,
        ties=None,
    ):
        self._device, self._optimizer, self._on_skip = device, optimizer, on_skip
        # micro-batch updates without ZeRO: the loss is not scaled, so the step unscales by 1 (module docstring)
        self._by_one = carried is None and per_batch > 1
        # ZeRO-1 with a module tied across stages: (tied.LaggedTieSums, clip); the scale each update's gradient
        # carried at its backwards (the tie sum of update v is applied at v + lag, rescaled from it)
        self._ties = ties if carried is not None else None
        self._carries: dict[int, float] = {}
        self._per_batch = per_batch  # updates per batch: the loss scale moves once per batch (module docstring)
        self._batch_overflow = False  # any of the running batch's updates skipped so far
        self._store = store
        self._apply = apply
        self._current = current  # () -> the stage's current weight version
        self.immediate = immediate
        # ZeRO-1 (the loss scaled): loss_scale_updates' (table, lag); the scale after each decision, from the
        # update that started the running fill of the pipeline (None: a fresh one starts at the next update)
        self._carried = carried
        self._scales: dict[int, float] | None = None
        self._fill = 0
        world = dist.get_world_size()
        self._group = dist.new_group(ranks=list(range(world)))  # votes only: they pair up in order
        self._held: collections.deque = collections.deque()  # (work, flag, flat gradient, lrs), oldest first

    @torch.no_grad()
    def update(self, lrs) -> None:
        """The stage's update op: vote on the gradient in place; apply or skip it now
        (``immediate``), else keep it aside until it is needed."""
        self.resolve_all()  # an earlier update still held (none where vote_problem passes)
        params = self._store.params
        grads = self._store.of(params)
        self._to_update_scale(params, grads)
        local = any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if local else 0.0], device=self._device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if self.immediate:
            work.wait()
            self._decided(bool(flag.item()), lrs)
            return
        held = flat_copy(grads)
        for p in params:
            p.grad = None  # the next backwards accumulate afresh
        self._held.append((work, flag, held, lrs))

    def before_use(self, version: int) -> None:
        """Before an op that uses weight ``version`` (a compute op, ``stash_weights``): the held
        updates that make it, decided and applied."""
        while self._held and version > self._current():
            self._resolve_one()

    def resolve_all(self) -> None:
        while self._held:
            self._resolve_one()

    def drained(self) -> None:
        """Everything resolved and nothing in flight: the next update starts a fresh pipeline. ZeRO-1
        with a tied module: the tie sums still to apply are brought to the scale now (the one the
        next fill starts from, and a checkpoint saved now holds)."""
        self.resolve_all()
        if self._ties is not None and self._scales is not None:
            sums, now = self._ties[0], self._store.loss_scale
            first = self._current() - sums.in_flight
            sums.rescale_pending(
                [now / self._carries.get(v, self._scales[self._fill]) for v in range(first, self._current())]
            )
        self._scales, self._carries = None, {}

    def _to_update_scale(self, params, grads) -> None:
        """ZeRO-1: ``grads`` of update u carry S(r(u)), the last stage's scale at their backwards;
        multiplied to S(u), the scale of the update's step (module docstring). A tied module's lagged
        sum of update u - L carries S(r(u - L)): multiplied from that; then clipped apart at S(u)."""
        if self._carried is None or self._store.loss_scale is None:
            return
        u = self._current() + len(self._held)
        if self._scales is None or u not in self._scales:  # a fresh pipeline (or a checkpoint loaded)
            self._fill, self._scales = u, {u: self._store.loss_scale}
        table, lag = self._carried
        k = u - self._fill
        made = self._fill + (table[k] if k < len(table) else k - lag)
        now, carried = self._scales[u], self._scales[made]
        tied, lagged = set(), carried
        if self._ties is not None:
            sums, clip = self._ties
            tied = {id(w) for w in sums.weights}
            lagged = self._carries.get(u - sums.lag, self._scales[self._fill])  # before the fill: the drain's scale
            self._carries = {v: c for v, c in self._carries.items() if v > u - sums.lag}
            self._carries[u] = carried
        for p, g in zip(params, grads):
            factor = now / (lagged if id(p) in tied else carried)
            if factor != 1.0:
                g.mul_(factor)
        if self._ties is not None and self._ties[1] > 0:
            self._ties[0].clip_apart(self._ties[1], now)

    @torch.no_grad()
    def _resolve_one(self) -> None:
        work, flag, held, lrs = self._held.popleft()
        work.wait()
        params = self._store.params
        accumulating = [p.grad for p in params]  # the next batch's backwards so far
        for p, g in zip(params, _unflatten_dense_tensors(held, params)):
            p.grad = g
        try:
            self._decided(bool(flag.item()), lrs)
        finally:
            for p, g in zip(params, accumulating):
                p.grad = g

    def _decided(self, overflow: bool, lrs) -> None:
        if self._per_batch == 1:
            self._apply(overflow, lrs)
        else:  # the batch's last update moves the scale once, by whether any of its updates overflowed
            self._batch_overflow = self._batch_overflow or overflow
            last = (self._current() + 1) % self._per_batch == 0
            with (
                ds_fp16.scale_moves(self._optimizer, self._batch_overflow if last else None),
                ds_fp16.unscaled(self._optimizer) if self._by_one else contextlib.nullcontext(),
            ):
                self._apply(overflow, lrs)
            if last:
                self._batch_overflow = False
        if self._scales is not None:
            self._scales[self._current()] = self._store.loss_scale  # S(j): after decisions 0 .. j - 1
        if overflow:  # the continuous step keeps the counters still; a skipped update counts, as stock's
            self._on_skip()


class InPlaceUpdates:
    """A continuous schedule's per-stage updates where no vote is needed (fp32, bf16): each applied at
    its op. :class:`AsyncVotes`' interface."""

    def __init__(self, apply):
        self._apply = apply

    def update(self, lrs) -> None:
        self._apply(None, lrs)

    def before_use(self, version: int) -> None:
        pass

    def drained(self) -> None:
        pass


def continuous_updates(
    compiled: CompiledSchedule, stage: int, versions, stage_step, gradients, device, optimizer, on_skip
):
    """The engine's per-stage updates of a continuous schedule: :class:`AsyncVotes` in fp16 (the
    refusals the engine makes as it is built included), else :class:`InPlaceUpdates`. Each update
    steps on the current weight version (``versions``: WeightVersions) by ``stage_step`` (StageStep),
    the counters kept still, at its batch's learning rates. ``gradients``: the stage's
    StageGradients; ``device``, ``optimizer``, ``on_skip``: :class:`AsyncVotes`'."""

    def apply(overflow, lrs):
        versions.update(lambda: stage_step.step(counters=False, lrs=lrs, overflow=overflow))

    if not (compiled.continuous and stage_step.fp16 is not None):
        return InPlaceUpdates(apply)
    store = gradients.store
    carried = loss_scale_updates(compiled) if store.loss_scale is not None else None
    if isinstance(carried, str):
        raise ValueError(f"schedule {compiled.name!r} in fp16 + ZeRO-1: {carried}; use fp16 without ZeRO")
    ties = gradients.lagged_ties if carried is not None else None
    gradients.clip_at_update = ties is not None  # clipped apart at S(u) by AsyncVotes
    return AsyncVotes(
        device,
        optimizer,
        on_skip,
        store,
        apply,
        waits_at_update(compiled, stage),
        lambda: versions.count,
        carried,
        compiled.updates_per_batch[stage],
        ties,
    )
