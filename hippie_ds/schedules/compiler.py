"""Lower a schedule declaration to per-stage streams of ops (the IR). Pure Python.

Passes, in order (2 and 3 in :mod:`.placement`; continuous schedules in :mod:`.continuous`):
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

from .continuous import compile_continuous
from .ir import OP_INFO, CompiledSchedule, Op, OpKind, SEND_KINDS
from .layout import Layout
from .placement import after_ops, eval_expr as _eval, int_expr as _int, lower_stage, place_compute
from .spec import ScheduleError, ScheduleSpec


def _check_counts(stages: Any, micro_batches: Any) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} = {value!r}: must be an integer >= 1")


def resolve_params(spec: ScheduleSpec, stages: int, micro_batches: int, given: Mapping[str, Any]) -> dict:
    """Declared defaults overlaid with ``given``, type- and range-checked; 'auto' lists resolved
    with the declaration's no-cost rule (cost-based choice: ``auto_params.resolve_auto_params``)."""
    unknown = set(given) - set(spec.params)
    if unknown:
        allowed = ", ".join(sorted(spec.params)) or "none"
        raise ScheduleError(
            f"schedule {spec.name!r} has no parameter {', '.join(sorted(unknown))}; its parameters: {allowed}"
        )
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
                    raise ScheduleError(
                        f"parameter {name} = {value!r}: expected 'auto' or a list of stage indices in 0..{stages - 1}"
                    ) from None
            try:
                value = sorted({int(v) for v in value})
            except (TypeError, ValueError):
                raise ScheduleError(
                    f"parameter {name} = {value!r}: expected 'auto' or a list of stage indices in 0..{stages - 1}"
                ) from None
            bad = [v for v in value if not 0 <= v < stages]
            if bad:
                raise ScheduleError(
                    f"parameter {name} = {value}: stage(s) {bad} out of range; "
                    f"allowed 0..{stages - 1} for {stages} stages"
                )
        elif p.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ScheduleError(f"parameter {name} = {value!r}: expected an integer")
        elif p.kind == "bool":
            if not isinstance(value, bool):
                raise ScheduleError(f"parameter {name} = {value!r}: expected true or false")
        out[name] = value
    return out


def _allocate_buffers(ops: list[Op]) -> tuple[dict[tuple[int, int], int], int]:
    """Map (chunk, micro-batch) -> buffer slot. A micro-batch occupies its slot from its first
    buffer op to its last one; a non-blocking send releases it at issue (the engine keeps the tensor)."""
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for i, op in enumerate(ops):
        if op.micro_batch is None:
            continue
        first.setdefault((op.chunk, op.micro_batch), i)
        last[(op.chunk, op.micro_batch)] = i
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

    index = {key: i for i, key in enumerate(sorted(first))}  # one chunk: the micro-batch, as DeepSpeed
    cyclic = {m: index[m] % n for m in order}
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


def resolve_virtual_stages(spec: ScheduleSpec, stages: int, micro_batches: int, given: Any = None) -> int:
    """The chunks per stage: ``given`` (the job's ``pipeline.virtual_stages``) or the schedule's own."""
    declared = spec.virtual_stages
    if given is None:
        if declared is None:
            return 1
        given = _int(
            declared, {"stages": stages, "micro_batches": micro_batches}, f"schedule {spec.name!r} virtual_stages"
        )
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ScheduleError(f"virtual_stages = {given!r}: must be an integer >= 1")
    if given > 1 and declared is None:
        raise ScheduleError(
            f"virtual_stages = {given}: schedule {spec.name!r} runs one model chunk per stage; "
            "schedules with virtual stages declare virtual_stages (e.g. interleaved-1f1b)"
        )
    if spec.layout == "v" and given != 2:
        raise ScheduleError(
            f"virtual_stages = {given}: schedule {spec.name!r} has the V-shape layout, "
            "which holds exactly 2 chunks per stage"
        )
    return given


