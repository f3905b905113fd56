"""``HippiePipelineEngine``: DeepSpeed's ``PipelineEngine`` running any declared schedule.

The engine wires components that each own their state, behind named interfaces:
:class:`~hippie_ds.adapter.gradients.stage.StageGradients` (all-reduces, gradient buffer, partial
deferral), :class:`~hippie_ds.adapter.staleness.versions.WeightVersions` (weight versions),
:mod:`~hippie_ds.adapter.staleness.prediction` (the one staleness correction), the split backward
(:mod:`~hippie_ds.adapter.engine.split`), the per-stage step (:class:`~hippie_ds.adapter.precision.step.StageStep`:
every swap a step makes, in one context manager), virtual stages' per-chunk state
(:class:`~hippie_ds.adapter.engine.chunk_selector.ChunkSelector`), the continuous schedules' call cursor
(:class:`~hippie_ds.adapter.engine.call_cursor.CallCursor`) and checkpoint I/O (:mod:`~hippie_ds.adapter.engine.checkpoint`);
with them, the only modules that touch DeepSpeed's engine internals. Handlers receive what they
need as instruction arguments, as DeepSpeed's do. What it changes, and why:
- ``_train_schedule`` returns the compiled, validated declaration instead of ``TrainSchedule``;
- the loss lives in per-buffer slots (the stock engine keeps one, so any order but strict
  F(m)->B(m) on the last stage breaks: DeepSpeed issue #3900). The received gradient keeps
  DeepSpeed's single slot: the compiler puts every recv_grad in its backward's step, and the
  engine refuses a schedule that would receive another gradient before using the one it holds;
- handlers for the new instructions (the op table, :mod:`hippie_ds.schedules.ir`); the gradient buffer is checkpointed;
- deferred stages, and 2bw's stages, correct for their one-step delay (``hippie.staleness``,
  :mod:`hippie_ds.adapter.staleness.prediction`): compute runs on predicted weights, the update applies to the true ones;
- continuous schedules (2bw, pipedream: the pipeline stays full across ``train_batch`` calls): ops of
  batches in flight run in the next call, ``drain()`` completes them; weight versions (engine_versions);
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
from ..ds import engine as ds_engine, module as ds_module

from ..._compat import check_deepspeed
from ...schedules.ir import COMPUTE_KINDS, GRAD_RECEIVING_KINDS, RECV_GRAD_KINDS, WHOLE_BACKWARD_KINDS, CompiledSchedule
from ...schedules.deferral import Deferral
from . import instructions as hs
from ..gradients.allreduce_stream import AllReduceStream
from .call_cursor import CallCursor
from .checkpoint import CheckpointMixin, warn_in_flight_at_exit
from . import chunk_selector as chunk_p2p
from .chunks import ChunkedEngine
from ..gradients.stage import StageGradients, split_deferred
from .split import SplitBackwardMixin
from ..precision.step import StageStep
from ..staleness.versions import WeightVersions
from ..process.failure import end_job_on_failure
from ..precision.fp16_async import continuous_updates
from ..gradients.store import GradStore
from ..gradients.split_backward import copy_if_shared, storages_of
from ..staleness.prediction import make_prediction
from ..profiling.timeline import InstructionEvent, Timeline, compute_clock
from ..module.tensor_calls import tensor_bytes
from ..gradients.tied import LaggedTieSums, tie_sum_lag

check_deepspeed()

__all__ = ["HippiePipelineEngine", "check_single_grad_slot"]


def check_single_grad_slot(compiled: CompiledSchedule, stage: int) -> None:
    """DeepSpeed receives gradients into one reused tensor (``grad_layer``; one per model chunk
    with virtual stages, engine_chunks): a stage must run a chunk's micro-batch's backward before
    it receives that chunk's next gradient."""
    holding: dict[int, int] = {}  # chunk -> the micro-batch whose received gradient it holds
    for op in compiled.ops(stage):
        if op.kind in RECV_GRAD_KINDS:
            if op.chunk in holding:
                raise ValueError(f"schedule {compiled.name!r} stage {stage} step {op.step}: receives the gradient of "
                                 f"micro-batch {op.micro_batch} before the backward of micro-batch "
                                 f"{holding[op.chunk]}; hippie-ds receives a gradient in the step of its backward")
            holding[op.chunk] = op.micro_batch
        elif op.kind in GRAD_RECEIVING_KINDS and holding.get(op.chunk) == op.micro_batch:
            del holding[op.chunk]


