"""The schedule IR: per-stage streams of steps of operations. Pure Python, no torch.

A compiled schedule is, for every pipeline stage, a list of *steps*; a step is a list of
:class:`Op`. Steps are not barriers: each rank runs its own stream in order (DeepSpeed's
convention). Ops carry the micro-batch they concern so the validator and the simulator can
reason about data flow; the DeepSpeed adapter drops what DeepSpeed's instructions do not take.
"""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, field
from typing import Iterator

from .layout import Layout


class OpKind(str, enum.Enum):
    # data and compute
    LOAD = "load_micro_batch"
    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward_backward"  # fused: the loss stage runs F and B back to back
    # split backward (zero-bubble): the input gradient first, the weight gradient later
    BACKWARD_INPUT = "backward_input"  # the zero-bubble paper's B: the gradient sent to the previous stage
    BACKWARD_WEIGHT = "backward_weight"  # its W: the parameter gradients of the same micro-batch
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
    # weight versions (schedules whose compute ops declare a ``version``; derived by the compiler)
    STASH_WEIGHTS = "stash_weights"  # keep a copy of the current weights (about to be updated) as a version
    FREE_WEIGHTS = "free_weights"  # drop a stashed weight version after its last use


@dataclass(frozen=True)
class OpInfo:
    """What one op kind means: the one place the compiler, validator, simulator, DeepSpeed
    adapter and timelines look it up (the validator's and simulator's state machines add the
    order rules). The engine side is named, not imported (this module stays pure): the
    instruction class and which ``Op`` fields become the instruction's keyword arguments, i.e. its
    handler's (:func:`handler_kwargs`); the handler itself is the kind's entry in
    ``hippie_ds/adapter/stage/handlers.py``'s ``HANDLERS``."""

    short: str  # compact notation and timeline label: F3, B3, sA3, ...; "" = the op's full form
    role: str  # load | compute | send | recv | comm | update | weights
    category: str  # timeline category (its time: the cost terms below)
    doc: str  # "Roughly: ..." of what the engine does (also the generated instruction class's docstring)
    # the PipeInstruction class: DeepSpeed's (DEEPSPEED_INSTRUCTIONS) or generated (adapter/stage/instructions.py)
    instruction: str
    _: KW_ONLY
    args: tuple[
        str, ...
    ] = ()  # its handler's keyword arguments: Op fields (HANDLER_ARG_FIELDS: buffer_id is Op.buffer)
    nonblocking_instruction: str | None = None  # sends with blocking: false (their handler takes the same args)
    micro_batch: bool = False  # concerns one micro-batch and its pipeline buffer slot
    placeable: bool = False  # a schedule file may place it in its prologue/epilogue
    new_version: bool = False  # produces the stage's next weight version (an update)
    consumes_grads: bool = False  # applies or buffers the iteration's gradients (once per iteration)
    pipeline_collective: bool = False  # synchronises every stage of the pipeline (one replica's view)
    tied: bool = False  # reduces the gradients of modules tied across stages
    targets: tuple[str, ...] = ()  # the targets it takes (Op.target): what an all-reduce reduces
    # where a steady_state schedule may have it: "compute" (a compute rule's op), "epilogue", "after"
    # (a compute rule's 'after'); () = in flush schedules only (continuous.py refuses it)
    steady_state: tuple[str, ...] = ()
    cost: tuple[str, ...] = ()  # the simulator's time: these StageCost terms summed (() = free or modelled apart)
    # compute: its micro-batch's forward (activations held from then until the parameter gradients),
    # input gradient (sent back), parameter gradients (accumulated); the p2p kinds bringing its input, taking its result
    forward: bool = False
    input_grad: bool = False
    weight_grad: bool = False
    receives: "OpKind | None" = None
    sends: "OpKind | None" = None
    # p2p: the kind at the other end, what it carries ("activation" | "gradient"), and which way along the
    # model (+1: to the next model part, -1: to the previous)
    peer: "OpKind | None" = None
    carries: str = ""
    direction: int = 0
    own_gradients: bool = False  # its handler reads or writes gradients outside DeepSpeed's backward/reduce/step
    allreduce: str = ""  # "start" | "wait": the ends of an asynchronous all-reduce (a timeline spans them)

    @property
    def split_backward(self) -> bool:
        """One half of a split backward: the input gradient or the parameter gradients alone."""
        return self.input_grad != self.weight_grad


