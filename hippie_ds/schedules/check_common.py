"""What the validator's analyses share: the :class:`Problem` they report and the call sequences
(scenarios) a continuous schedule is checked under. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

from .ir import BUFFER_KINDS, CompiledSchedule, Op


@dataclass(frozen=True)
class Problem:
    stage: int
    step: int | None
    op: str | None  # str(op) of the offending Op
    reason: str

    def __str__(self) -> str:
        where = f"stage {self.stage}"
        if self.step is not None:
            where += f" step {self.step}"
        if self.op is not None:
            where += f" {self.op}"
        return f"{where}: {self.reason}"


def unique(problems: Iterable[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))


def problem(op: Op, reason: str, stage: int | None = None) -> Problem:
    return Problem(op.stage if stage is None else stage, op.step, str(op), reason)


def short(op: Op) -> str:
    """``recv_grad(mb=3)``: the op as the reasons name it (slot and flags omitted)."""
    chunk = f", chunk={op.chunk}" if op.chunk else ""
    return f"{op.kind.value}(mb={op.micro_batch}{chunk})" if op.micro_batch is not None else op.kind.value


# A scenario of a continuous schedule: a list of phases, each ("call", t) or ("drain", t) (the
# drain after t calls); ops of batches that do not exist or were drained are skipped.


def scenarios(compiled: CompiledSchedule, iterations: int = 2) -> list[list[tuple[str, int]]]:
    """The call sequences the validator checks for a continuous schedule: enough calls to
    reach the steady state, then a drain; and a drain in the middle of training (as
    save_checkpoint does) followed by more calls and a final drain."""
    depth = max((-op.batch for s in range(compiled.stages) for op in compiled.ops(s)), default=0)
    n = max(iterations, depth + 3)
    return [
        [("call", t) for t in range(n)] + [("drain", n)],
        [("call", 0), ("drain", 1), ("call", 1), ("call", 2), ("drain", 3)],
    ]


def scenario_ops(compiled: CompiledSchedule, stage: int, scenario) -> list[tuple[int, int, Op]]:
    """(phase index, absolute batch, op) of the stage's ops in a scenario, in order."""
    out = []
    first = 0  # the earliest batch not yet drained
    for phase, (kind, t) in enumerate(scenario):
        ops = compiled.call_ops(stage, t, first) if kind == "call" else compiled.drain_ops(stage, t, first)
        out += [(phase, t + op.batch, op) for op in ops]
        if kind == "drain":
            first = t
    return out


def check_slots(
    ops: Sequence[tuple[Hashable, Op]],
    num_buffers: int,
    add: Callable[[Op, str], None],
    name: Callable[[Hashable], str],
) -> None:
    """Pipeline buffer slots of one stage's op sequence, ``(micro-batch key, op)`` in execution
    order: every slot in range, one slot per micro-batch, and no slot rewritten while its
    micro-batch still has ops to run. A micro-batch holds its slot from its first buffer op to its
    last (a non-blocking send, when last, frees it at issue: the engine keeps the tensor).
    ``name(key)`` words a micro-batch in messages."""
    first: dict = {}
    last: dict = {}
    for i, (key, op) in enumerate(ops):
        if op.kind in BUFFER_KINDS and op.micro_batch is not None:
            first.setdefault(key, i)
            last[key] = i
    holder: dict[int, Hashable] = {}  # slot -> micro-batch that last started in it
    slot_of: dict = {}
    for i, (key, op) in enumerate(ops):
        if op.kind not in BUFFER_KINDS or op.micro_batch is None:
            continue
        b = op.buffer
        if b is None:
            add(op, "no pipeline buffer slot")
            continue
        if not 0 <= b < num_buffers:
            add(op, f"buffer {b} outside 0..{num_buffers - 1} ({num_buffers} slots)")
            continue
        if key not in slot_of:
            slot_of[key] = b
            other = holder.get(b)
            if other is not None and last[other] > i:
                later = ops[last[other]][1]
                add(
                    op,
                    f"buffer overwritten while live: slot {b} still holds {name(other)} "
                    f"(used again at step {later.step} by {short(later)})",
                )
            holder[b] = key
        elif b != slot_of[key]:
            add(op, f"{name(key)} in slot {b}, but its first op put it in slot {slot_of[key]}")