class HippiePipelineEngine(CheckpointMixin, SplitBackwardMixin, ChunkedEngine, ds_engine.PipelineEngine):
    """A ``PipelineEngine`` whose training schedule is a compiled hippie-ds declaration."""

    def __init__(self, *args, compiled_schedule: CompiledSchedule, timeline_dir: str | None = None,
                 timeline_steps: int = 100, staleness=None, deferral: Deferral | None = None, **kwargs):
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
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._versions = self._make_versions(compiled_schedule, staleness)
        self._gradients, self._stage_step = self._make_gradients(compiled_schedule, staleness,
                                                                 deferral or Deferral({}))
        self._init_split_backward(compiled_schedule)
        self._updates = continuous_updates(self, compiled_schedule, self._versions, self._stage_step)  # fp16: votes
        atexit.register(warn_in_flight_at_exit, weakref.ref(self))

    def _make_versions(self, compiled: CompiledSchedule, staleness) -> WeightVersions:
        # 2bw's stages compute one update behind: corrected per version (hippie.staleness)
        behind = compiled.versioned and compiled.one_version_behind(self.stage_id)
        return WeightVersions(self._params, self.stage_id,
                              compiled.updates_per_batch[self.stage_id] if compiled.continuous else 0,
                              compiled.versioned, make_prediction(staleness) if behind else None)

    def _tied_weights(self, keys=None) -> list[tuple[torch.Tensor, object]]:
        """(weight, tie group) of this stage's tied modules (``keys``: only those), in DeepSpeed's
        order, the same on every holder."""
        return [(ds_module.recursive_getattr(self.module, self.module.tied_modules[key], attr), comm["group"])
                for key, comm in self.module.tied_comms.items() if keys is None or key in keys
                for attr in comm["weight_attr"]]

    def _make_gradients(self, compiled: CompiledSchedule, staleness,
                        deferral: Deferral) -> tuple[StageGradients, StageStep]:
        deferred = not compiled.continuous and self.stage_id in compiled.deferred_stages()
        # schedules without reduce_tied_grads sum tied gradients themselves (adapter/gradients/tied.py)
        ties = [] if compiled.uses_tied_reduction else self._tied_weights()
        store = GradStore(self.optimizer, self._params)
        # never flushing: the tie sum lags (tie_sum_lag updates), clipped apart from the rest (adapter/gradients/tied.py)
        lagged = (LaggedTieSums(store, ties, tie_sum_lag(self.module, compiled), self.grid.get_data_parallel_group(),
                                self.grid.data_parallel_id) if ties and compiled.continuous else None)
        if lagged is not None:
            ties = []
        clip_group = ties[0][1] if ties else None  # check_tied: one tie group per stage
        delayed, synced = (split_deferred(self._params, self.module.forward_funcs, self.module.parts[self.stage_id],
                                          deferral.stages.get(self.stage_id),
                                          also=[w for w, _ in self._tied_weights(deferral.tied_delayed)])
                           if deferred else ([], self._params))
        gradients = StageGradients(
            store,
            AllReduceStream(self.device, self.grid.get_data_parallel_group(), self.dp_world_size,
                            self.communication_data_type),
            reduce=self.is_data_parallel, deferred=deferred, delayed=delayed, synced=synced, ties=ties,
            lagged_ties=lagged, tie_clip=self.gradient_clipping(),
            backwards_per_call=sum(op.kind in WHOLE_BACKWARD_KINDS for op in compiled.ops(self.stage_id)),
            prediction=make_prediction(staleness, delayed) if deferred and delayed else None,
            on_early_start=self._mark_early_allreduce)
        if deferred and self.grid.data_parallel_id == 0:
            gradients.log_delayed_share(self.stage_id)
        return gradients, StageStep(self, store, clip_group, gradients.clips_itself, compiled)

    def _mark_early_allreduce(self):
        if self._timeline_dir is not None and self._training:
            self._timeline.mark_start("grads")

    def add_instruction_hook(self, hook):
        """Call ``hook(event)`` (:class:`~hippie_ds.adapter.profiling.timeline.InstructionEvent`) after each
        instruction ``train_batch`` and ``drain`` run here, in order; returns its remover. With a
        hook the engine reads its compute clock around each instruction (CUDA: a stream sync)."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook) if hook in self._hooks else None

    # ------------------------------------------------------------------ schedule
    def _train_schedule(self):
        return self._declared

    def _exec_schedule(self, pipe_schedule):
        # DeepSpeed's loop, with each instruction's op (instructions.op_steps), plus an optional timeline.
        ds_engine.reserve_pipe_buffers(self, pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._exec_steps(hs.op_steps(pipe_schedule))

    def _exec_steps(self, steps):
        try:
            self._exec_steps_of(steps)
        finally:
            self._chunks.select(None)  # outside ops DeepSpeed sees the stage as one part (the loss broadcast)
            self._versions.hold_current()  # the module holds true weights between calls (engine_versions)

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

    def train_batch(self, data_iter=None):
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
            return self._flush_buffered()
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

    def has_in_flight(self) -> bool:
        """True when batches of a continuous schedule are still in flight (``drain()`` has work)."""
        return self._cursor.in_flight

    def eval_batch(self, *args, **kwargs):
        self.drain() if self._continuous else None  # evaluation reuses the pipe buffers: in-flight batches first
        return super().eval_batch(*args, **kwargs)

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
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            self._losses[buffer_id] = self.loss

    def _exec_backward_pass(self, buffer_id):
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        with self._gradients.early_allreduce_window():  # partial deferral (engine_gradients)
            super()._exec_backward_pass(buffer_id)

    def _exec_forward_backward_pass(self, buffer_id):
        self._exec_forward_pass(buffer_id)
        self._exec_backward_pass(buffer_id)
        # The loss stage is done with this micro-batch: drop its output before the next one.
        self.pipe_buffers["outputs"][buffer_id] = None

    # ------------------------------------------------------------------ non-blocking sends
    def _isend(self, tensor, stage, tag=chunk_p2p.ACTIVATION_TAG):
        # Keep the tensor with its work handle: the buffer slot may be reused before completion.
        # A detached alias (same storage): an output the split backward cannot detach in place
        # (a view) must not keep its micro-batch's graph alive until the sends are waited for.
        work = chunk_p2p.isend(self.grid, tensor, stage, tag)
        self._pending_sends.append((work, torch.Tensor.detach(tensor)))

    def _exec_isend_activations(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.has_attention_mask or self.has_bool_tensors:
            outputs = tuple(outputs[:-1]) + (torch.Tensor.half(outputs[-1]), )
        ds_engine.send_meta_once(self, outputs)  # DeepSpeed's shape handshake, before the first send
        for tensor in (outputs, ) if torch.is_tensor(outputs) else outputs:
            self._isend(tensor, self.next_stage)

    def _exec_isend_grads(self, buffer_id):
        for grad in self._input_grads(buffer_id):  # engine_chunks: DeepSpeed's choice of gradients
            self._isend(self._not_receive_buffer(grad), self.prev_stage, self._chunks.gradient_tag)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _not_receive_buffer(self, grad):
        """``grad``, copied when it shares memory with DeepSpeed's reused received-gradient buffer:
        autograd passes a gradient on without a copy through views and identities, so a stage whose
        input reaches its output through such ops alone has the received gradient as its input's;
        sent without blocking (or handed to another chunk), the next receive would overwrite it."""
        return copy_if_shared(grad, storages_of(ds_engine.receive_buffer_tensors(self)))

    def _exec_wait_sends(self):
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    # ------------------------------------------------------------------ handlers of the components
    def _abs_version(self, batch: int, version: int, clamp: bool = True) -> int:
        """Absolute weight version of an op of ``batch`` (relative to the running call)."""
        return self._versions.absolute(self._cursor.batch(batch), version, clamp)

    def _exec_start_allreduce(self, target, chunk):
        if target == "chunk":  # virtual stages: one chunk's gradients, its backwards done
            self._gradients.start_chunk_allreduce(self.module.chunk_parameters(chunk))
        else:
            self._gradients.start_allreduce(target)

    def _exec_wait_allreduce(self, target):
        self._gradients.wait_allreduce(target)

    def _exec_copy_grads_to_buffer(self):
        self._gradients.copy_to_buffer()

    def _exec_apply_buffered_update(self):
        with self._gradients.buffered_update() as updates:  # the buffered gradient in place
            self._stage_step.step() if updates else self._stage_step.count_only()

    def _exec_stage_optimizer_step(self, batch: int = 0):
        if not self._continuous:
            self._stage_step.step()
            return
        # a per-stage update of a continuous schedule: on the current version, per-stage
        # clipping, no step counters (the call advances them), at its batch's learning rates
        # (an update may run in the next call: every stage, and every holder of a tied module,
        # applies a batch's gradient at the same rate wherever the call boundary falls)
        rates = self._cursor.lrs(batch)
        self._updates.update(rates)  # on the current version (fp16: once the overflow vote decides, fp16_async)

    def _flush_buffered(self) -> bool:
        """A deferred stage's buffered gradient applied now (``drain()``). Its step clips by the
        tie group's joint norm only when the buffer holds this stage's tied weights (then every
        holder delays them and flushes too, adapter/gradients/tied.py); else (``deferred_layers: "untied"``:
        the tied copy in-step) the other holders do not step and it clips by the stage's own norm."""
        delayed = {id(p) for p in self._gradients.delayed}
        tie_norm = any(id(w) in delayed for w, _ in self._tied_weights())
        with self._gradients.flushing() as due:
            self._stage_step.drain_step(due, tie_norm)
        return due

    def _exec_stash_weights(self, batch: int, version: int):
        self._updates.before_use(self._abs_version(batch, version))  # fp16: the held update making it, decided
        self._versions.stash(self._abs_version(batch, version))

    def _exec_free_weights(self, batch: int, version: int):
        self._versions.free(self._abs_version(batch, version, clamp=False))


# class -> handler, built from the op table (OP_INFO's handler names) over DeepSpeed's own map
ds_engine.set_instruction_map(HippiePipelineEngine,
                              hs.instruction_map(HippiePipelineEngine, ds_engine.stock_instruction_map()))
