"""``HippiePipelineEngine``: DeepSpeed's ``PipelineEngine`` running any declared schedule.

This file holds the class, its loop (``_exec_schedule`` -> ``_exec_steps``: each instruction with
its op) and its overrides of DeepSpeed's methods; its parts in this package hold the handlers the
instruction map calls: :mod:`~hippie_ds.adapter.engine.handlers` (the components' instructions and
the split backward), :mod:`~hippie_ds.adapter.engine.p2p` (sends and receives),
:mod:`~hippie_ds.adapter.engine.chunks` (virtual stages' overrides) and
:mod:`~hippie_ds.adapter.engine.checkpoint` (``save_checkpoint`` / ``load_checkpoint``). The
components each own their state and are built with what they use (:mod:`~hippie_ds.adapter.engine.build`):
:class:`~hippie_ds.adapter.gradients.stage.StageGradients` (all-reduces, gradient buffer, partial
deferral), :class:`~hippie_ds.adapter.staleness.versions.WeightVersions` (weight versions) with
:mod:`~hippie_ds.adapter.staleness.prediction` (the staleness correction),
:class:`~hippie_ds.adapter.gradients.split.SplitBackward`, the per-stage step
(:class:`~hippie_ds.adapter.precision.step.StageStep`: every swap a step makes, in one context
manager), virtual stages' per-chunk state (:class:`~hippie_ds.adapter.engine.chunk_selector.ChunkSelector`),
the continuous schedules' call cursor (:class:`~hippie_ds.adapter.engine.call_cursor.CallCursor`)
and the checkpoint's in-flight state (:class:`~hippie_ds.adapter.checkpoint.in_flight.TrainingState`).
No component reads the engine's private attributes. Handlers receive what they need as
instruction arguments, as DeepSpeed's do. What it changes, and why:
- ``_train_schedule`` returns the compiled, validated declaration instead of ``TrainSchedule``;
- the loss lives in per-buffer slots (the stock engine keeps one, so any order but strict
  F(m)->B(m) on the last stage breaks: DeepSpeed issue #3900). The received gradient keeps
  DeepSpeed's single slot: the compiler puts every recv_grad in its backward's step, and the
  start-up refuses a schedule that would receive another gradient before using the one it holds;
- handlers for the new instructions (the op table, :mod:`hippie_ds.schedules.ir`); the gradient buffer is checkpointed;
- deferred stages, and 2bw's stages, correct for their one-step delay (``hippie.staleness``,
  :mod:`hippie_ds.adapter.staleness.prediction`): compute runs on predicted weights, the update applies to the true ones;
- continuous schedules (2bw, pipedream: the pipeline stays full across ``train_batch`` calls): ops of
  batches in flight run in the next call, ``drain()`` completes them; weight versions (adapter/staleness/versions.py);
- a public hook called after each instruction (``add_instruction_hook``); the timeline is one.

Per-stage update semantics (``StageOptimizerStep`` / ``ApplyBufferedUpdate``): the gradient
norm used for clipping (and bf16's overflow check) is this stage's own norm, reduced over the
stage's tensor-slice group only, not over the pipeline: a stage that updates early cannot wait
for the others, and a deferred stage applies last step's gradient. DeepSpeed's ``OptimizerStep``
(1f1b, gpipe) keeps the stock pipeline-wide norm.
"""
from __future__ import annotations

import atexit
import os
import weakref
from types import MethodType

import torch

from ..._compat import check_deepspeed
from ...schedules.deferral import Deferral
from ...schedules.ir import COMPUTE_KINDS, CompiledSchedule
from ..checkpoint.in_flight import TrainingState
from ..ds import engine as ds_engine
from ..module.tensor_calls import tensor_bytes
from ..process.failure import end_job_on_failure
from ..profiling.timeline import InstructionEvent, Timeline, compute_clock
from . import instructions as hs
from .build import build, flush_buffered
from .call_cursor import CallCursor
from .checkpoint import CheckpointMixin, warn_in_flight_at_exit
from .chunks import ChunkedEngine
from .handlers import ComponentHandlers
from .p2p import P2PHandlers

