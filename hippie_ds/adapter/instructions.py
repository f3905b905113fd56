"""A compiled schedule as a DeepSpeed ``PipeSchedule``: DeepSpeed's own instruction classes
where they exist, new ``PipeInstruction`` subclasses for the rest. Imports DeepSpeed."""
from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

from ..schedules.ir import OP_INFO, WEIGHT_KINDS, CompiledSchedule, Op, OpKind


class ForwardBackwardPass(ds.BufferOpInstruction):
    """Forward and backward of one micro-batch back to back (the loss stage); frees its
    activations before the next micro-batch arrives."""


class BackwardInputPass(ds.BufferOpInstruction):
    """Split backward, first half: the gradient of the buffer's inputs only (sent to the
    previous stage); keeps what the parameter gradients need."""


class BackwardWeightPass(ds.BufferOpInstruction):
    """Split backward, second half: the buffer's parameter gradients, from what
    :class:`BackwardInputPass` kept."""


class ISendActivation(ds.BufferOpInstruction):
    """Non-blocking send of a buffer's activations; completed by :class:`WaitSends`."""


class ISendGrad(ds.BufferOpInstruction):
    """Non-blocking send of a buffer's input gradients; completed by :class:`WaitSends`."""


class WaitSends(ds.PipeInstruction):
    """Wait until every non-blocking send this stage issued has completed."""


class StartAllReduce(ds.PipeInstruction):
    """Start an asynchronous all-reduce (average) over this stage's data-parallel group, of the
    parameters' gradients (``target='grads'``), of one model chunk's (``target='chunk'``,
    ``chunk=c``: virtual stages, its backwards done) or of the gradient buffer (``target='buffer'``).
    The handle outlives ``train_batch`` when the schedule waits for it in the next call."""


class WaitAllReduce(ds.PipeInstruction):
    """Wait for the all-reduce started by :class:`StartAllReduce` with the same target."""


class CopyGradsToBuffer(ds.PipeInstruction):
    """Move this stage's accumulated gradients into its gradient buffer and zero them."""


class ApplyBufferedUpdate(ds.PipeInstruction):
    """Take an optimizer step with the (reduced) gradient buffer; skipped while it is empty."""


class StageOptimizerStep(ds.PipeInstruction):
    """Optimizer step of this stage alone: no pipeline-wide gradient-norm reduction."""


class StashWeights(ds.PipeInstruction):
    """Keep a copy of the stage's current weights (about to be updated) as a weight version."""


class FreeWeights(ds.PipeInstruction):
    """Drop a stashed weight version after its last use."""


NEW_INSTRUCTIONS = (ForwardBackwardPass, BackwardInputPass, BackwardWeightPass, ISendActivation, ISendGrad, WaitSends, StartAllReduce, WaitAllReduce,
                    CopyGradsToBuffer, ApplyBufferedUpdate, StageOptimizerStep, StashWeights, FreeWeights)
_NEW = {cls.__name__: cls for cls in NEW_INSTRUCTIONS}


def instruction_class(op: Op) -> type:
    """The instruction class that runs ``op``: DeepSpeed's own or one of the above, by the name
    in the op's table entry (:data:`hippie_ds.schedules.ir.OP_INFO`)."""
    info = OP_INFO[op.kind]
    name = info.nonblocking_instruction if not op.blocking and info.nonblocking_instruction else info.instruction
    return _NEW.get(name) or getattr(ds, name)


def to_instruction(op: Op) -> ds.PipeInstruction:
    """``op`` as an instruction whose arguments are all its handler needs: DeepSpeed's
    ``buffer_id``, an all-reduce's ``target``, a weight version's ``batch`` and ``version``."""
    cls = instruction_class(op)
    if OP_INFO[op.kind].micro_batch:
        return cls(op.buffer)
    if op.kind in WEIGHT_KINDS:
        return cls(batch=op.batch, version=op.version)
    if op.kind == OpKind.STAGE_OPTIMIZER_STEP:
        return cls(batch=op.batch)  # continuous schedules: the update takes its batch's learning rate
    if op.target == "chunk":
        return cls(target=op.target, chunk=op.chunk)
    return cls(target=op.target) if op.target is not None else cls()


def build(name_or_path, micro_batches: int, stages: int, stage_id: int, validate: bool = True,
          **params) -> "DeclaredSchedule":
    """A DeepSpeed ``PipeSchedule`` for one stage of the named (or file) schedule."""
    from ..schedules import compile as compile_schedule
    compiled = compile_schedule(name_or_path, stages, micro_batches, validate=validate, **params)
    return DeclaredSchedule(compiled, stage_id)


class DeclaredSchedule(ds.PipeSchedule):
    """One stage's view of a compiled schedule, as DeepSpeed's engine consumes it."""

    def __init__(self, compiled: CompiledSchedule, stage_id: int):
        if not 0 <= stage_id < compiled.stages:
            raise ValueError(f"stage_id = {stage_id}: allowed 0..{compiled.stages - 1}")
        super().__init__(compiled.micro_batches, compiled.stages, stage_id)
        self.compiled = compiled
        self._steps = [[self._instruction(op) for op in step] for step in compiled.streams[stage_id]]
        # continuous schedules: engine.drain() runs these (the batches still in flight)
        self.drain_steps = [[self._instruction(op) for op in step]
                            for step in (compiled.drain[stage_id] if compiled.drain else [])]

    @staticmethod
    def _instruction(op: Op) -> ds.PipeInstruction:
        inst = to_instruction(op)
        inst.op = op  # not a kwarg: handlers never see it; the engine's loop and timelines use it
        return inst

    def steps(self):
        for step in self._steps:
            yield list(step)

    def num_pipe_buffers(self) -> int:
        return self.compiled.num_buffers[self.stage_id]

    def __repr__(self) -> str:
        return f"DeclaredSchedule({self.compiled.name!r}, stages={self.stages}, micro_batches={self.micro_batches}, " \
               f"stage_id={self.stage_id})"