ALLREDUCE_TARGETS = ("grads", "buffer")
# start_allreduce(chunk), in a compute rule's 'after': this model chunk's gradients, now (virtual
# stages: a chunk whose backwards are done); wait_allreduce(grads) waits for it too
START_TARGETS = ALLREDUCE_TARGETS + ("chunk",)
_K = OpKind
_BUF = ("buffer_id",)  # DeepSpeed's BufferOpInstruction argument: the op's pipeline buffer slot
# The table reads as one entry per kind: unformatted (the formatter puts every field on its own line).
# fmt: off
OP_INFO: dict[OpKind, OpInfo] = {
    _K.LOAD: OpInfo("L", "load", "load", "buffers['inputs'][buf] = next(data_iter) (first/last stage)",
                    "LoadMicroBatch", args=_BUF, micro_batch=True),
    _K.FORWARD: OpInfo("F", "compute", "forward", "buffers['outputs'][buf] = forward(buffers['inputs'][buf])",
                       "ForwardPass", args=_BUF, micro_batch=True,
                       cost=("forward",), forward=True, receives=_K.RECV_ACTIVATION,
                       sends=_K.SEND_ACTIVATION, steady_state=("compute",)),
    _K.BACKWARD: OpInfo("B", "compute", "backward", "grads += backward(buffers['outputs'][buf], received grad)",
                        "BackwardPass", args=_BUF, micro_batch=True,
                        cost=("backward", "recompute"), input_grad=True, weight_grad=True,
                        receives=_K.RECV_GRAD, sends=_K.SEND_GRAD, steady_state=("compute",)),
    _K.FORWARD_BACKWARD: OpInfo("FB", "compute", "forward_backward", "forward then backward of one micro-batch, "
                                "its activations freed before the next (the loss stage)", "ForwardBackwardPass",
                                args=_BUF, micro_batch=True,
                                cost=("forward", "backward", "recompute"),
                                forward=True, input_grad=True, weight_grad=True, receives=_K.RECV_ACTIVATION,
                                sends=_K.SEND_GRAD, steady_state=("compute",)),
    _K.BACKWARD_INPUT: OpInfo("I", "compute", "backward_input", "buffers['inputs'][buf].grad = backward of the "
                              "inputs only; keeps the graph and the weight nodes' output gradients for W",
                              "BackwardInputPass", args=_BUF, micro_batch=True,
                              cost=("input_time", "recompute"), input_grad=True, receives=_K.RECV_GRAD,
                              sends=_K.SEND_GRAD, own_gradients=True),
    _K.BACKWARD_WEIGHT: OpInfo("W", "compute", "backward_weight", "grads += weight gradients of buf from what I kept; "
                               "frees the micro-batch", "BackwardWeightPass", args=_BUF, micro_batch=True,
                               cost=("weight_time",), weight_grad=True, own_gradients=True),
    _K.SEND_ACTIVATION: OpInfo("sA", "send", "p2p", "send(buffers['outputs'][buf], next stage)", "SendActivation",
                               args=_BUF,
                               nonblocking_instruction="ISendActivation", micro_batch=True,
                               peer=_K.RECV_ACTIVATION, carries="activation", direction=+1),
    _K.RECV_ACTIVATION: OpInfo("rA", "recv", "p2p", "buffers['inputs'][buf] = recv(previous stage)",
                               "RecvActivation", args=_BUF,
                               micro_batch=True, peer=_K.SEND_ACTIVATION, carries="activation", direction=-1),
    _K.SEND_GRAD: OpInfo("sG", "send", "p2p", "send(buffers['inputs'][buf].grad, previous stage)", "SendGrad",
                         args=_BUF, nonblocking_instruction="ISendGrad", micro_batch=True,
                         peer=_K.RECV_GRAD, carries="gradient", direction=-1),
    _K.RECV_GRAD: OpInfo("rG", "recv", "p2p", "received grad = recv(next stage)", "RecvGrad",
                         args=_BUF, micro_batch=True,
                         peer=_K.SEND_GRAD, carries="gradient", direction=+1),
    _K.WAIT_SENDS: OpInfo("", "send", "p2p", "wait for every non-blocking send this stage issued", "WaitSends",
                          placeable=True, steady_state=("epilogue",)),
    _K.REDUCE_TIED_GRADS: OpInfo("", "comm", "sync", "all-reduce the gradients of modules tied across stages",
                                 "ReduceTiedGrads", placeable=True,
                                 pipeline_collective=True, tied=True),
    _K.REDUCE_GRADS: OpInfo("", "comm", "allreduce", "grads = all_reduce(grads) / dp (blocking)", "ReduceGrads",
                            placeable=True),
    _K.START_ALLREDUCE: OpInfo("", "comm", "allreduce", "start all_reduce(grads, buffer, or one chunk's grads) / dp, "
                               "asynchronously", "StartAllReduce", args=("target", "chunk"), placeable=True,
                               # chunk: read with target 'chunk' only
                               targets=START_TARGETS, own_gradients=True, steady_state=("epilogue", "after"),
                               allreduce="start"),
    _K.WAIT_ALLREDUCE: OpInfo("", "comm", "allreduce", "wait for that all-reduce", "WaitAllReduce",
                              args=("target",), placeable=True,
                              targets=ALLREDUCE_TARGETS, own_gradients=True, steady_state=("epilogue", "after"),
                              allreduce="wait"),
    _K.COPY_GRADS_TO_BUFFER: OpInfo("", "update", "buffer", "buffer = grads; grads = 0 (applied next step)",
                                    "CopyGradsToBuffer", placeable=True,
                                    consumes_grads=True, own_gradients=True),
    _K.APPLY_BUFFERED_UPDATE: OpInfo("", "update", "optimizer", "optimizer.step(buffer) (skipped while empty)",
                                     "ApplyBufferedUpdate", placeable=True,
                                     new_version=True, cost=("optimizer_time",), own_gradients=True),
    _K.OPTIMIZER_STEP: OpInfo("", "update", "optimizer", "optimizer.step(grads), norm over the pipeline",
                              "OptimizerStep", placeable=True, new_version=True,
                              consumes_grads=True, pipeline_collective=True, cost=("optimizer_time",)),
    # batch: continuous schedules' updates take their batch's learning rate
    _K.STAGE_OPTIMIZER_STEP: OpInfo("", "update", "optimizer", "optimizer.step(grads) of this stage alone",
                                    "StageOptimizerStep", args=("batch",),
                                    placeable=True, new_version=True, consumes_grads=True,
                                    cost=("optimizer_time",), own_gradients=True, steady_state=("epilogue", "after")),
    _K.STASH_WEIGHTS: OpInfo("", "weights", "weights", "versions[v] = copy(weights) before they are updated",
                             "StashWeights", args=("batch", "version"),
                             own_gradients=True),
    _K.FREE_WEIGHTS: OpInfo("", "weights", "weights", "del versions[v] after its last use", "FreeWeights",
                            args=("batch", "version")),
}
# fmt: on
del _K
# The instruction classes of the table that are DeepSpeed's own (deepspeed.runtime.pipe.schedule);
# adapter/stage/instructions.py generates the others, so stock code and PipelineEngine's map keep working.
DEEPSPEED_INSTRUCTIONS = frozenset(
    {
        "LoadMicroBatch",
        "ForwardPass",
        "BackwardPass",
        "SendActivation",
        "RecvActivation",
        "SendGrad",
        "RecvGrad",
        "ReduceTiedGrads",
        "ReduceGrads",
        "OptimizerStep",
    }
)
HANDLER_ARG_FIELDS = {"buffer_id": "buffer"}  # handler argument -> the Op field it is read from, where names differ


