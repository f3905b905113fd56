"""What ``HippiePipelineEngine.__init__`` builds after DeepSpeed's ``__init__``: the components, each
given what it uses as it is built (:func:`build`), and the flush of a deferred stage's buffered
gradient (:func:`flush_buffered`, ``drain()``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...schedules.deferral import Deferral
from ...schedules.ir import WHOLE_BACKWARD_KINDS, CompiledSchedule
from ..ds import engine as ds_engine, fp16 as ds_fp16, module as ds_module
from ..gradients.allreduce_stream import AllReduceStream
from ..gradients.split import SplitBackward
from ..gradients.stage import StageGradients, split_deferred
from ..gradients.store import GradStore
from ..gradients.tied import LaggedTieSums, tie_sum_lag
from ..precision.fp16_async import AsyncVotes, continuous_updates, waits_at_update
from ..precision.fp16_stage import fp16_per_stage
from ..precision.step import StageStep
from ..staleness import delay_compensation, error_feedback
from ..staleness.methods import make_prediction
from ..staleness.prediction import PredictionInputs, made_before_use
from ..staleness.versions import WeightVersions


@dataclass
class Components:
    """A stage's components: its trained ``params``, weight ``versions``, ``gradients``, per-stage
    ``step``, continuous schedules' ``updates`` (fp16: the votes), the ``split`` backward, and the
    ``tied`` weights (weight, tie group) it holds."""

    params: list
    versions: WeightVersions
    gradients: StageGradients
    step: StageStep
    updates: object
    split: SplitBackward
    tied: list


def tied_weights(engine, keys=None) -> list[tuple[torch.Tensor, object]]:
    """(weight, tie group) of the stage's tied modules (``keys``: only those), in DeepSpeed's
    order, the same on every holder."""
    module = engine.module
    return [
        (ds_module.recursive_getattr(module, module.tied_modules[key], attr), comm["group"])
        for key, comm in module.tied_comms.items()
        if keys is None or key in keys
        for attr in comm["weight_attr"]
    ]


def build(
    engine, compiled: CompiledSchedule, staleness, deferral: Deferral | None, on_early_start: Callable[[], None]
) -> Components:
    """The components of ``engine`` (a ``PipelineEngine`` DeepSpeed has built) under ``compiled``;
    ``staleness``: ``hippie.staleness``; ``on_early_start``: an early all-reduce starts (the timeline)."""
    stage = engine.stage_id
    params = [p for p in engine.module.parameters() if p.requires_grad]
    # the staleness correction reads the optimizer ("adam") and whether the stage makes its next weights
    # before it computes ("extrapolate-made"; fp16 holding the update until the vote: not yet made)
    held = (
        compiled.continuous
        and fp16_per_stage(engine.fp16_enabled(), engine.optimizer)
        and not waits_at_update(compiled, stage)
    )
    inputs = PredictionInputs(engine.optimizer, params, made_before_use(compiled, stage) and not held)
    # 2bw's stages compute one update behind: corrected per version (hippie.staleness)
    behind = compiled.versioned and compiled.one_version_behind(stage)
    versions = WeightVersions(
        params,
        stage,
        compiled.updates_per_batch[stage] if compiled.continuous else 0,
        compiled.versioned,
        make_prediction(staleness, None, inputs) if behind else None,
    )
    # hippie.staleness.error_feedback: on the stages one update behind that compute on predicted weights
    error_feedback.bind(engine.optimizer, versions.prediction, staleness)
    # hippie.staleness.delay_compensation: on the stages one update behind, computing on unpredicted weights
    delay_compensation.bind(engine.optimizer, behind, staleness)
    tied = tied_weights(engine)
    model_step = ds_engine.ModelStep(engine)  # DeepSpeed's step and the settings it reads
    gradients, step = _gradients(
        engine, compiled, params, staleness, inputs, deferral or Deferral({}), tied, on_early_start, model_step
    )
    split = SplitBackward(
        compiled,
        engine.module,
        params,
        gradients.store,
        engine.pipe_buffers,
        ds_engine.Backward(engine),
        engine.is_last_stage,
        engine.gradient_accumulation_steps,
        partitioned=engine.is_pipe_partitioned or engine.is_grad_partitioned,
        logs=engine.global_rank == 0,
    )
    # an fp16 update skipped: DeepSpeed's count
    updates = continuous_updates(
        compiled, stage, versions, step, gradients, engine.device, engine.optimizer, model_step.count_skipped
    )
    if isinstance(updates, AsyncVotes):
        # was_step_applied() after a call that decided no update yet (2bw: stage 0 updates from the second call on,
        # the others hold the first call's update): no skip known. Megatron-DeepSpeed counted 2bw's first iteration
        # as skipped and logged no loss for it. Each decision sets it from then on.
        ds_fp16.set_step_applied(engine, True)
    return Components(params, versions, gradients, step, updates, split, tied)


def _gradients(
    engine, compiled: CompiledSchedule, params, staleness, inputs, deferral: Deferral, tied, on_early_start, model_step
) -> tuple[StageGradients, StageStep]:
    stage = engine.stage_id
    deferred = not compiled.continuous and stage in compiled.deferred_stages()
    # schedules without reduce_tied_grads sum tied gradients themselves (adapter/gradients/tied.py)
    ties = [] if compiled.uses_tied_reduction else list(tied)
    store = GradStore(engine.optimizer, params)
    grid = engine.grid
    # never flushing: the tie sum lags (tie_sum_lag updates), clipped apart from the rest (adapter/gradients/tied.py)
    lagged = (
        LaggedTieSums(
            store, ties, tie_sum_lag(engine.module, compiled), grid.get_data_parallel_group(), grid.data_parallel_id
        )
        if ties and compiled.continuous
        else None
    )
    if lagged is not None:
        ties = []
    clip_group = ties[0][1] if ties else None  # check_tied: one tie group per stage
    delayed, synced = (
        split_deferred(
            params,
            engine.module.forward_funcs,
            engine.module.parts[stage],
            deferral.stages.get(stage),
            also=[w for w, _ in tied_weights(engine, deferral.tied_delayed)],
        )
        if deferred
        else ([], params)
    )
    gradients = StageGradients(
        store,
        AllReduceStream(
            engine.device, grid.get_data_parallel_group(), engine.dp_world_size, engine.communication_data_type
        ),
        reduce=engine.is_data_parallel,
        deferred=deferred,
        delayed=delayed,
        synced=synced,
        ties=ties,
        lagged_ties=lagged,
        tie_clip=engine.gradient_clipping(),
        backwards_per_call=sum(op.kind in WHOLE_BACKWARD_KINDS for op in compiled.ops(stage)),
        prediction=make_prediction(staleness, delayed, inputs) if deferred and delayed else None,
        on_early_start=on_early_start,
    )
    if deferred and grid.data_parallel_id == 0:
        gradients.log_delayed_share(stage)
    ties = gradients.lagged_ties
    return gradients, StageStep(
        engine.optimizer,
        engine.mpu,
        grid,
        model_step,
        store,
        engine.device,
        fp16=engine.fp16_enabled(),
        bf16=engine.bfloat16_enabled(),
        clip_group=clip_group,
        clips_itself=gradients.clips_itself,
        schedule=compiled,
        tie_sums=ties[0] if ties is not None else None,
    )


def flush_buffered(gradients: StageGradients, step: StageStep, tied) -> bool:
    """A deferred stage's buffered gradient applied now (``drain()``). Its step clips by the tie
    group's joint norm only when the buffer holds this stage's tied weights (then every holder
    delays them and flushes too, adapter/gradients/tied.py); else (``deferred_layers: "untied"``:
    the tied copy in-step) the other holders do not step and it clips by the stage's own norm."""
    delayed = {id(p) for p in gradients.delayed}
    tie_norm = any(id(w) in delayed for w, _ in tied)
    with gradients.flushing() as due:
        step.drain_step(due, tie_norm)
    return due
