"""A compiled schedule as a DeepSpeed ``PipeSchedule``, everything read from the op table
(:data:`hippie_ds.schedules.ir.OP_INFO`): the instruction class of each op (DeepSpeed's own where
the table names one, :data:`~hippie_ds.schedules.ir.DEEPSPEED_INSTRUCTIONS`; the others generated
here and importable by name: ``ForwardBackwardPass``, ``StartAllReduce``, ...) and its arguments
(:func:`~hippie_ds.schedules.ir.handler_kwargs`). Which handler runs an op is its kind's entry in
:data:`~hippie_ds.adapter.stage.handlers.HANDLERS`. Imports DeepSpeed (:mod:`hippie_ds.adapter.ds.schedule`)."""

from __future__ import annotations

from typing import Iterator

from ...schedules.ir import OP_INFO, DEEPSPEED_INSTRUCTIONS, CompiledSchedule, Op, OpKind, OpInfo, handler_kwargs
from ..ds import schedule as ds


def _docstring(kind: OpKind, info: OpInfo, nonblocking: bool) -> str:
    """DeepSpeed's instruction docstring style, from the table entry."""
    how = "; non-blocking, completed by ``WaitSends``" if nonblocking else ""
    table = "NONBLOCKING_HANDLERS" if nonblocking else "HANDLERS"
    return (
        f"Runs ``{kind.value}`` ops{how} (``handlers.{table}[OpKind.{kind.name}]``).\n\n    Roughly:\n\n"
        f"    .. code-block:: python\n\n        {info.doc}\n    "
    )


def _generate() -> dict[str, type]:
    """hippie-ds's instruction classes: one per table name that is not DeepSpeed's. Micro-batch ops
    are ``BufferOpInstruction``s (``buffer_id``), as DeepSpeed's are."""
    classes: dict[str, type] = {}
    for kind, info in OP_INFO.items():
        base = ds.BufferOpInstruction if info.micro_batch else ds.PipeInstruction
        for name, nonblocking in ((info.instruction, False), (info.nonblocking_instruction, True)):
            if name and name not in DEEPSPEED_INSTRUCTIONS:
                classes[name] = type(
                    name,
                    (base,),
                    {"__doc__": _docstring(kind, info, nonblocking), "__module__": __name__, "__qualname__": name},
                )
    return classes


NEW_CLASSES: dict[str, type] = _generate()
globals().update(NEW_CLASSES)  # ForwardBackwardPass, ISendActivation, StartAllReduce, ... by name
NEW_INSTRUCTIONS = tuple(NEW_CLASSES.values())


def _class(name: str) -> type:
    return ds.instruction(name) if name in DEEPSPEED_INSTRUCTIONS else NEW_CLASSES[name]


def instruction_class(op: Op) -> type:
    """The instruction class that runs ``op``: DeepSpeed's own or a generated one, by the name in
    the op's table entry (non-blocking sends: ``nonblocking_instruction``)."""
    info = OP_INFO[op.kind]
    return _class(
        info.nonblocking_instruction if not op.blocking and info.nonblocking_instruction else info.instruction
    )


def to_instruction(op: Op) -> ds.PipeInstruction:
    """``op`` as an instruction whose keyword arguments are its handler's (``OpInfo.args``)."""
    return instruction_class(op)(**handler_kwargs(op))


def build(
    name_or_path, micro_batches: int, stages: int, stage_id: int, validate: bool = True, **params
) -> "DeclaredSchedule":
    """A DeepSpeed ``PipeSchedule`` for one stage of the named (or file) schedule."""
    from ...schedules import compile as compile_schedule

    compiled = compile_schedule(name_or_path, stages, micro_batches, validate=validate, **params)
    return DeclaredSchedule(compiled, stage_id)


def op_steps(pipe_schedule) -> Iterator[list[tuple[ds.PipeInstruction, Op | None]]]:
    """(instruction, op) pairs of each step, as ``HippiePipelineEngine``'s loop runs them: an
    :class:`OpSchedule`'s own; any other ``PipeSchedule`` (DeepSpeed's ``InferenceSchedule``)
    with no op."""
    if isinstance(pipe_schedule, OpSchedule):
        return pipe_schedule.op_steps()
    return ([(cmd, None) for cmd in step] for step in pipe_schedule)


class OpSchedule(ds.PipeSchedule):
    """One stage's op stream as a DeepSpeed ``PipeSchedule``: ``steps()`` yields DeepSpeed's
    instruction lists, ``op_steps()`` each instruction with the op it runs."""

    def __init__(self, stream: list[list[Op]], micro_batches: int, stages: int, stage_id: int, num_buffers: int):
        super().__init__(micro_batches, stages, stage_id)
        self._pairs = [[(to_instruction(op), op) for op in step] for step in stream]
        self._num_buffers = num_buffers

    def steps(self):
        for step in self._pairs:
            yield [inst for inst, _ in step]

    def op_steps(self) -> Iterator[list[tuple[ds.PipeInstruction, Op]]]:
        for step in self._pairs:
            yield list(step)

    def num_pipe_buffers(self) -> int:
        return self._num_buffers


class DeclaredSchedule(OpSchedule):
    """One stage's view of a compiled schedule, as DeepSpeed's engine consumes it."""

    def __init__(self, compiled: CompiledSchedule, stage_id: int):
        if not 0 <= stage_id < compiled.stages:
            raise ValueError(f"stage_id = {stage_id}: allowed 0..{compiled.stages - 1}")
        super().__init__(
            compiled.streams[stage_id],
            compiled.micro_batches,
            compiled.stages,
            stage_id,
            compiled.num_buffers[stage_id],
        )
        self.compiled = compiled
        # continuous schedules: engine.drain() runs these (the batches still in flight)
        self.drain = OpSchedule(
            compiled.drain[stage_id] if compiled.drain else [],
            compiled.micro_batches,
            compiled.stages,
            stage_id,
            compiled.num_buffers[stage_id],
        )

    def __repr__(self) -> str:
        return (
            f"DeclaredSchedule({self.compiled.name!r}, stages={self.stages}, micro_batches={self.micro_batches}, "
            f"stage_id={self.stage_id})"
        )