check_deepspeed()

__all__ = ["HippiePipelineEngine"]


class HippiePipelineEngine(CheckpointMixin, ComponentHandlers, P2PHandlers, ChunkedEngine, ds_engine.PipelineEngine):
    """A ``PipelineEngine`` whose training schedule is a compiled hippie-ds declaration. This file holds
    its loop and its overrides of DeepSpeed's methods (each docstring names the one it overrides)
    and its public methods; the handlers are its parts in adapter/engine/ (``handlers.py``,
    ``p2p.py``, ``chunks.py``, ``checkpoint.py``), the components are built in ``build.py``."""

    _split = None  # DeepSpeed's __init__ runs before the components are built

    def __init__(self, *args, compiled_schedule: CompiledSchedule, timeline_dir: str | None = None,
                 timeline_steps: int = 100, staleness=None, deferral: Deferral | None = None, **kwargs):
        """Overrides ``PipelineEngine.__init__`` (calls it), then builds the components (build.py)."""
        self.compiled_schedule = compiled_schedule
        super().__init__(*args, **kwargs)
        if compiled_schedule.stages != self.num_stages or compiled_schedule.micro_batches != self.micro_batches:
            raise ValueError(f"schedule compiled for {compiled_schedule.stages} stages x "
                             f"{compiled_schedule.micro_batches} micro-batches, engine has {self.num_stages} x "
                             f"{self.micro_batches}")
        self._declared = hs.DeclaredSchedule(compiled_schedule, self.stage_id)
        self._init_chunks(compiled_schedule)  # virtual stages: the per-chunk state (chunk_selector)
        self._losses: dict[int, object] = {}
        self._pending_sends: list = []
        self._timeline_dir = timeline_dir
        self._timeline = Timeline(timeline_steps, compute_clock(self.device))  # its `now` times every instruction
        self._hooks: list = [self._timeline] if timeline_dir is not None else []
        self._batch_index = 0
        self._training = False  # hooks see train_batch and drain only
        # continuous schedules: where the calls stand (call_cursor); weight versions (module docstring)
        self._continuous = compiled_schedule.continuous
        self._cursor = CallCursor()

        def early_allreduce():  # the timeline marks an all-reduce started inside a backward
            if self._timeline_dir is not None and self._training:
                self._timeline.mark_start("grads")
        parts = build(self, compiled_schedule, staleness, deferral, early_allreduce)
        self._params, self._versions, self._gradients = parts.params, parts.versions, parts.gradients
        self._stage_step, self._updates, self._split, self._tied = parts.step, parts.updates, parts.split, parts.tied
        self._in_flight = TrainingState(self.module, self._gradients, self._versions, self._cursor, self._continuous,
                                        self.stage_id, self.device)  # what a checkpoint saves and restores
        atexit.register(warn_in_flight_at_exit, weakref.ref(self))

    def add_instruction_hook(self, hook):
        """Call ``hook(event)`` (:class:`~hippie_ds.adapter.profiling.timeline.InstructionEvent`) after each
        instruction ``train_batch`` and ``drain`` run here, in order; returns its remover. With a
        hook the engine reads its compute clock around each instruction (CUDA: a stream sync)."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook) if hook in self._hooks else None

    # ------------------------------------------------------------------ schedule
    def _train_schedule(self):
        """Overrides ``PipelineEngine._train_schedule``: the compiled declaration, not ``TrainSchedule``."""
        return self._declared

    def _exec_schedule(self, pipe_schedule):
        """Overrides ``PipelineEngine._exec_schedule``: DeepSpeed's loop, each instruction with its op."""
        # DeepSpeed's loop, with each instruction's op (instructions.op_steps), plus an optional timeline.
        ds_engine.reserve_pipe_buffers(self, pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._exec_steps(hs.op_steps(pipe_schedule))

    def _exec_steps(self, steps):
        try:
            self._exec_steps_of(steps)
        finally:
            self._chunks.select(None)  # outside ops DeepSpeed sees the stage as one part (the loss broadcast)
            self._versions.hold_current()  # the module holds true weights between calls (staleness/versions.py)

    def _exec_steps_of(self, steps):
        """Run steps of (instruction, op) pairs (op None: an instruction of DeepSpeed's own schedules)."""
        hooks = list(self._hooks) if self._training else []
        for step in steps:
            for cmd, op in step:
                if op is not None and not self._before(op):
                    continue
                handler = ds_engine.handler_of(self, cmd)
                if handler is None:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
                start = self._timeline.now() if hooks else 0.0
                try:
                    MethodType(handler, self)(**cmd.kwargs)
                except BaseException as exc:  # the others would wait for this rank: end the job now
                    end_job_on_failure(exc, self.global_rank, f"stage {self.stage_id}'s {cmd!r}")
                    raise
                if hooks:
                    event = InstructionEvent(type(cmd).__name__, op, start, self._timeline.now(),
                                             self._batch_index, cmd)
                    for hook in hooks:
                        hook(event)

    def _before(self, op) -> bool:
        """Before an op's handler (which takes its kwargs only): False skips it (a batch not there, filling
        or drained); else its model chunk is selected and a versioned compute op gets its weights."""
        if self._continuous and self._training and self._cursor.skips(op.batch):
            return False
        if op.micro_batch is not None:
            self._chunks.select(op.chunk)
        if self._versions.versioned and op.kind in COMPUTE_KINDS and op.version is not None:
            self._updates.before_use(self._abs_version(op.batch, op.version))  # fp16: held updates decided
            self._versions.use_for_compute(self._abs_version(op.batch, op.version))
        return True

    def _abs_version(self, batch: int, version: int, clamp: bool = True) -> int:
        """Absolute weight version of an op of ``batch`` (relative to the running call)."""
        return self._versions.absolute(self._cursor.batch(batch), version, clamp)

    def train_batch(self, data_iter=None):
        """Overrides ``PipelineEngine.train_batch`` (calls it): a deferred stage computes on predicted
        weights; a continuous schedule's call advances the counters once and keeps its learning rates."""
        self._training = True
        self._cursor.start()
        self._gradients.count_backwards_from_zero()
        prediction = self._gradients.prediction
        try:
            if not self._continuous:
                if prediction is not None:
                    prediction.predict()  # restored by apply_buffered_update, before the step
                return super().train_batch(data_iter)
            # Updates of a continuous schedule keep the step counters still; the call advances
            # them once, on every stage alike (checkpoint tags and LR schedules count batches).
            # A batch's updates take the learning rates set for its call (kept while in flight).
            self._cursor.keep_lrs([g["lr"] for g in self.optimizer.param_groups])
            loss = super().train_batch(data_iter)
            self._stage_step.bookkeeping()
            self._cursor.advance()
            return loss
        finally:
            if prediction is not None:
                prediction.restore()  # no-op after a normal step; a failed one keeps true weights
            self._training = False
            self._timeline.keep_after(self._batch_index)
            self._batch_index += 1

    # ------------------------------------------------------------------ continuous schedules
    def drain(self) -> bool:
        """Complete every batch still in flight (continuous schedules: the last backwards and
        updates of the last ``train_batch``), so that every micro-batch read is applied exactly
        once; call it on every rank at the end of training. The math does not depend on where drains
        happen (weight versions are declared): training may go on, the next call fills the pipeline.
        For the hippie family it applies the buffered gradient (a collective of the stage's
        data-parallel group: on every rank); step counters and the LR schedule stay. True if anything was done."""
        if not self._continuous:
            return flush_buffered(self._gradients, self._stage_step, self._tied)
        if not self._cursor.in_flight:
            return False
        self._training = True
        self._cursor.start()  # drain ops' batches are relative to the call that would come next
        try:
            self._exec_steps(self._declared.drain.op_steps())
            self._updates.drained()  # fp16: every update still held, decided and applied
        finally:
            self._training = False
        self._cursor.drained()
        return True

    def has_pending_update(self) -> bool:
        """True when this stage holds a buffered gradient not yet applied."""
        return self._gradients.has_pending_update()

    def delayed_fraction(self) -> float:
        """The fraction of this stage's gradient (by elements) that is applied one step late."""
        return self._gradients.delayed_fraction()

    def weight_versions(self) -> dict:
        """This stage's weight versions: current (updates applied), stashed, the most held at once."""
        return self._versions.summary()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this stage keeps between ``train_batch`` calls beside its parameters, their gradients and
        the optimizer's state, by kind (``gradient_buffer``, ``tie_sums``, ``prediction``,
        ``weight_versions``): the tensors themselves, nothing copied or communicated. For memory
        probes, e.g. the bench's count."""
        held: dict[str, list[torch.Tensor]] = {}
        for part in (self._gradients.held_tensors(), self._versions.held_tensors()):
            for kind, tensors in part.items():
                held.setdefault(kind, []).extend(tensors)
        return held

    def has_in_flight(self) -> bool:
        """True when batches of a continuous schedule are still in flight (``drain()`` has work)."""
        return self._cursor.in_flight

    def eval_batch(self, *args, **kwargs):
        """Overrides ``PipelineEngine.eval_batch`` (calls it), after ``drain()`` on a continuous schedule."""
        self.drain() if self._continuous else None  # evaluation reuses the pipe buffers: in-flight batches first
        return super().eval_batch(*args, **kwargs)

    def timeline(self) -> tuple[float, list[dict]]:
        """(t0, events): this rank's executed instructions of the last ``timeline_steps`` calls, each
        ``{"name", "kind", "start", "end", "step", ...}`` in seconds since t0 (what ``write_timeline`` writes)."""
        return self._timeline.t0, list(self._timeline)

    def write_timeline(self, path: str | None = None) -> str | None:
        """Write this rank's timeline (JSON) of the last ``timeline_steps`` calls; returns the path."""
        if self._timeline_dir is None and path is None:
            return None
        return self._timeline.write(path or os.path.join(self._timeline_dir, f"rank{self.global_rank}.json"),
                                    rank=self.global_rank, stage=self.stage_id,
                                    data_parallel_id=self.grid.data_parallel_id, schedule=self.compiled_schedule.name,
                                    param_bytes=tensor_bytes(self._params))

    # ------------------------------------------------------------------ per-buffer slots
    def _exec_forward_pass(self, buffer_id):
        """Overrides ``PipelineEngine._exec_forward_pass`` (calls it): the loss kept in its buffer's slot."""
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            self._losses[buffer_id] = self.loss

    def _exec_backward_pass(self, buffer_id):
        """Overrides ``PipelineEngine._exec_backward_pass`` (calls it): the buffer's loss; partial deferral's
        early all-reduce window."""
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        with self._gradients.early_allreduce_window():  # partial deferral (gradients/stage.py)
            super()._exec_backward_pass(buffer_id)

    def _exec_forward_backward_pass(self, buffer_id):
        """The handler of ``ForwardBackwardPass`` (DeepSpeed's ``_INSTRUCTION_MAP``): DeepSpeed's forward and backward."""
        self._exec_forward_pass(buffer_id)
        self._exec_backward_pass(buffer_id)
        # The loss stage is done with this micro-batch: drop its output before the next one.
        self.pipe_buffers["outputs"][buffer_id] = None

    def count_split_state_in(self, meter) -> None:
        """Also count in ``meter`` (a :class:`hippie_ds.adapter.profiling.memory.ActivationMeter`) what
        backward_input keeps for backward_weight beyond the graph's saved tensors: the gradients at
        the parameter ops (benchmarks compare it with the simulator's memory held until W)."""
        self._split.meter = meter


# class -> handler, built from the op table (OP_INFO's handler names) over DeepSpeed's own map
ds_engine.set_instruction_map(HippiePipelineEngine,
                              hs.instruction_map(HippiePipelineEngine, ds_engine.stock_instruction_map()))
