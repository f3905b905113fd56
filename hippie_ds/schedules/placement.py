"""Passes 2 and 3 of the compiler: place a stage's compute ops at their declared steps, then add
the loads, receives and sends around them (DeepSpeed's order). Pure Python; shared by flush and
continuous compilation."""

from __future__ import annotations

from typing import Any, Mapping

from .expr import ExpressionError
from .ir import FORWARD_KINDS, OP_INFO, Op, OpKind
from .layout import Layout
from .spec import ComputeRule, ScheduleError, ScheduleSpec


def eval_expr(expr, env: Mapping[str, Any], where: str):
    try:
        return expr.evaluate(env)
    except ExpressionError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise ScheduleError(f"{where}: expression {expr.source!r} failed: {exc}") from None


def int_expr(expr, env, where) -> int:
    value = eval_expr(expr, env, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{where}: expression {expr.source!r} gave {value!r}, expected an integer")
    return value


def op_env(spec: ScheduleSpec, env: dict, stage: int, mb: int, chunk: int) -> dict:
    """What a compute rule's expressions see for one op: the job, the op, the definitions."""
    local = dict(env, stage=stage, mb=mb, chunk=chunk)
    for name, expr in spec.define.items():
        local[name] = eval_expr(expr, local, f"schedule {spec.name!r} define.{name}")
    return local


def after_ops(spec: ScheduleSpec, op: Op, rule: ComputeRule, env: dict, step: int) -> list[Op]:
    """The ops placed right after ``op`` (its rule's ``after`` whose ``when`` holds), of its batch and chunk."""
    local = op_env(spec, env, op.stage, op.micro_batch, op.chunk)
    return [
        Op(p.kind, op.stage, step, target=p.target, batch=op.batch, chunk=op.chunk)
        for i, p in enumerate(rule.after)
        if eval_expr(p.when, local, f"schedule {spec.name!r} {rule.op}.after[{i}] when")
    ]


def place_compute(spec: ScheduleSpec, stage: int, env: dict) -> dict[int, tuple[Op, ComputeRule]]:
    """Every compute op of ``stage`` by step: one per (chunk, micro-batch) for which a rule holds."""
    placed: dict[int, tuple[Op, ComputeRule]] = {}
    for i, rule in enumerate(spec.compute):
        where = f"schedule {spec.name!r} compute[{i}] ({rule.op})"
        for chunk in range(env.get("virtual_stages", 1)):
            for mb in range(env["micro_batches"]):
                local = op_env(spec, env, stage, mb, chunk)
                if not eval_expr(rule.when, local, where + " when"):
                    continue
                step = int_expr(rule.at, local, where + " at")
                name = f"{rule.op}(mb={mb}" + (f", chunk={chunk})" if chunk else ")")
                if step < 0:
                    raise ScheduleError(f"{where}: stage {stage} {name} placed at step {step} < 0")
                if step in placed:
                    other = placed[step][0]
                    raise ScheduleError(
                        f"{where}: stage {stage} step {step}: {name} collides with {other}; one compute op per step"
                    )
                version = None if rule.version is None else int_expr(rule.version, local, where + " version")
                placed[step] = (Op(OpKind(rule.op), stage, step, mb, version=version, chunk=chunk), rule)
    return placed


def _has_peer(layout: Layout, op: Op, p2p: OpKind) -> bool:
    """Whether a ``p2p`` op of ``op``'s chunk has a model part to talk to (its OP_INFO direction)."""
    return not (layout.is_last if OP_INFO[p2p].direction > 0 else layout.is_first)(op.stage, op.chunk)


def _sends_of(op: Op, rule: ComputeRule, layout: Layout, step: int) -> list[Op]:
    """The send carrying ``op``'s result to the chunk that consumes it (OP_INFO ``sends``), if there is one."""
    kind = OP_INFO[op.kind].sends
    if kind is None or not _has_peer(layout, op, kind):
        return []
    return [Op(kind, op.stage, step, op.micro_batch, blocking=rule.send.blocking, batch=op.batch, chunk=op.chunk)]


def _recvs_of(op: Op, layout: Layout) -> list[Op]:
    """The receive bringing ``op``'s input (OP_INFO ``receives``), if there is one."""
    kind = OP_INFO[op.kind].receives
    if kind is None or not _has_peer(layout, op, kind):
        return []
    return [Op(kind, op.stage, op.step, op.micro_batch, batch=op.batch, chunk=op.chunk)]


def lower_stage(placed: dict[int, tuple[Op, ComputeRule]], layout: Layout | int) -> dict[int, list[Op]]:
    """Steps (sparse) of compute with loads, receives and sends added (``layout``: the stage count
    for one chunk per stage)."""
    layout = layout if isinstance(layout, Layout) else Layout("interleaved", layout)
    steps: dict[int, list[Op]] = {}
    last = max(placed)
    for t in range(last + 2):
        cur = placed.get(t)
        prev = placed.get(t - 1)
        prev_sends = _sends_of(prev[0], prev[1], layout, t) if prev and prev[1].send.when == "next_step" else []
        ops: list[Op] = []
        if cur:
            op, rule = cur
            recvs = _recvs_of(op, layout)
            ops += prev_sends + recvs if op.kind in FORWARD_KINDS else recvs + prev_sends
            if op.kind in FORWARD_KINDS and (layout.is_first(op.stage, op.chunk) or layout.is_last(op.stage, op.chunk)):
                ops.append(Op(OpKind.LOAD, op.stage, t, op.micro_batch, batch=op.batch, chunk=op.chunk))
            ops.append(op)
            if rule.send.when == "same_step":
                ops += _sends_of(op, rule, layout, t)
        else:
            ops += prev_sends
        if ops:
            steps[t] = ops
    return steps