def compile_schedule(
    spec: ScheduleSpec,
    stages: int,
    micro_batches: int,
    params: Mapping[str, Any] | None = None,
    source: str = "",
    virtual_stages: int | None = None,
) -> CompiledSchedule:
    """Compile ``spec`` for ``stages`` x ``micro_batches`` (x ``virtual_stages`` chunks per stage,
    default the schedule's); raises ScheduleError naming the problem."""
    _check_counts(stages, micro_batches)
    resolved = resolve_params(spec, stages, micro_batches, params or {})
    v = resolve_virtual_stages(spec, stages, micro_batches, virtual_stages)
    layout = Layout(spec.layout, stages, v)
    env = {"stages": stages, "micro_batches": micro_batches, "virtual_stages": v, **resolved}
    for req in spec.requires:
        if not _eval(req.check, env, f"schedule {spec.name!r} requires"):
            given = ", ".join(f"{k}={v!r}" for k, v in resolved.items())
            chunks = f", {v} model chunks per stage" if v > 1 else ""
            raise ScheduleError(
                f"schedule {spec.name!r} cannot run {stages} stages x {micro_batches} "
                f"micro-batch{'es' if micro_batches != 1 else ''}{chunks}"
                f"{f' with {given}' if given else ''}: {req.message} ({req.check.source})"
            )
    if spec.steady_state is not None:
        if v > 1:
            raise ScheduleError(f"schedule {spec.name!r}: virtual stages in a steady_state schedule are not supported")
        return compile_continuous(spec, stages, micro_batches, resolved, env, source)
    for i, rule in enumerate(spec.compute):
        if rule.version is not None:
            raise ScheduleError(
                f"schedule {spec.name!r} compute[{i}].version: only allowed in schedules with "
                "steady_state (a flush schedule updates once, after every backward)"
            )
        if any(p.target != "chunk" for p in rule.after):  # the spec gives target 'chunk' to start_allreduce only
            raise ScheduleError(
                f"schedule {spec.name!r} compute[{i}].after: a flush schedule places only "
                "start_allreduce (target chunk) there; its update comes once, after every backward"
            )
    for p in spec.prologue + spec.epilogue:
        if p.target == "chunk":
            raise ScheduleError(
                f"schedule {spec.name!r}: start_allreduce(chunk) belongs in a compute rule's "
                "'after' (it all-reduces that op's chunk)"
            )

    sparse = []
    for s in range(stages):
        placed = place_compute(spec, s, env)
        if not placed:
            raise ScheduleError(
                f"schedule {spec.name!r}: stage {s} has no compute ops for "
                f"{stages} stages x {micro_batches} micro-batches"
            )
        lowered = lower_stage(placed, layout)
        for t, (op, rule) in placed.items():  # 'after' ops follow the op and its same-step sends
            lowered[t].extend(after_ops(spec, op, rule, env, t))
        sparse.append(lowered)

    needed = max(max(steps) + 1 for steps in sparse)
    if spec.steps is not None:
        num_steps = _int(spec.steps, env, f"schedule {spec.name!r} steps")
        if num_steps < needed:
            raise ScheduleError(
                f"schedule {spec.name!r}: steps = {num_steps} but ops are placed up to step "
                f"{needed - 1}; steps must be at least {needed}"
            )
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
        steps[0][:0] = [
            Op(p.kind, s, 0, target=p.target)
            for i, p in enumerate(spec.prologue)
            if _eval(p.when, stage_env, f"schedule {spec.name!r} prologue[{i}] when")
        ]
        for i, placed_op in enumerate(spec.epilogue):
            if _eval(placed_op.when, stage_env, f"schedule {spec.name!r} epilogue[{i}] when"):
                t = num_steps - 1 if placed_op.at == "end" else stage_end
                steps[t].append(Op(placed_op.kind, s, t, target=placed_op.target))
        flat = [op for step in steps for op in step]
        assign, n = _allocate_buffers(flat)
        steps = [
            [
                replace(op, buffer=assign[(op.chunk, op.micro_batch)]) if op.micro_batch is not None else op
                for op in step
            ]
            for step in steps
        ]
        streams.append(steps)
        num_buffers.append(n)

    return CompiledSchedule(
        name=spec.name,
        stages=stages,
        micro_batches=micro_batches,
        params=resolved,
        streams=streams,
        num_buffers=num_buffers,
        source=source,
        description=spec.description,
        uses_tied_reduction=any(OP_INFO[p.kind].tied for p in spec.epilogue),
        virtual_stages=v,
        layout_kind=spec.layout,
    )


def inference_stream(layout: Layout, stage: int, micro_batches: int):
    """One stage's forward-only stream (eval_batch) with virtual stages: every (chunk, micro-batch)
    in that order, each received, loaded where it enters or leaves the model, forwarded and sent
    without blocking (a sender always runs an item before its receiver: no cycle); two buffer
    slots, since a non-blocking send keeps its tensor. Steps of :class:`~.ir.Op`."""
    steps, n = [], 0
    for chunk in range(layout.virtual_stages):
        for mb in range(micro_batches):
            first, last = layout.is_first(stage, chunk), layout.is_last(stage, chunk)
            kw = dict(stage=stage, step=n, micro_batch=mb, buffer=n % 2, chunk=chunk)
            step = [] if first else [Op(OpKind.RECV_ACTIVATION, **kw)]
            step += [Op(OpKind.LOAD, **kw)] if first or last else []
            step.append(Op(OpKind.FORWARD, **kw))
            step += [] if last else [Op(OpKind.SEND_ACTIVATION, blocking=False, **kw)]
            steps.append(step)
            n += 1
    steps[-1].append(Op(OpKind.WAIT_SENDS, stage, n - 1))
    return steps