def kinds(**where) -> frozenset:
    """The op kinds whose :class:`OpInfo` has every given field value, e.g. ``kinds(role="send")``."""
    return frozenset(k for k, info in OP_INFO.items() if all(getattr(info, f) == v for f, v in where.items()))


COMPUTE_KINDS = kinds(role="compute")
FORWARD_KINDS = kinds(forward=True)  # ops that run a micro-batch's forward (its activations held from then)
INPUT_GRAD_KINDS = kinds(input_grad=True)  # compute a micro-batch's input gradient (sent to the previous stage)
WEIGHT_GRAD_KINDS = kinds(weight_grad=True)  # after which a micro-batch's parameter gradients are accumulated
WHOLE_BACKWARD_KINDS = INPUT_GRAD_KINDS & WEIGHT_GRAD_KINDS  # both of the above in one
SPLIT_BACKWARD_KINDS = kinds(split_backward=True)  # the two halves of a split backward (zero-bubble)
SEND_KINDS = kinds(role="send", micro_batch=True)
RECV_KINDS = kinds(role="recv")
RECV_GRAD_KINDS = kinds(role="recv", carries="gradient")
# ops that start from an output gradient received from the next stage (a fused forward_backward computes its own)
GRAD_RECEIVING_KINDS = frozenset(k for k, info in OP_INFO.items() if info.receives in RECV_GRAD_KINDS)
BUFFER_KINDS = kinds(micro_batch=True)  # ops that concern one micro-batch
# DeepSpeed's optimizer step reduces the gradient norm / overflow flag over the model-parallel
# group; tied-gradient reduction spans the stages that share a module, in the worst case all.
PIPELINE_COLLECTIVE_KINDS = kinds(pipeline_collective=True)
PLACEABLE_KINDS = kinds(placeable=True)  # the rest are placed by the compiler
UPDATE_KINDS = kinds(new_version=True)  # the version counter counts these
GRADIENT_CONSUMER_KINDS = kinds(consumes_grads=True)  # apply or buffer the iteration's gradients
WEIGHT_KINDS = kinds(role="weights")
CATEGORY = {k: info.category for k, info in OP_INFO.items()}  # timeline category of each op kind


