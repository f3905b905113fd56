"""One rank's stage runtime (:class:`StageRuntime`): what a pipeline stage owns beside DeepSpeed's own
state, and the loop that runs its compiled ops. As torch's ``PipelineStage`` beside its schedule
runtime: it holds the components (gradients and their store, weight versions and the staleness
correction, the per-stage step, the split backward, the chunks, the call cursor, the timeline, the
in-flight checkpoint state), runs each op with its kind's handler (:mod:`~hippie_ds.adapter.stage.handlers`)
and reaches DeepSpeed's buffers and handlers only through :class:`~hippie_ds.adapter.ds.stage.DeepSpeedStage`.
``HippiePipelineEngine`` builds one after DeepSpeed's ``__init__`` and delegates to it."""

from __future__ import annotations

import functools
from typing import Callable

from ...schedules.ir import COMPUTE_KINDS, CompiledSchedule
from ..checkpoint import state as ckpt
from ..checkpoint.in_flight import TrainingState
from ..ds.stage import DeepSpeedStage
from ..process.failure import end_job_on_failure
from ..profiling.timeline import InstructionEvent, Timeline
from . import instructions as hs
from .build import Components, flush_buffered
from .call_cursor import CallCursor
from .chunk_selector import ChunkSelector
from .handlers import handler_of
from .p2p import wait_sends


