"""Continuous (``steady_state``) schedules: the pipeline stays full across ``train_batch`` calls.
Batch b's ops sit ``period`` steps after batch b-1's on an endless per-stage timeline; a call
runs one window of it, and ``drain`` completes the batches still in flight. Pure Python."""

from __future__ import annotations

from dataclasses import replace

from .ir import COMPUTE_KINDS, OP_INFO, UPDATE_KINDS, CompiledSchedule, Op, OpKind, SEND_KINDS, weight_version
from .placement import after_ops, eval_expr, int_expr, lower_stage, place_compute
from .spec import ComputeRule, ScheduleError, ScheduleSpec


def compile_continuous(
    spec: ScheduleSpec, stages: int, micro_batches: int, resolved: dict, env: dict, source: str
) -> CompiledSchedule:
    """Batch b's ops sit ``period`` steps after batch b-1's on an endless per-stage timeline;
    a call runs one window of it. Lowering (loads, receives, sends) runs on the timeline, so a
    send that follows the last op of a window lands at the start of the next one."""
    name = spec.name
    ss = spec.steady_state
    _check_continuous_spec(spec)
    period = int_expr(ss.period, env, f"schedule {name!r} steady_state.period")
    if period < 1:
        raise ScheduleError(f"schedule {name!r}: steady_state.period = {period}: must be >= 1")

    streams, drains, num_buffers, updates, offsets = [], [], [], [], []
    for s in range(stages):
        stage_env = dict(env, stage=s)
        offset = int_expr(ss.offset, stage_env, f"schedule {name!r} steady_state.offset")
        placed = place_compute(spec, s, env)
        if not placed:
            raise ScheduleError(
                f"schedule {name!r}: stage {s} has no compute ops for {stages} stages x {micro_batches} micro-batches"
            )
        first, last = min(placed), max(placed)
        if first < offset:
            op = placed[first][0]
            raise ScheduleError(
                f"schedule {name!r}: stage {s} places {op.kind.value}(mb={op.micro_batch}) at step "
                f"{first}, before its window starts (steady_state.offset = {offset}): a batch's ops "
                "must not run in an earlier call than its own"
            )
        depth = max(0, (last - offset) // period)  # earlier batches with ops in a call's window
        versioned = [op.version is not None for op, _ in placed.values()]
        if any(versioned) and not all(versioned):
            raise ScheduleError(f"schedule {name!r}: stage {s}: either every compute op declares a version or none")
        timeline, epilogue_at = _continuous_timeline(spec, s, stages, env, placed, period, depth)
        base = (depth + 2) * period
        window = [timeline.get(base + offset + t, []) for t in range(period)]
        u = sum(1 for step in timeline.values() for op in step if op.kind in UPDATE_KINDS and op.batch == 0)
        if any(versioned):
            if u == 0:
                raise ScheduleError(f"schedule {name!r}: stage {s} declares weight versions but never updates")
            window = _weight_ops(window, u, depth, s)
        slots, n = _continuous_buffers(timeline, micro_batches, period, name, s)
        window = [
            [
                replace(op, step=t, buffer=slots[op.micro_batch]) if op.micro_batch is not None else replace(op, step=t)
                for op in step
            ]
            for t, step in enumerate(window)
        ]
        drain: list[list[Op]] = []
        for k in range(depth + 1):
            for step in window:
                drain.append([replace(op, step=len(drain), batch=op.batch + k) for op in step if op.batch + k < 0])
        while drain and not drain[-1]:
            drain.pop()
        streams.append(window)
        drains.append(drain)
        num_buffers.append(n)
        updates.append(u)
        offsets.append(offset)
    length = max(len(d) for d in drains)
    drains = [d + [[] for _ in range(length - len(d))] for d in drains]
    return CompiledSchedule(
        name=name,
        stages=stages,
        micro_batches=micro_batches,
        params=resolved,
        streams=streams,
        num_buffers=num_buffers,
        source=source,
        description=spec.description,
        uses_tied_reduction=False,
        continuous=True,
        drain=drains,
        updates_per_batch=updates,
        period=period,
        offsets=offsets,
    )


def update_times(compiled: CompiledSchedule, stage: int) -> list[tuple[int, int]]:
    """When ``stage`` of a continuous schedule applies each update of a batch, in order: the k-th
    update of batch B happens at timeline step ``B * period + times[k][0]``, in train_batch call
    ``B + times[k][1]``."""
    times = []
    for t, step in enumerate(compiled.streams[stage]):
        for op in step:
            if op.kind in UPDATE_KINDS:
                times.append((compiled.offsets[stage] + t - op.batch * compiled.period, -op.batch))
    return sorted(times)


def sum_lag(compiled: CompiledSchedule, stages) -> int:
    """The fewest updates L >= 1 by which a sum over ``stages`` (e.g. the holders of a tied
    module) must lag so that, at its update u, each stage waits only for contributions the others
    can make without it: every stage's update u - L comes, on every other stage, in the same or an
    earlier train_batch call (a call ends with DeepSpeed's pipeline-wide loss broadcast, which
    the waiting stage would never reach) and at an earlier step of the timeline (a stage blocked at
    step y holds up nothing the others need before y)."""
    stages = sorted(set(stages))
    times = {s: update_times(compiled, s) for s in stages}
    per_batch = {len(t) for t in times.values()}
    if len(per_batch) != 1 or 0 in per_batch:
        raise ScheduleError(
            f"schedule {compiled.name!r}: stages {stages} update {sorted(per_batch)} times a batch; "
            "a sum over them needs the same count on each"
        )
    (u_per_batch,) = per_batch

    def at(s: int, u: int) -> tuple[int, int]:
        """(call, timeline step) of update u of stage s."""
        batch, k = divmod(u, u_per_batch)
        step, call = times[s][k]
        return batch + call, batch * compiled.period + step

    def waits_for_later(x: int, y: int, u: int, lag: int) -> bool:
        (call_x, step_x), (call_y, step_y) = at(x, u - lag), at(y, u)
        return call_x > call_y or step_x >= step_y

    base = 4 * u_per_batch * len(compiled.streams)  # any u far from the start; the pattern repeats per batch
    lag = 1
    while any(waits_for_later(x, y, u, lag) for x in stages for y in stages for u in range(base, base + u_per_batch)):
        lag += 1
    return lag


def _check_continuous_spec(spec: ScheduleSpec) -> None:
    """What a steady state forbids: a prologue, fixed steps, flush-style epilogue ops, split
    backwards, and 'after' ops other than the per-micro-batch all-reduce and update."""
    name = spec.name
    if spec.prologue:
        raise ScheduleError(
            f"schedule {name!r}: prologue is not allowed with steady_state (no call starts "
            "the pipeline afresh); use epilogue or a compute rule's 'after'"
        )
    if spec.steps is not None:
        raise ScheduleError(
            f"schedule {name!r}: steps is not allowed with steady_state (a call is steady_state.period steps)"
        )
    for i, p in enumerate(spec.epilogue):
        if p.at != "stage_end":
            raise ScheduleError(
                f"schedule {name!r} epilogue[{i}] ({p.op}): at: {p.at} is not allowed with "
                "steady_state; a batch's epilogue runs at the stage's end of that batch"
            )
        if "epilogue" not in OP_INFO[p.kind].steady_state:
            raise ScheduleError(
                f"schedule {name!r} epilogue[{i}] ({p.op}): not allowed with steady_state; "
                "allowed: start_allreduce/wait_allreduce (grads), stage_optimizer_step, wait_sends"
            )
    for i, rule in enumerate(spec.compute):
        if "compute" not in OP_INFO[OpKind(rule.op)].steady_state:
            raise ScheduleError(
                f"schedule {name!r} compute[{i}] ({rule.op}): a split backward is not supported "
                "with steady_state (only in flush schedules)"
            )
        for p in rule.after:
            if "after" not in OP_INFO[p.kind].steady_state or p.target == "buffer":
                raise ScheduleError(
                    f"schedule {name!r} compute[{i}].after ({p.op}): not allowed; allowed: "
                    "start_allreduce/wait_allreduce (target grads), stage_optimizer_step"
                )


def _continuous_timeline(spec, s, stages, env, placed, period, depth):
    """Stage s's lowered ops of batches -(depth+2)..1 on one timeline (keys: global step)."""
    base = (depth + 2) * period
    merged: dict[int, tuple[Op, ComputeRule]] = {}
    for b in range(-(depth + 2), 2):
        for x, (op, rule) in placed.items():
            t = base + x + b * period
            if t in merged:
                other = merged[t][0]
                raise ScheduleError(
                    f"schedule {spec.name!r}: stage {s}: steady state puts {op.kind.value}"
                    f"(mb={op.micro_batch}) of one batch and "
                    f"{other.kind.value}(mb={other.micro_batch}) of another in the same step; one "
                    f"compute op per step (period {period} too short?)"
                )
            merged[t] = (replace(op, step=t, batch=b), rule)
    lowered = lower_stage(merged, stages)
    # 'after' ops right after their compute op's step (after its same-step sends)
    for t, (op, rule) in merged.items():
        lowered[t].extend(after_ops(spec, op, rule, env, t))
    # each batch's epilogue right after the stage's last compute op of that batch (its sends,
    # in the next step, do not depend on the weights)
    ends: dict[int, int] = {}
    for t, (op, _) in merged.items():
        ends[op.batch] = max(ends.get(op.batch, t), t)
    stage_env = dict(env, stage=s)
    for b, t in sorted(ends.items()):
        for i, p in enumerate(spec.epilogue):
            if eval_expr(p.when, stage_env, f"schedule {spec.name!r} epilogue[{i}] when"):
                lowered[t].append(Op(p.kind, s, t, target=p.target, batch=b))
    has_isend = any(op.kind in SEND_KINDS and not op.blocking for ops in lowered.values() for op in ops)
    if has_isend:
        raise ScheduleError(f"schedule {spec.name!r}: non-blocking sends are not supported with steady_state")
    return lowered, ends


def _weight_ops(window: list[list[Op]], u: int, depth: int, s: int) -> list[list[Op]]:
    """Add stash_weights before an update whose current version a later op still uses, and
    free_weights after the last use of a stashed version. Versions are relative to the call
    (batch b's version d is b * u + d); the next call sees this call's version v as v - u."""
    flat = [(t, op) for t, step in enumerate(window) for op in step]
    uses = [
        (i, weight_version(op.batch, u, op.version, clamp=False))
        for i, (_, op) in enumerate(flat)
        if op.kind in COMPUTE_KINDS and op.version is not None
    ]
    # updates of earlier batches still to come in this call or later ones
    count = -sum(1 for _, op in flat for k in range(depth + 1) if op.kind in UPDATE_KINDS and op.batch < -k)

    def used_later(i: int, v: int) -> bool:  # by a later op of this call, or by any op of a later call
        return any((j > i and a == v) or (v - a > 0 and (v - a) % u == 0) for j, a in uses)

    out: list[list[Op]] = [[] for _ in window]
    for i, (t, op) in enumerate(flat):
        if op.kind in UPDATE_KINDS:
            if used_later(i, count):
                out[t].append(Op(OpKind.STASH_WEIGHTS, s, t, batch=op.batch, version=count - op.batch * u))
            count += 1
        out[t].append(op)
        if op.kind in COMPUTE_KINDS and op.version is not None:
            v = weight_version(op.batch, u, op.version, clamp=False)
            if v < count and not used_later(i, v):
                out[t].append(Op(OpKind.FREE_WEIGHTS, s, t, batch=op.batch, version=op.version))
    return out


def _continuous_buffers(timeline: dict[int, list[Op]], micro_batches: int, period: int, name: str, s: int):
    """Slot per micro-batch index, the same in every batch: mb % n, conflict-free on the timeline."""
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    for i, op in enumerate(op for t in sorted(timeline) for op in timeline[t]):
        if op.micro_batch is None:
            continue
        key = (op.batch, op.micro_batch)
        first.setdefault(key, i)
        last[key] = i
    events = sorted([(first[k], 1) for k in first] + [(last[k], -1) for k in first], key=lambda e: (e[0], -e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    for n in range(max(2, peak), max(2, peak, micro_batches) + 1):
        holder: dict[int, tuple] = {}
        ok = True
        for key in sorted(first, key=first.get):
            b = key[1] % n
            if b in holder and last[holder[b]] >= first[key]:
                ok = False
                break
            holder[b] = key
        if ok:
            return {m: m % n for m in range(micro_batches)}, n
    raise ScheduleError(
        f"schedule {name!r}: stage {s}: a micro-batch stays in flight longer than a batch "
        f"(steady_state.period = {period} steps): its pipeline buffer would be reused by the same "
        "micro-batch index of the next batch; use more micro-batches"
    )
