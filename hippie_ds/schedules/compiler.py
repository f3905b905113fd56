"""Lower a schedule declaration to per-stage streams of ops (the IR). Pure Python.

Passes, in order:
1. resolve parameters and check the schedule's requirements;
2. place every stage's compute ops at their declared steps;
3. add the loads (first and last stage, before each forward), receives (in the op's step) and
   sends (in the next step, or the same one), ordered as DeepSpeed's TrainSchedule orders them:
   in a step whose op consumes an activation, send the previous result first, then receive;
   in a backward step, receive first, then send (this pairs neighbours in 1F1B without
   deadlock under blocking p2p);
4. add prologue / epilogue ops and WAIT_SENDS after a stage's last non-blocking send;
5. allocate pipeline buffer slots from micro-batch lifetimes (cyclic ``mb % n`` when it is
   conflict-free, as DeepSpeed does, else interval colouring), n >= 2 like DeepSpeed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from .expr import ExpressionError
from .ir import COMPUTE_KINDS, INPUT_GRAD_KINDS, UPDATE_KINDS, CompiledSchedule, Op, OpKind, SEND_KINDS
from .spec import ComputeRule, ScheduleError, ScheduleSpec

_FORWARD_LIKE = (OpKind.FORWARD, OpKind.FORWARD_BACKWARD)


def _check_counts(stages: Any, micro_batches: Any) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} = {value!r}: must be an integer >= 1")


def resolve_params(spec: ScheduleSpec, stages: int, micro_batches: int, given: Mapping[str, Any]) -> dict:
    """Declared defaults overlaid with ``given``, type- and range-checked; 'auto' lists resolved
    with the declaration's no-cost rule (cost-based choice: ``simulator.resolve_auto_params``)."""
    unknown = set(given) - set(spec.params)
    if unknown:
        allowed = ", ".join(sorted(spec.params)) or "none"
        raise ScheduleError(f"schedule {spec.name!r} has no parameter {', '.join(sorted(unknown))}; "
                            f"its parameters: {allowed}")
    env = {"stages": stages, "micro_batches": micro_batches}
    out: dict[str, Any] = {}
    for name, p in spec.params.items():
        value = given.get(name, p.default)
        if value is None:
            value = p.default
        if p.kind == "stage_list":
            if value == "auto":
                if p.auto is None:
                    raise ScheduleError(f"parameter {name}: 'auto' is not supported by schedule {spec.name!r}")
                value = _eval(p.auto, env, f"params.{name}.auto")
            if isinstance(value, str):  # "0,1" from a command line
                try:
                    value = [int(v) for v in value.split(",") if v.strip()]
                except ValueError:
                    raise ScheduleError(f"parameter {name} = {value!r}: expected 'auto' or a list of stage "
                                        f"indices in 0..{stages - 1}") from None
            try:
                value = sorted({int(v) for v in value})
            except (TypeError, ValueError):
                raise ScheduleError(f"parameter {name} = {value!r}: expected 'auto' or a list of stage "
                                    f"indices in 0..{stages - 1}") from None
            bad = [v for v in value if not 0 <= v < stages]
            if bad:
                raise ScheduleError(f"parameter {name} = {value}: stage(s) {bad} out of range; "
                                    f"allowed 0..{stages - 1} for {stages} stages")
        elif p.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ScheduleError(f"parameter {name} = {value!r}: expected an integer")
        elif p.kind == "bool":
            if not isinstance(value, bool):
                raise ScheduleError(f"parameter {name} = {value!r}: expected true or false")
        out[name] = value
    return out


def _eval(expr, env: Mapping[str, Any], where: str):
    try:
        return expr.evaluate(env)
    except ExpressionError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise ScheduleError(f"{where}: expression {expr.source!r} failed: {exc}") from None