class StageRuntime:
    """A stage's components and its instruction loop, built once per rank from explicit inputs:
    DeepSpeed's side of the stage (``ds``), the compiled schedule, the components (``parts``, built
    by :func:`~hippie_ds.adapter.stage.build.build`), the chunk selector, the module's chunk
    parameters and the timeline (``timeline_dir`` None: recorded for ``timeline()`` only, no hook)."""

    def __init__(
        self,
        ds: DeepSpeedStage,
        compiled: CompiledSchedule,
        parts: Components,
        chunks: ChunkSelector,
        cursor: CallCursor,
        in_flight: TrainingState,
        chunk_parameters: Callable[[int], list],
        timeline: Timeline,
        timeline_dir: str | None,
    ):
        self.ds, self.compiled, self.chunks, self.cursor, self.in_flight = ds, compiled, chunks, cursor, in_flight
        self.declared = hs.DeclaredSchedule(compiled, ds.stage_id)
        self.continuous = compiled.continuous
        self.params, self.versions, self.gradients = parts.params, parts.versions, parts.gradients
        self.stage_step, self.updates, self.split, self.tied = parts.step, parts.updates, parts.split, parts.tied
        self.chunk_parameters = chunk_parameters
        self.losses: dict[int, object] = {}  # the last stage's loss per pipe buffer (handlers.forward)
        self.pending_sends: list = []  # (work, tensor) of non-blocking sends, until wait_sends
        self.timeline, self.timeline_dir = timeline, timeline_dir
        self.hooks: list = [timeline] if timeline_dir is not None else []
        self.train_batch_hooks: list = []  # add_train_batch_hook's, outermost first
        self.batch_index = 0  # train_batch calls so far
        self.training = False  # hooks see train_batch and drain only
        self.checkpointed_batch: int | None = None  # batch_index at the last save_checkpoint

    # ------------------------------------------------------------------ the loop
    def run(self, pipe_schedule) -> None:
        """Roughly: DeepSpeed's ``_exec_schedule``: the buffers reserved, then every instruction with its op."""
        self.ds.start_schedule(pipe_schedule.num_pipe_buffers())
        self.run_steps(hs.op_steps(pipe_schedule))

    def run_steps(self, steps) -> None:
        try:
            self._run_steps(steps)
        finally:
            self.chunks.select(None)  # outside ops DeepSpeed sees the stage as one part (the loss broadcast)
            self.versions.hold_current()  # the module holds true weights between calls (staleness/versions.py)

    def _run_steps(self, steps) -> None:
        """Run steps of (instruction, op) pairs (op None: an instruction of DeepSpeed's own schedules,
        run by DeepSpeed's handler)."""
        hooks = list(self.hooks) if self.training else []
        for step in steps:
            for cmd, op in step:
                if op is not None and not self._before(op):
                    continue
                start = self.timeline.now() if hooks else 0.0
                try:
                    if op is None:
                        self.ds.run_stock(cmd)
                    else:
                        handler_of(op)(self, **cmd.kwargs)
                except BaseException as exc:  # the others would wait for this rank: end the job now
                    end_job_on_failure(exc, self.ds.global_rank, f"stage {self.ds.stage_id}'s {cmd!r}")
                    raise
                if hooks:
                    event = InstructionEvent(type(cmd).__name__, op, start, self.timeline.now(), self.batch_index, cmd)
                    for hook in hooks:
                        hook(event)

    def _before(self, op) -> bool:
        """Before an op's handler: False skips it (a batch not there, filling or drained); else its model
        chunk is selected and a versioned compute op gets its weights."""
        if self.continuous and self.training and self.cursor.skips(op.batch):
            return False
        if op.micro_batch is not None:
            self.chunks.select(op.chunk)
        if self.versions.versioned and op.kind in COMPUTE_KINDS and op.version is not None:
            self.updates.before_use(self.abs_version(op.batch, op.version))  # fp16: held updates decided
            self.versions.use_for_compute(self.abs_version(op.batch, op.version))
        return True

    def abs_version(self, batch: int, version: int, clamp: bool = True) -> int:
        """Absolute weight version of an op of ``batch`` (relative to the running call)."""
        return self.versions.absolute(self.cursor.batch(batch), version, clamp)

    def early_allreduce_started(self) -> None:
        """An all-reduce started inside a backward (partial deferral): the timeline marks it."""
        if self.timeline_dir is not None and self.training:
            self.timeline.mark_start("grads")

    # ------------------------------------------------------------------ calls
    def train_batch(self, run_deepspeed: Callable[[], object]):
        """Around DeepSpeed's ``train_batch`` (``run_deepspeed``), inside the train-batch hooks: a deferred
        stage computes on predicted weights; a continuous schedule's call advances the counters once and
        keeps its learning rates."""
        run = functools.partial(self._train_batch, run_deepspeed)
        for hook in reversed(self.train_batch_hooks):
            run = functools.partial(hook, run)
        return run()

    def _train_batch(self, run_deepspeed: Callable[[], object]):
        self.training = True
        self.cursor.start()
        self.gradients.count_backwards_from_zero()
        prediction = self.gradients.prediction
        try:
            if not self.continuous:
                if prediction is not None:
                    prediction.predict()  # restored by apply_buffered_update, before the step
                return run_deepspeed()
            # Updates of a continuous schedule keep the step counters still; the call advances
            # them once, on every stage alike (checkpoint tags and LR schedules count batches).
            # A batch's updates take the learning rates set for its call (kept while in flight).
            self.cursor.keep_lrs([g["lr"] for g in self.ds.param_groups()])
            loss = run_deepspeed()
            self.stage_step.bookkeeping()
            self.cursor.advance()
            return loss
        finally:
            if prediction is not None:
                prediction.restore()  # no-op after a normal step; a failed one keeps true weights
            self.training = False
            self.timeline.keep_after(self.batch_index)
            self.batch_index += 1

    def drain(self) -> bool:
        """``HippiePipelineEngine.drain``: every batch in flight completed, or the buffered gradient applied."""
        if not self.continuous:
            return flush_buffered(self.gradients, self.stage_step, self.tied)
        if not self.cursor.in_flight:
            return False
        self.training = True
        self.cursor.start()  # drain ops' batches are relative to the call that would come next
        try:
            self.run_steps(self.declared.drain.op_steps())
            self.updates.drained()  # fp16: every update still held, decided and applied
        finally:
            self.training = False
        self.cursor.drained()
        return True

    def eval_batch(self, run_deepspeed: Callable[[], object]):
        """Around DeepSpeed's ``eval_batch``: a continuous schedule's batches in flight complete first
        (evaluation reuses the pipe buffers)."""
        if self.continuous:
            self.drain()
        return run_deepspeed()

    def backward_prologue(self, grad, stock: Callable):
        """DeepSpeed's output hook on each output gradient (``stock``: it divides by the accumulation
        steps), skipped where the split backward's input pass divided the loss itself."""
        return grad if self.split.loss_scaled else stock(grad)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save: Callable[[dict], object], client_state: dict):
        """Around DeepSpeed's ``save_checkpoint`` (``save(client_state)``), with the in-flight state."""
        # Continuous schedules: drain the batches in flight first (activations cannot be saved;
        # the math does not depend on the drain), then save the weight versions still needed.
        if self.continuous:
            self.drain()
        # The pending gradient is part of the training state: its all-reduce finishes first.
        wait_sends(self)
        saved = save(self.in_flight.gather(client_state))
        self.checkpointed_batch = self.batch_index  # it holds the in-flight state until the next train_batch
        return saved

    def load_checkpoint(self, load: Callable[[], tuple], load_dir, tag, load_optimizer_states: bool):
        """Around DeepSpeed's ``load_checkpoint`` (``load()``), then hippie-ds's state: a checkpoint of another
        stage layout is refused with the optimizer state (it cannot follow by layer)."""
        self.gradients.wait_buffer()
        changed, why = self.in_flight.layout_change(load_dir, tag)
        if changed and load_optimizer_states:
            raise ValueError(f"load_checkpoint({str(load_dir)!r}): {why}")
        with ckpt.loading():
            path, client_state = load()
        if client_state is not None:
            self.in_flight.restore(client_state, load_dir, changed)
        return path, client_state

    def saved_since_training(self) -> bool:
        """The last ``save_checkpoint`` came after the last ``train_batch``: it holds what is in flight."""
        return self.checkpointed_batch == self.batch_index

    def in_flight_at_exit(self) -> str | None:
        """What is in flight and neither applied nor saved (the exit warning's subject), or None."""
        if self.saved_since_training():
            return None
        return (
            "batches in flight"
            if self.cursor.in_flight
            else "the last step's delayed gradient"
            if self.gradients.has_pending_update()
            else None
        )

    # ------------------------------------------------------------------ what a stage reports
    def held_tensors(self) -> dict[str, list]:
        """``HippiePipelineEngine.held_tensors``: what the stage keeps between calls, by kind."""
        held: dict[str, list] = {}
        for part in (self.gradients.held_tensors(), self.versions.held_tensors()):
            for kind, tensors in part.items():
                held.setdefault(kind, []).extend(tensors)
        return held
