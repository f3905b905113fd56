"""``HippiePipelineEngine``: DeepSpeed's ``PipelineEngine`` running any declared schedule.

The class keeps DeepSpeed's overrides and the public methods; everything a stage owns beside
DeepSpeed's own state lives in one :class:`~hippie_ds.adapter.stage.runtime.StageRuntime`,
built after DeepSpeed's ``__init__`` from explicit inputs (:mod:`~hippie_ds.adapter.stage.build` makes
the components), and each override delegates to it. What the overrides change, and why:
- ``_train_schedule`` returns the compiled, validated declaration instead of ``TrainSchedule``, and
  ``_exec_schedule`` runs it with each op's handler (:data:`~hippie_ds.adapter.stage.handlers.HANDLERS`);
- the loss lives in per-buffer slots (the stock engine keeps one, so any order but strict
  F(m)->B(m) on the last stage breaks: DeepSpeed issue #3900). The received gradient keeps
  DeepSpeed's single slot: the compiler puts every recv_grad in its backward's step, and start-up
  refuses a schedule that would receive another gradient before using the one it holds;
- deferred stages, and 2bw's stages, correct for their one-step delay (``hippie.staleness``,
  :mod:`hippie_ds.adapter.staleness.prediction`): compute runs on predicted weights, the update applies to the
  true ones;
- continuous schedules (2bw, pipedream: the pipeline stays full across ``train_batch`` calls): ops of
  batches in flight run in the next call, ``drain()`` completes them; weight versions (adapter/staleness/versions.py);
- virtual stages: the chunk overrides ask the runtime's ``ChunkSelector`` (:mod:`~hippie_ds.adapter.engine.chunks`);
- checkpoints carry the in-flight state (:class:`~hippie_ds.adapter.checkpoint.in_flight.TrainingState`);
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

import torch

from ..._compat import check_deepspeed
from ...schedules.deferral import Deferral
from ...schedules.ir import CompiledSchedule
from ..checkpoint.in_flight import TrainingState
from ..ds import checkpoint as ds_checkpoint, engine as ds_engine
from ..ds.stage import DeepSpeedStage
from ..module.tensor_calls import tensor_bytes
from ..profiling.timeline import Timeline, compute_clock
from . import chunks as chunk_overrides
from ..stage.build import build
from ..stage.call_cursor import CallCursor
from ..stage.chunk_selector import ChunkSelector
from ..stage.runtime import StageRuntime

check_deepspeed()

__all__ = ["HippiePipelineEngine"]


class HippiePipelineEngine(ds_engine.PipelineEngine):
    """A ``PipelineEngine`` whose training schedule is a compiled hippie-ds declaration: DeepSpeed's
    overrides (each docstring names the one it overrides) and the public methods, delegating to
    the stage's :class:`~hippie_ds.adapter.stage.runtime.StageRuntime` (``self._runtime``)."""

    _runtime: StageRuntime | None = None  # DeepSpeed's __init__ runs before it is built
    _chunk_selector: ChunkSelector | None = None  # ... and before the chunks (it asks is_first_stage, DeepSpeed's)

    def __init__(
        self,
        *args,
        compiled_schedule: CompiledSchedule,
        timeline_dir: str | None = None,
        timeline_steps: int = 100,
        staleness=None,
        deferral: Deferral | None = None,
        **kwargs,
    ):
        """Overrides ``PipelineEngine.__init__`` (calls it), then builds the stage runtime."""
        self.compiled_schedule = compiled_schedule
        super().__init__(*args, **kwargs)
        if compiled_schedule.stages != self.num_stages or compiled_schedule.micro_batches != self.micro_batches:
            raise ValueError(
                f"schedule compiled for {compiled_schedule.stages} stages x "
                f"{compiled_schedule.micro_batches} micro-batches, engine has {self.num_stages} x "
                f"{self.micro_batches}"
            )
        # virtual stages: the per-chunk state, before the components (they read the stage's neighbours)
        self._chunk_selector = chunks = ChunkSelector(
            compiled_schedule.layout,
            compiled_schedule.virtual_stages,
            self.stage_id,
            ds_engine.Boundary(self),
            getattr(self.module, "set_chunk", None),  # one chunk: DeepSpeed's own module has none
            self.is_pipe_partitioned or self.is_grad_partitioned,
        )
        cursor = CallCursor()  # continuous schedules: where the calls stand
        parts = build(self, compiled_schedule, staleness, deferral, lambda: self._runtime.early_allreduce_started())
        module = self.module
        in_flight = TrainingState(
            module,
            parts.gradients,
            parts.versions,
            cursor,
            compiled_schedule.continuous,
            self.stage_id,
            self.device,
            self.optimizer,
            ds_checkpoint.CheckpointFiles(self),
        )  # what a checkpoint saves and restores
        self._runtime = StageRuntime(
            DeepSpeedStage(self),
            compiled_schedule,
            parts,
            chunks,
            cursor,
            in_flight,
            lambda chunk: module.chunk_parameters(chunk),
            Timeline(timeline_steps, compute_clock(self.device)),
            timeline_dir,
        )
        atexit.register(warn_in_flight_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ the schedule
    def _train_schedule(self):
        """Overrides ``PipelineEngine._train_schedule``: the compiled declaration, not ``TrainSchedule``."""
        return self._runtime.declared

    def _exec_schedule(self, pipe_schedule):
        """Overrides ``PipelineEngine._exec_schedule``: delegates to ``StageRuntime.run`` (each op with its handler)."""
        self._runtime.run(pipe_schedule)

    def train_batch(self, data_iter=None):
        """Overrides ``PipelineEngine.train_batch``: delegates to ``StageRuntime.train_batch``, which calls it."""
        return self._runtime.train_batch(lambda: super(HippiePipelineEngine, self).train_batch(data_iter))

    def eval_batch(self, *args, **kwargs):
        """Overrides ``PipelineEngine.eval_batch``: delegates to ``StageRuntime.eval_batch`` (drains first), which
        calls it."""
        return self._runtime.eval_batch(lambda: super(HippiePipelineEngine, self).eval_batch(*args, **kwargs))

    # ------------------------------------------------------------------ virtual stages (chunks.py)
    def is_first_stage(self):
        """Overrides ``PipelineEngine.is_first_stage``: delegates to the chunks (DeepSpeed's without them)."""
        return chunk_overrides.is_first(self._chunks(), super().is_first_stage)

    def is_last_stage(self):
        """Overrides ``PipelineEngine.is_last_stage``: delegates to the chunks (DeepSpeed's without them)."""
        return chunk_overrides.is_last(self._chunks(), super().is_last_stage)

    def _loss_stage_global_rank(self):
        """Overrides ``PipelineEngine._loss_stage_global_rank``: delegates to the chunks (the stage of the last
        part)."""
        return chunk_overrides.loss_stage_global_rank(self._chunks(), self.grid, super()._loss_stage_global_rank)

    def _next_batch(self):
        """Overrides ``PipelineEngine._next_batch``: delegates to the chunks (the V's first stage reads once)."""
        return chunk_overrides.next_batch(self._chunks(), self.is_first_stage, super()._next_batch)

    def reset_activation_shape(self):
        """Overrides ``PipelineEngine.reset_activation_shape`` (calls it): every chunk's shapes go."""
        chunk_overrides.forget_shapes(self._chunks(), super().reset_activation_shape)

    def _inference_schedule(self, micro_batches):
        """Overrides ``PipelineEngine._inference_schedule``: delegates to the chunks (chunk by chunk)."""
        return chunk_overrides.inference_schedule(
            self._chunks(), micro_batches, self.num_stages, super()._inference_schedule
        )

    def clip_fp32_gradients(self):
        """Overrides ``DeepSpeedEngine.clip_fp32_gradients`` (DeepSpeed's step calls it back): delegates to the
        chunks (a virtual layout clips by 1F1B's coefficient; DeepSpeed's clipping without chunks)."""
        return chunk_overrides.clip_fp32_gradients(
            self._chunks(),
            self.module,
            self.grid,
            self.mpu,
            self.device,
            self.gradient_clipping(),
            super().clip_fp32_gradients,
        )

    def _chunks(self) -> ChunkSelector | None:
        return self._chunk_selector

    def _backward_prologue_per_tensor(self, grad):
        """Overrides ``DeepSpeedEngine._backward_prologue_per_tensor`` (DeepSpeed's output hook calls it back):
        delegates to ``StageRuntime.backward_prologue`` (no second division where the split backward's input
        pass divided the loss itself)."""
        stock = super()._backward_prologue_per_tensor
        return stock(grad) if self._runtime is None else self._runtime.backward_prologue(grad, stock)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Overrides ``DeepSpeedEngine.save_checkpoint``: delegates to ``StageRuntime.save_checkpoint``
        (the in-flight state), which calls it. ``client_state`` None: none (DeepSpeed's default, ``{}``)."""
        return self._runtime.save_checkpoint(
            lambda state: super(HippiePipelineEngine, self).save_checkpoint(
                save_dir,
                tag=tag,
                client_state=state,
                save_latest=save_latest,
                exclude_frozen_parameters=exclude_frozen_parameters,
            ),
            {} if client_state is None else client_state,
        )

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, **kwargs):
        """Overrides ``DeepSpeedEngine.load_checkpoint`` (calls it), plus hippie-ds's state. Loads
        checkpoints of stock DeepSpeed and of other stage layouts (re-planned runs): weights follow
        by layer; optimizer state cannot, so a layout change needs ``load_optimizer_states=False`` (an
        explicit restart of the optimizer state) and a checkpoint with nothing in flight. Delegates to
        ``StageRuntime.load_checkpoint``, which calls it."""
        return self._runtime.load_checkpoint(
            lambda: super(HippiePipelineEngine, self).load_checkpoint(
                load_dir, tag=tag, load_optimizer_states=load_optimizer_states, **kwargs
            ),
            load_dir,
            tag,
            load_optimizer_states,
        )

    # ------------------------------------------------------------------ public
    def add_instruction_hook(self, hook):
        """Call ``hook(event)`` (:class:`~hippie_ds.adapter.profiling.timeline.InstructionEvent`) after each
        instruction ``train_batch`` and ``drain`` run here, in order; returns its remover. With a
        hook the engine reads its compute clock around each instruction (CUDA: a stream sync)."""
        hooks = self._runtime.hooks
        hooks.append(hook)
        return lambda: hooks.remove(hook) if hook in hooks else None

    def add_train_batch_hook(self, hook):
        """Run each ``train_batch`` call as ``hook(run)``: ``run()`` runs the call (inside the hooks added
        after this one) and returns its loss, which ``hook`` returns (``hippie.profile`` measures
        around the calls so); returns its remover."""
        hooks = self._runtime.train_batch_hooks
        hooks.append(hook)
        return lambda: hooks.remove(hook) if hook in hooks else None

    def drain(self) -> bool:
        """Complete every batch still in flight (continuous schedules: the last backwards and
        updates of the last ``train_batch``), so that every micro-batch read is applied exactly
        once; call it on every rank at the end of training. The math does not depend on where drains
        happen (weight versions are declared): training may go on, the next call fills the pipeline.
        For the hippie family it applies the buffered gradient (a collective of the stage's
        data-parallel group: on every rank); step counters and the LR schedule stay. True if anything was done."""
        return self._runtime.drain()

    def has_pending_update(self) -> bool:
        """True when this stage holds a buffered gradient not yet applied."""
        return self._runtime.gradients.has_pending_update()

    def delayed_fraction(self) -> float:
        """The fraction of this stage's gradient (by elements) that is applied one step late."""
        return self._runtime.gradients.delayed_fraction()

    def weight_versions(self) -> dict:
        """This stage's weight versions: current (updates applied), stashed, the most held at once."""
        return self._runtime.versions.summary()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this stage keeps between ``train_batch`` calls beside its parameters, their gradients and
        the optimizer's state, by kind (``gradient_buffer``, ``tie_sums``, ``prediction``,
        ``weight_versions``): the tensors themselves, nothing copied or communicated. For memory
        probes, e.g. the bench's count."""
        return self._runtime.held_tensors()

    def has_in_flight(self) -> bool:
        """True when batches of a continuous schedule are still in flight (``drain()`` has work)."""
        return self._runtime.cursor.in_flight

    def timeline(self) -> tuple[float, list[dict]]:
        """(t0, events): this rank's executed instructions of the last ``timeline_steps`` calls, each
        ``{"name", "kind", "start", "end", "step", ...}`` in seconds since t0 (what ``write_timeline`` writes)."""
        return self._runtime.timeline.t0, list(self._runtime.timeline)

    def write_timeline(self, path: str | None = None) -> str | None:
        """Write this rank's timeline (JSON) of the last ``timeline_steps`` calls; returns the path."""
        rt = self._runtime
        if rt.timeline_dir is None and path is None:
            return None
        return rt.timeline.write(
            path or os.path.join(rt.timeline_dir, f"rank{self.global_rank}.json"),
            rank=self.global_rank,
            stage=self.stage_id,
            data_parallel_id=self.grid.data_parallel_id,
            schedule=self.compiled_schedule.name,
            param_bytes=tensor_bytes(rt.params),
        )

    def count_split_state_in(self, meter) -> None:
        """Also count in ``meter`` (a :class:`hippie_ds.adapter.profiling.memory.ActivationMeter`) what
        backward_input keeps for backward_weight beyond the graph's saved tensors: the gradients at
        the parameter ops (benchmarks compare it with the simulator's memory held until W)."""
        self._runtime.split.meter = meter


def warn_in_flight_at_exit(ref) -> None:
    """A training loop need not call ``drain()`` (stock DeepSpeed has no such call): checkpoints
    keep what is in flight, ``eval_batch`` drains first. Weights read straight from the module
    after the last ``train_batch`` lack it; say so once, from each such stage's first replica,
    unless a ``save_checkpoint`` since holds it (Megatron's ``--exit-interval`` saves, then exits)."""
    engine = ref()
    if engine is None or engine.grid.data_parallel_id != 0:
        return
    what = engine._runtime.in_flight_at_exit()
    if what is not None:
        from deepspeed.utils import logger

        logger.warning(
            f"hippie-ds: schedule {engine.compiled_schedule.name!r} stage {engine.stage_id} exits with "
            f"{what} not applied to the weights in memory; engine.drain() on every rank applies them, "
            "save_checkpoint keeps them"
        )