def _int(expr, env, where) -> int:
    value = _eval(expr, env, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{where}: expression {expr.source!r} gave {value!r}, expected an integer")
    return value


def _place_compute(spec: ScheduleSpec, stage: int, env: dict) -> dict[int, tuple[Op, ComputeRule]]:
    placed: dict[int, tuple[Op, ComputeRule]] = {}
    for i, rule in enumerate(spec.compute):
        where = f"schedule {spec.name!r} compute[{i}] ({rule.op})"
        for mb in range(env["micro_batches"]):
            local = dict(env, stage=stage, mb=mb)
            if not _eval(rule.when, local, where + " when"):
                continue
            step = _int(rule.at, local, where + " at")
            if step < 0:
                raise ScheduleError(f"{where}: stage {stage} micro-batch {mb} placed at step {step} < 0")
            if step in placed:
                other = placed[step][0]
                raise ScheduleError(f"{where}: stage {stage} step {step}: {rule.op}(mb={mb}) collides with "
                                    f"{other.kind.value}(mb={other.micro_batch}); one compute op per step")
            version = None if rule.version is None else _int(rule.version, local, where + " version")
            placed[step] = (Op(OpKind(rule.op), stage, step, mb, version=version), rule)
    return placed


def _sends_of(op: Op, rule: ComputeRule, stages: int, step: int) -> list[Op]:
    """The send carrying ``op``'s result to its neighbour, if it has one."""
    s = op.stage
    if op.kind == OpKind.FORWARD and s < stages - 1:
        kind = OpKind.SEND_ACTIVATION
    elif op.kind in INPUT_GRAD_KINDS and s > 0:
        kind = OpKind.SEND_GRAD
    else:
        return []
    return [Op(kind, s, step, op.micro_batch, blocking=rule.send.blocking, batch=op.batch)]


def _recvs_of(op: Op, stages: int) -> list[Op]:
    s = op.stage
    if op.kind in _FORWARD_LIKE and s > 0:
        return [Op(OpKind.RECV_ACTIVATION, s, op.step, op.micro_batch, batch=op.batch)]
    if op.kind in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT) and s < stages - 1:
        return [Op(OpKind.RECV_GRAD, s, op.step, op.micro_batch, batch=op.batch)]
    return []


def _lower_stage(placed: dict[int, tuple[Op, ComputeRule]], stages: int) -> dict[int, list[Op]]:
    """Steps (sparse) of compute with loads, receives and sends added."""
    steps: dict[int, list[Op]] = {}
    last = max(placed)
    for t in range(last + 2):
        cur = placed.get(t)
        prev = placed.get(t - 1)
        prev_sends = _sends_of(prev[0], prev[1], stages, t) if prev and prev[1].send.when == "next_step" else []
        ops: list[Op] = []
        if cur:
            op, rule = cur
            recvs = _recvs_of(op, stages)
            ops += prev_sends + recvs if op.kind in _FORWARD_LIKE else recvs + prev_sends
            if op.kind in _FORWARD_LIKE and op.stage in (0, stages - 1):
                ops.append(Op(OpKind.LOAD, op.stage, t, op.micro_batch, batch=op.batch))
            ops.append(op)
            if rule.send.when == "same_step":
                ops += _sends_of(op, rule, stages, t)
        else:
            ops += prev_sends
        if ops:
            steps[t] = ops
    return steps