def weight_version(batch: int, updates_per_batch: int, version: int, clamp: bool = True) -> int:
    """The absolute weight version meant by an op of ``batch`` (a call's index plus the op's
    relative batch) declaring ``version``: ``batch * updates_per_batch + version``. Versions below
    0 are the initial weights: version 0 with ``clamp``, the raw value without (free_weights of the
    initial weights). The one place of this arithmetic: compiler, validator, simulator, engine."""
    v = batch * updates_per_batch + version
    return max(0, v) if clamp else v


def handler_kwargs(op: "Op") -> dict:
    """The keyword arguments of ``op``'s instruction, i.e. of its engine handler: the fields its
    ``OpInfo.args`` names (DeepSpeed's ``cmd.kwargs`` contract)."""
    return {arg: getattr(op, HANDLER_ARG_FIELDS.get(arg, arg)) for arg in OP_INFO[op.kind].args}


@dataclass(frozen=True)
class Op:
    kind: OpKind
    stage: int
    step: int
    micro_batch: int | None = None
    buffer: int | None = None  # pipeline buffer slot (compiler-allocated)
    blocking: bool = True  # sends only: False = non-blocking (isend), completed by WAIT_SENDS
    target: str | None = None  # START/WAIT_ALLREDUCE: "grads" or "buffer"
    # Continuous (steady-state) schedules only. ``batch``: which batch the op belongs to,
    # relative to the train_batch call that runs it (0: this call's batch, -1: the previous
    # call's, still in flight). ``version``: the weight version a compute op uses, or the one
    # STASH/FREE_WEIGHTS concern, counted in this stage's updates relative to the start of the
    # op's batch: absolute version = (call + batch) * updates_per_batch + version, and versions
    # below 0 are the initial weights.
    batch: int = 0
    version: int | None = None
    # Virtual stages: the model chunk of this stage the op concerns (hippie_ds.schedules.layout
    # says which model part that is); 0 on a stage holding one chunk.
    chunk: int = 0

    def __str__(self) -> str:
        parts = []
        if self.chunk:
            parts.append(f"chunk={self.chunk}")
        if self.batch:
            parts.append(f"batch={self.batch:+d}")
        if self.micro_batch is not None:
            parts.append(f"mb={self.micro_batch}")
        if self.buffer is not None:
            parts.append(f"buf={self.buffer}")
        if self.kind in SEND_KINDS and not self.blocking:
            parts.append("nonblocking")
        if self.target is not None and not (self.target == "chunk" and self.chunk):
            parts.append(self.target)
        if self.version is not None:
            parts.append(f"v={self.version:+d}")
        return f"{self.kind.value}({', '.join(parts)})"

    @property
    def label(self) -> str:
        """Short form for timelines: F3, B3, FB3, sA3, rG3, ...; F3.1: micro-batch 3 on chunk 1."""
        short = OP_INFO[self.kind].short
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{short}{self.micro_batch}{chunk}" if short else str(self)


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
    # Continuous schedules (``steady_state`` in the file): ``streams`` is one steady-state
    # train_batch call; the ops of batches that do not exist (before the first, or already
    # drained) are skipped, so the same streams also start the pipeline. ``drain`` completes
    # every batch still in flight after the last call (batch relative to the call that would
    # come next). ``updates_per_batch``: per stage, updates (new weight versions) per batch.
    continuous: bool = False
    drain: list[list[list[Op]]] | None = None
    updates_per_batch: list[int] = field(default_factory=list)
    period: int = 0
    offsets: list[int] = field(default_factory=list)  # per stage: where its call window starts on the timeline
    # Virtual stages: every stage holds ``virtual_stages`` model chunks placed by ``layout_kind``
    # (hippie_ds.schedules.layout); 1: DeepSpeed's one part per stage.
    virtual_stages: int = 1
    layout_kind: str = "interleaved"

    @property
    def layout(self) -> Layout:
        return Layout(self.layout_kind, self.stages, self.virtual_stages)

    @property
    def versioned(self) -> bool:
        """True when compute ops declare the weight version they use."""
        return any(op.version is not None for s in range(self.stages) for op in self.ops(s))

    @property
    def has_early_allreduce(self) -> bool:
        """True when some stage all-reduces asynchronously (overlapped with compute): such
        schedules gain most when data-parallel traffic takes the slow, inter-node link."""
        return any(op.kind == OpKind.START_ALLREDUCE for s in range(self.stages) for op in self.ops(s))

    @property
    def splits_backward(self) -> bool:
        """True when some stage runs backward_input / backward_weight (zero-bubble schedules)."""
        return any(op.kind == OpKind.BACKWARD_INPUT for s in range(self.stages) for op in self.ops(s))

    def deferred_stages(self) -> list[int]:
        """Stages that apply their gradient one step late (a gradient buffer)."""
        return [s for s in range(self.stages) if any(op.kind == OpKind.APPLY_BUFFERED_UPDATE for op in self.ops(s))]

    def one_version_behind(self, stage: int) -> bool:
        """True when every compute op of the stage runs on the version before its batch's update
        (PipeDream-2BW's W(t+1) = W(t) - lr * g(W(t-1))): the stage's delayed-update rule."""
        versions = {op.version for op in self.ops(stage) if op.kind in COMPUTE_KINDS}
        return versions == {-1}

    def call_ops(self, stage: int, call: int, first_batch: int = 0) -> Iterator[Op]:
        """The stage's ops in train_batch call ``call`` (0-based) of a run whose earliest live
        batch is ``first_batch`` (batches before it were drained)."""
        for op in self.ops(stage):
            if call + op.batch >= first_batch:
                yield op

    def drain_ops(self, stage: int, next_call: int, first_batch: int = 0) -> Iterator[Op]:
        """The stage's drain ops after ``next_call`` calls (batches >= first_batch only)."""
        for step in (self.drain or [[] for _ in range(self.stages)])[stage]:
            for op in step:
                if next_call + op.batch >= first_batch:
                    yield op

    @property
    def num_steps(self) -> int:
        return len(self.streams[0]) if self.streams else 0

    def ops(self, stage: int) -> Iterator[Op]:
        """The stage's ops in execution order."""
        for step in self.streams[stage]:
            yield from step

    def compact(self) -> str:
        """Every stage's stream in compact notation, one line per stage, steps joined by ' | '
        (empty steps as '.'): F3 / B3 / FB3 compute (F3.1: on chunk 1; v-1: its weight version), sA3 / rA3 / sG3 /
        rG3 p2p (non-blocking sends marked '~'), other ops by name, @-1: an op of the previous
        call's batch; continuous schedules add their drain. Golden
        files of the built-in schedules (tests/golden/) are written in it."""

        def ops(step) -> str:
            return (
                " ".join(
                    op_name(op)
                    + ("~" if op.kind in SEND_KINDS and not op.blocking else "")
                    + (f"v{op.version:+d}" if op.kind in COMPUTE_KINDS and op.version is not None else "")
                    + (f"@{op.batch:+d}" if op.batch else "")
                    for op in step
                )
                or "."
            )

        chunks = f" v={self.virtual_stages} layout={self.layout_kind}" if self.virtual_stages > 1 else ""
        lines = [f"{self.name} K={self.stages} M={self.micro_batches}{chunks} params={self.params}"]
        for s in range(self.stages):
            lines.append(f"{s}: " + " | ".join(ops(step) for step in self.streams[s]))
        for s in range(self.stages) if self.continuous and self.drain else ():
            lines.append(f"{s} drain: " + " | ".join(ops(step) for step in self.drain[s]))
        return "\n".join(lines) + "\n"

    def describe(self, stage: int | None = None) -> str:
        """Human-readable listing, one line per non-empty step."""
        lines = [
            f"schedule {self.name}: {self.stages} stages, {self.micro_batches} micro-batches, "
            f"{self.num_steps} steps, params {self.params}"
        ]
        for s in range(self.stages) if stage is None else [stage]:
            lines.append(f"stage {s} ({self.num_buffers[s]} buffers):")
            for t, step in enumerate(self.streams[s]):
                if step:
                    lines.append(f"  step {t:3d}: " + "  ".join(str(op) for op in step))
            if self.continuous and self.drain and any(self.drain[s]):
                lines.append("  drain (engine.drain(): completes the batches still in flight):")
                for t, step in enumerate(self.drain[s]):
                    if step:
                        lines.append(f"  step {t:3d}: " + "  ".join(str(op) for op in step))
        return "\n".join(lines)


def op_name(op: Op) -> str:
    """The name of an op in timelines: F3 / B3 for micro-batch ops, the kind (and target or
    version) for the rest."""
    if op.micro_batch is not None:
        return op.label
    if op.version is not None:
        return f"{op.kind.value}(v{op.version:+d})"
    if op.target == "chunk":
        return f"{op.kind.value}(chunk {op.chunk})"
    return f"{op.kind.value}({op.target})" if op.target else op.kind.value
