"""The schedule IR: per-stage streams of steps of operations. Pure Python, no torch.

A compiled schedule is, for every pipeline stage, a list of *steps*; a step is a list of
:class:`Op`. Steps are not barriers: each rank runs its own stream in order (DeepSpeed's
convention). Ops carry the micro-batch they concern so the validator and the simulator can
reason about data flow; the DeepSpeed adapter drops what DeepSpeed's instructions do not take.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator


class OpKind(str, enum.Enum):
    # data and compute
    LOAD = "load_micro_batch"
    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward_backward"  # fused: the loss stage runs F and B back to back
    # pipeline point-to-point
    SEND_ACTIVATION = "send_activation"
    RECV_ACTIVATION = "recv_activation"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"
    WAIT_SENDS = "wait_sends"  # completes every non-blocking send this stage issued
    # gradient reduction and updates
    REDUCE_TIED_GRADS = "reduce_tied_grads"
    REDUCE_GRADS = "reduce_grads"  # DeepSpeed's blocking bulk all-reduce over the data-parallel group
    START_ALLREDUCE = "start_allreduce"  # async all-reduce over the stage's data-parallel group
    WAIT_ALLREDUCE = "wait_allreduce"
    COPY_GRADS_TO_BUFFER = "copy_grads_to_buffer"
    APPLY_BUFFERED_UPDATE = "apply_buffered_update"
    OPTIMIZER_STEP = "optimizer_step"  # DeepSpeed's: grad norm / overflow over the whole pipeline
    STAGE_OPTIMIZER_STEP = "stage_optimizer_step"  # this stage only, no pipeline-wide sync


COMPUTE_KINDS = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.FORWARD_BACKWARD})
SEND_KINDS = frozenset({OpKind.SEND_ACTIVATION, OpKind.SEND_GRAD})
RECV_KINDS = frozenset({OpKind.RECV_ACTIVATION, OpKind.RECV_GRAD})
BUFFER_KINDS = frozenset({OpKind.LOAD} | COMPUTE_KINDS | SEND_KINDS | RECV_KINDS)
# Ops that synchronise every stage of the pipeline (one replica's view). DeepSpeed's optimizer
# step reduces the gradient norm / overflow flag over the model-parallel group; tied-gradient
# reduction spans the stages that share a module, in the worst case all of them.
PIPELINE_COLLECTIVE_KINDS = frozenset({OpKind.OPTIMIZER_STEP, OpKind.REDUCE_TIED_GRADS})
# Ops a schedule file may place in its prologue/epilogue (the rest are placed by the compiler).
PLACEABLE_KINDS = frozenset({
    OpKind.REDUCE_TIED_GRADS, OpKind.REDUCE_GRADS, OpKind.START_ALLREDUCE, OpKind.WAIT_ALLREDUCE,
    OpKind.COPY_GRADS_TO_BUFFER, OpKind.APPLY_BUFFERED_UPDATE, OpKind.OPTIMIZER_STEP,
    OpKind.STAGE_OPTIMIZER_STEP, OpKind.WAIT_SENDS,
})
ALLREDUCE_TARGETS = ("grads", "buffer")


@dataclass(frozen=True)
class Op:
    kind: OpKind
    stage: int
    step: int
    micro_batch: int | None = None
    buffer: int | None = None  # pipeline buffer slot (compiler-allocated)
    blocking: bool = True  # sends only: False = non-blocking (isend), completed by WAIT_SENDS
    target: str | None = None  # START/WAIT_ALLREDUCE: "grads" or "buffer"

    def __str__(self) -> str:
        parts = []
        if self.micro_batch is not None:
            parts.append(f"mb={self.micro_batch}")
        if self.buffer is not None:
            parts.append(f"buf={self.buffer}")
        if self.kind in SEND_KINDS and not self.blocking:
            parts.append("nonblocking")
        if self.target is not None:
            parts.append(self.target)
        return f"{self.kind.value}({', '.join(parts)})"

    @property
    def label(self) -> str:
        """Short form for timelines: F3, B3, FB3, sA3, rG3, ..."""
        short = {OpKind.FORWARD: "F", OpKind.BACKWARD: "B", OpKind.FORWARD_BACKWARD: "FB",
                 OpKind.SEND_ACTIVATION: "sA", OpKind.RECV_ACTIVATION: "rA", OpKind.SEND_GRAD: "sG",
                 OpKind.RECV_GRAD: "rG", OpKind.LOAD: "L"}
        if self.kind in short:
            return f"{short[self.kind]}{self.micro_batch}"
        return str(self)


@dataclass
class CompiledSchedule:
    """Every stage's stream for one (schedule, stages, micro_batches, params)."""

    name: str
    stages: int
    micro_batches: int
    params: dict
    streams: list[list[list[Op]]]  # stage -> step -> ops
    num_buffers: list[int]  # pipeline buffer slots per stage
    source: str = ""  # file the schedule came from
    description: str = ""
    uses_tied_reduction: bool = field(default=False)

    @property
    def num_steps(self) -> int:
        return len(self.streams[0]) if self.streams else 0

    def ops(self, stage: int) -> Iterator[Op]:
        """The stage's ops in execution order."""
        for step in self.streams[stage]:
            yield from step

    def describe(self, stage: int | None = None) -> str:
        """Human-readable listing, one line per non-empty step."""
        lines = [f"schedule {self.name}: {self.stages} stages, {self.micro_batches} micro-batches, "
                 f"{self.num_steps} steps, params {self.params}"]
        for s in range(self.stages) if stage is None else [stage]:
            lines.append(f"stage {s} ({self.num_buffers[s]} buffers):")
            for t, step in enumerate(self.streams[s]):
                if step:
                    lines.append(f"  step {t:3d}: " + "  ".join(str(op) for op in step))
        return "\n".join(lines)