def _allocate_buffers(ops: list[Op]) -> tuple[dict[int, int], int]:
    """Map micro-batch -> buffer slot. A micro-batch occupies its slot from its first buffer op
    to its last one; a non-blocking send releases it at issue (the engine keeps the tensor)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.micro_batch is None:
            continue
        first.setdefault(op.micro_batch, i)
        last[op.micro_batch] = i
    order = sorted(first, key=first.get)
    events = sorted([(first[m], 1) for m in order] + [(last[m], -1) for m in order], key=lambda e: (e[0], -e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    n = max(2, peak)

    def conflicts(assign: dict[int, int]) -> bool:
        holder: dict[int, int] = {}
        for m in order:
            b = assign[m]
            if b in holder and last[holder[b]] >= first[m]:
                return True
            holder[b] = m
        return False

    cyclic = {m: m % n for m in order}
    if not conflicts(cyclic):
        return cyclic, n
    # Interval-graph colouring by start time is optimal: uses exactly `peak` slots.
    free_at: list[int] = []  # slot -> index after which it is free
    assign: dict[int, int] = {}
    for m in order:
        slot = next((b for b, t in enumerate(free_at) if t < first[m]), None)
        if slot is None:
            slot = len(free_at)
            free_at.append(-1)
        assign[m] = slot
        free_at[slot] = last[m]
    return assign, n


def compile_schedule(spec: ScheduleSpec, stages: int, micro_batches: int, params: Mapping[str, Any] | None = None,
                     source: str = "") -> CompiledSchedule:
    """Compile ``spec`` for ``stages`` x ``micro_batches``; raises ScheduleError naming the problem."""
    _check_counts(stages, micro_batches)
    resolved = resolve_params(spec, stages, micro_batches, params or {})
    env = {"stages": stages, "micro_batches": micro_batches, **resolved}
    for req in spec.requires:
        if not _eval(req.check, env, f"schedule {spec.name!r} requires"):
            raise ScheduleError(f"schedule {spec.name!r} cannot run {stages} stages x {micro_batches} micro-batches "
                                f"with {resolved}: {req.message} ({req.check.source})")
    if spec.steady_state is not None:
        return _compile_continuous(spec, stages, micro_batches, resolved, env, source)
    for i, rule in enumerate(spec.compute):
        if rule.version is not None or rule.after:
            key = "version" if rule.version is not None else "after"
            raise ScheduleError(f"schedule {spec.name!r} compute[{i}].{key}: only allowed in schedules with "
                                "steady_state (a flush schedule updates once, after every backward)")

    sparse = []
    for s in range(stages):
        placed = _place_compute(spec, s, env)
        if not placed:
            raise ScheduleError(f"schedule {spec.name!r}: stage {s} has no compute ops for "
                                f"{stages} stages x {micro_batches} micro-batches")
        sparse.append(_lower_stage(placed, stages))

    needed = max(max(steps) + 1 for steps in sparse)
    if spec.steps is not None:
        num_steps = _int(spec.steps, env, f"schedule {spec.name!r} steps")
        if num_steps < needed:
            raise ScheduleError(f"schedule {spec.name!r}: steps = {num_steps} but ops are placed up to step "
                                f"{needed - 1}; steps must be at least {needed}")
    else:
        num_steps = needed

    streams: list[list[list[Op]]] = []
    num_buffers: list[int] = []
    for s in range(stages):
        steps = [list(sparse[s].get(t, [])) for t in range(num_steps)]
        stage_env = dict(env, stage=s)
        stage_end = max(sparse[s])
        has_isend = any(op.kind in SEND_KINDS and not op.blocking for step in steps for op in step)
        if has_isend:
            steps[stage_end].append(Op(OpKind.WAIT_SENDS, s, stage_end))
        steps[0][:0] = [Op(p.kind, s, 0, target=p.target) for i, p in enumerate(spec.prologue)
                        if _eval(p.when, stage_env, f"schedule {spec.name!r} prologue[{i}] when")]
        for i, placed_op in enumerate(spec.epilogue):
            if _eval(placed_op.when, stage_env, f"schedule {spec.name!r} epilogue[{i}] when"):
                t = num_steps - 1 if placed_op.at == "end" else stage_end
                steps[t].append(Op(placed_op.kind, s, t, target=placed_op.target))
        flat = [op for step in steps for op in step]
        assign, n = _allocate_buffers(flat)
        steps = [[replace(op, buffer=assign[op.micro_batch]) if op.micro_batch is not None else op for op in step]
                 for step in steps]
        streams.append(steps)
        num_buffers.append(n)

    return CompiledSchedule(name=spec.name, stages=stages, micro_batches=micro_batches, params=resolved,
                            streams=streams, num_buffers=num_buffers, source=source, description=spec.description,
                            uses_tied_reduction=any(p.kind == OpKind.REDUCE_TIED_GRADS for p in spec.epilogue))


# ---------------------------------------------------------------------------------------------
# Continuous schedules (``steady_state``): the pipeline stays full across train_batch calls.

def _compile_continuous(spec: ScheduleSpec, stages: int, micro_batches: int, resolved: dict, env: dict,
                        source: str) -> CompiledSchedule:
    """Batch b's ops sit ``period`` steps after batch b-1's on an endless per-stage timeline;
    a call runs one window of it. Lowering (loads, receives, sends) runs on the timeline, so a
    send that follows the last op of a window lands at the start of the next one."""
    name = spec.name
    ss = spec.steady_state
    if spec.prologue:
        raise ScheduleError(f"schedule {name!r}: prologue is not allowed with steady_state (no call starts "
                            "the pipeline afresh); use epilogue or a compute rule's 'after'")
    if spec.steps is not None:
        raise ScheduleError(f"schedule {name!r}: steps is not allowed with steady_state (a call is "
                            "steady_state.period steps)")
    for i, p in enumerate(spec.epilogue):
        if p.at != "stage_end":
            raise ScheduleError(f"schedule {name!r} epilogue[{i}] ({p.op}): at: {p.at} is not allowed with "
                                "steady_state; a batch's epilogue runs at the stage's end of that batch")
        if p.kind in (OpKind.OPTIMIZER_STEP, OpKind.REDUCE_TIED_GRADS, OpKind.APPLY_BUFFERED_UPDATE,
                      OpKind.COPY_GRADS_TO_BUFFER, OpKind.REDUCE_GRADS):
            raise ScheduleError(f"schedule {name!r} epilogue[{i}] ({p.op}): not allowed with steady_state; "
                                "allowed: start_allreduce/wait_allreduce (grads), stage_optimizer_step, wait_sends")
    for i, rule in enumerate(spec.compute):
        if rule.op in (OpKind.BACKWARD_INPUT.value, OpKind.BACKWARD_WEIGHT.value):
            raise ScheduleError(f"schedule {name!r} compute[{i}] ({rule.op}): a split backward is not supported "
                                "with steady_state (only in flush schedules)")
        for p in rule.after:
            if p.kind not in (OpKind.START_ALLREDUCE, OpKind.WAIT_ALLREDUCE, OpKind.STAGE_OPTIMIZER_STEP) or \
                    p.target == "buffer":
                raise ScheduleError(f"schedule {name!r} compute[{i}].after ({p.op}): not allowed; allowed: "
                                    "start_allreduce/wait_allreduce (target grads), stage_optimizer_step")
    period = _int(ss.period, env, f"schedule {name!r} steady_state.period")
    if period < 1:
        raise ScheduleError(f"schedule {name!r}: steady_state.period = {period}: must be >= 1")

    streams, drains, num_buffers, updates = [], [], [], []
    for s in range(stages):
        stage_env = dict(env, stage=s)
        offset = _int(ss.offset, stage_env, f"schedule {name!r} steady_state.offset")
        placed = _place_compute(spec, s, env)
        if not placed:
            raise ScheduleError(f"schedule {name!r}: stage {s} has no compute ops for "
                                f"{stages} stages x {micro_batches} micro-batches")
        first, last = min(placed), max(placed)
        if first < offset:
            op = placed[first][0]
            raise ScheduleError(f"schedule {name!r}: stage {s} places {op.kind.value}(mb={op.micro_batch}) at step "
                                f"{first}, before its window starts (steady_state.offset = {offset}): a batch's ops "
                                "must not run in an earlier call than its own")
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
        window = [[replace(op, step=t, buffer=slots[op.micro_batch]) if op.micro_batch is not None
                   else replace(op, step=t) for op in step] for t, step in enumerate(window)]
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
    length = max(len(d) for d in drains)
    drains = [d + [[] for _ in range(length - len(d))] for d in drains]
    return CompiledSchedule(name=name, stages=stages, micro_batches=micro_batches, params=resolved, streams=streams,
                            num_buffers=num_buffers, source=source, description=spec.description,
                            uses_tied_reduction=False, continuous=True, drain=drains, updates_per_batch=updates,
                            period=period)


def _continuous_timeline(spec, s, stages, env, placed, period, depth):
    """Stage s's lowered ops of batches -(depth+2)..1 on one timeline (keys: global step)."""
    base = (depth + 2) * period
    merged: dict[int, tuple[Op, ComputeRule]] = {}
    for b in range(-(depth + 2), 2):
        for x, (op, rule) in placed.items():
            t = base + x + b * period
            if t in merged:
                other = merged[t][0]
                raise ScheduleError(f"schedule {spec.name!r}: stage {s}: steady state puts {op.kind.value}"
                                    f"(mb={op.micro_batch}) of one batch and {other.kind.value}(mb={other.micro_batch}) "
                                    f"of another in the same step; one compute op per step (period "
                                    f"{period} too short?)")
            merged[t] = (replace(op, step=t, batch=b), rule)
    lowered = _lower_stage(merged, stages)
    # 'after' ops right after their compute op's step (after its same-step sends)
    for t, (op, rule) in merged.items():
        lowered[t].extend(Op(p.kind, s, t, target=p.target, batch=op.batch) for p in rule.after
                          if _eval(p.when, dict(env, stage=s), f"schedule {spec.name!r} compute after when"))
    # each batch's epilogue right after the stage's last compute op of that batch (its sends,
    # in the next step, do not depend on the weights)
    ends: dict[int, int] = {}
    for t, (op, _) in merged.items():
        ends[op.batch] = max(ends.get(op.batch, t), t)
    stage_env = dict(env, stage=s)
    for b, t in sorted(ends.items()):
        for i, p in enumerate(spec.epilogue):
            if _eval(p.when, stage_env, f"schedule {spec.name!r} epilogue[{i}] when"):
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
    uses = [(i, op.batch * u + op.version) for i, (_, op) in enumerate(flat)
            if op.kind in COMPUTE_KINDS and op.version is not None]
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
            v = op.batch * u + op.version
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
    raise ScheduleError(f"schedule {name!r}: stage {s}: a micro-batch stays in flight longer than a batch "
                        f"(steady_state.period = {period} steps): its pipeline buffer would be reused by the same "
                        "micro-batch index of the next batch; use more micro-batches")
