"""Modules tied across stages (DeepSpeed's ``TiedLayerSpec``, e.g. an embedding tied to the output
head) under schedules whose stages update apart (``hippie``, ``hippie-1f1b``, ``hippie-zb``).

DeepSpeed keeps the copies equal by summing their gradients over the tie group
(``reduce_tied_grads``) before one pipeline-wide step. A stage of these schedules steps on its
own, so every copy must get the same gradient, the same update rule and the same clipping:

- **one rule per tied module**: if any stage holding it delays it (a deferred stage whose
  delayed layers include it), every holder delays it, applying the summed gradient one step late
  with the same staleness correction. A holder that is not deferred becomes a deferred stage
  that delays only the tied weights (its other parameters stay in-step), so the buffer is
  declared in its op stream like any deferred stage's;
- **the sum**: each holder all-reduces its tied weights' gradients over the tie group (the
  copies of one data-parallel replica) before its data-parallel all-reduce: at
  ``copy_grads_to_buffer`` for a delayed tie, at ``start_allreduce(grads)`` otherwise
  (:class:`~hippie_ds.adapter.engine_gradients.StageGradients`). Blocking: a holder that gets
  there first waits for the others' backward; the last stage has nothing else to do then;
- **clipping**: a per-stage step clips by the stage's own norm, which would scale the copies
  apart; the holders of a tied module clip by their joint norm instead (reduced over the tie
  group; the fp32 path counts each holder's gradients, the tied one on each; DeepSpeed's bf16
  norm counts a tied weight once), so every copy gets the same coefficient. A stage may hold
  tied modules of one tie group only.

Schedules that never flush (``2bw``, ``pipedream``) update each copy at another time in the
pipeline and are refused. All of this is decided before any process group exists, from the layer
specs every rank has.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.module import PipelineModule, TiedLayerSpec

from ..config import ConfigError
from ..schedules import builtins_where
from ..schedules import recompile
from ..schedules.ir import CompiledSchedule


def tie_holders(model: PipelineModule) -> dict[str, dict[int, list[int]]]:
    """{tie key: {stage: the layer indices of that stage where the tied module appears}}."""
    holders: dict[str, dict[int, list[int]]] = {}
    for idx, spec in enumerate(model._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            holders.setdefault(spec.key, {}).setdefault(model.stage_owner(idx), []).append(idx)
    return {key: stages for key, stages in holders.items() if len(stages) > 1}


def check_tied(model: PipelineModule, compiled: CompiledSchedule) -> None:
    """Refuse, before any process group, what cannot keep tied copies equal."""
    if not model.tied_comms or compiled.uses_tied_reduction:
        return
    ties = ", ".join(model.tied_comms)
    shape = (compiled.stages, compiled.micro_batches)
    if compiled.continuous:
        allowed = builtins_where(lambda c: c.uses_tied_reduction or not c.continuous, *shape)
        raise ConfigError(f'config key "pipeline.schedule" = {compiled.name!r}: its stages update at different points '
                          f"of a pipeline that never flushes, so the copies of a module tied across stages ({ties}) "
                          f"would diverge; use {', '.join(allowed)}, or untie them")
    groups = {}
    for key, stages in tie_holders(model).items():
        for stage in stages:
            groups.setdefault(stage, set()).add(tuple(sorted(stages)))
    several = {s: sorted(g) for s, g in groups.items() if len(g) > 1}
    if several:
        raise ConfigError(f'config key "pipeline.schedule" = {compiled.name!r}: stage(s) {sorted(several)} hold modules '
                          f"tied to different sets of stages ({several}); a per-stage update clips by the norm of one "
                          "tie group; use " + ", ".join(builtins_where(lambda c: c.uses_tied_reduction, *shape)) +
                          ", or tie them to the same stages")


def delay_ties(model: PipelineModule, compiled: CompiledSchedule,
               deferred_layers: dict[int, int]) -> tuple[CompiledSchedule, dict[int, int], set[str]]:
    """(schedule, deferred layers, delayed tie keys) with every tied module under one rule: the
    tie keys some holder delays, and the holders that were not deferred added to the deferred
    stages with no leading layers delayed (the schedule recompiled with them)."""
    if not model.tied_comms or compiled.uses_tied_reduction or compiled.continuous:
        return compiled, deferred_layers, set()
    deferred = set(compiled.deferred_stages())

    def delays(stage: int, layers: list[int]) -> bool:
        if stage not in deferred:
            return False
        count = deferred_layers.get(stage)  # None: the whole stage
        return count is None or any(i < model.parts[stage] + count for i in layers)

    holders = tie_holders(model)
    delayed = {key for key, stages in holders.items() if any(delays(s, ls) for s, ls in stages.items())}
    added = sorted({s for key in delayed for s in holders[key]} - deferred)
    if not added:
        return compiled, deferred_layers, delayed
    return (recompile(compiled, deferred_stages=sorted(deferred | set(added))),
            {**deferred_layers, **{s: 0 for s in added}}, delayed)
