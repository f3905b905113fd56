"""Modules tied across stages (DeepSpeed's ``TiedLayerSpec``, e.g. an embedding tied to the output
head) under schedules whose stages update apart (``hippie``, ``hippie-1f1b``, ``hippie-zb``; and
``2bw``, ``pipedream``, which never flush).

DeepSpeed keeps the copies equal by summing their gradients over the tie group
(``reduce_tied_grads``) before one pipeline-wide step. A stage of these schedules steps on its
own, so every copy must get the same gradient, the same update rule and the same clipping:

- **one rule per tied module**: if any stage holding it delays it (a deferred stage whose
  delayed layers include it), every holder delays it, applying the summed gradient one step late
  with the same staleness correction. A holder that is not deferred becomes a deferred stage
  that delays only the tied weights (its other parameters stay in-step), so the buffer is
  declared in its op stream like any deferred stage's. At the first step (nothing buffered
  yet) such a holder steps its in-step part, and under bf16 (one flat partition) its tied copy
  takes a zero gradient, which still decays (AdamW) and advances the step count; so under bf16 a
  wholly deferred holder steps then too, with zero gradients, instead of not at all
  (:meth:`~hippie_ds.adapter.gradients.stage.StageGradients._steps_first`). Under the default
  ``hippie.deferred_layers: "untied"`` no stage delays a tied module: one among a deferred
  stage's delayed leading layers (Megatron's word embedding before the first transformer layer)
  stays in-step there, as on every other holder;
- **the sum**: each holder all-reduces its tied weights' gradients over the tie group (the
  copies of one data-parallel replica) before its data-parallel all-reduce: at
  ``copy_grads_to_buffer`` for a delayed tie, at ``start_allreduce(grads)`` otherwise
  (:class:`~hippie_ds.adapter.gradients.stage.StageGradients`). Blocking: a holder that gets
  there first waits for the others' backward; the last stage has nothing else to do then;
- **clipping**: a per-stage step clips by the stage's own norm, which would scale the copies
  apart; the holders of a tied module clip by their joint norm instead (reduced over the tie
  group; the fp32 path counts each holder's gradients, the tied one on each; DeepSpeed's bf16
  norm counts a tied weight once), so every copy gets the same coefficient. A stage may hold
  tied modules of one tie group only.

Schedules that never flush (``2bw``, ``pipedream``) update each copy at another time in the
pipeline: the last stage updates for a batch before stage 0 has run that batch's last backward. A
blocking sum there could deadlock (the later holder may first wait on a send to the earlier one,
which would only receive it after the sum), so the sum lags by L updates
(:class:`LaggedTieSums`): at its update u every holder starts summing its tied gradient of u
asynchronously and applies the sum of u - L in its place (nothing before u = L). L is the least
lag at which every holder's update u - L comes before every holder's update u on the schedule's
timeline and in no later ``train_batch`` call (DeepSpeed ends a call with a pipeline-wide loss
broadcast; :func:`~hippie_ds.schedules.continuous.sum_lag`): 1 for 2bw, the holders' distance
in stages for pipedream (3 for stages 0 and 3). Every copy applies the same gradients in the
same order, L updates later than its stage's other parameters, and stays bit-identical. Clipping
cannot use a joint norm there (another blocking collective), and each stage's own norm would
scale the copies apart: a holder clips its tied weights by the norm of their summed gradient (the
same on every holder) and its other parameters by theirs (:meth:`LaggedTieSums.clip_apart`).

Which stages hold a tied module comes from the layer specs every rank has; what each delays is
decided once at start-up (:func:`hippie_ds.schedules.deferral.decide`).
"""

from __future__ import annotations

import collections

import torch
from deepspeed import comm as dist

from ...config import ConfigError
from ...schedules import builtins_where
from ...schedules.continuous import sum_lag
from ...schedules.ir import CompiledSchedule
from ..module.deferred_layers import tie_holders
from ..ds.module import PipelineModule
from ..ds.runtime import clip_tensors_by_global_norm
from ..module.chunks import held_chunks


def tied_stage_groups(model: PipelineModule) -> list[list[int]]:
    """The stages holding each tied module, in key order (DeepSpeed's ReduceTiedGrads order): the
    simulator's ``Costs.tied_groups``."""
    return [sorted(stages) for _, stages in sorted(tie_holders(model).items())]


def check_tied(model: PipelineModule, compiled: CompiledSchedule) -> None:
    """Refuse, before any process group, what cannot keep tied copies equal."""
    if not model.tied_comms or compiled.uses_tied_reduction:
        return
    shape = (compiled.stages, compiled.micro_batches)
    if compiled.continuous:
        return  # the tie sum lags one update, clipped apart (LaggedTieSums)
    groups = {}
    for key, stages in tie_holders(model).items():
        for stage in stages:
            groups.setdefault(stage, set()).add(tuple(sorted(stages)))
    several = {s: sorted(g) for s, g in groups.items() if len(g) > 1}
    if several:
        raise ConfigError(
            f'config key "pipeline.schedule" = {compiled.name!r}: stage(s) {sorted(several)} hold '
            f"modules tied to different sets of stages ({several}); a per-stage update clips by the norm "
            "of one tie group; use "
            + ", ".join(builtins_where(lambda c: c.uses_tied_reduction, *shape, held_chunks(model)))
            + ", or tie them to the same stages"
        )


def tie_sum_lag(model: PipelineModule, compiled: CompiledSchedule) -> int:
    """How many updates the tie sum of a schedule that never flushes lags: the least that lets
    every holder of every tied module wait only for sums the others started earlier on the
    schedule's timeline (1 for 2bw; the holders' distance in stages for pipedream)."""
    return max((sum_lag(compiled, stages) for stages in tie_holders(model).values()), default=1)


class LaggedTieSums:
    """The tie sum of a schedule that never flushes (see the module docstring): ``lag`` updates
    late, summed asynchronously over each tie group (the holders of one data-parallel replica).
    At update u the sums of updates u - lag + 1 .. u are in flight; before update ``lag`` the tied
    weights have nothing to apply."""

    def __init__(self, store, ties: list[tuple[torch.Tensor, object]], lag: int, dp_group, replica: int):
        self._store = store  # GradStore: the gradients the step reads
        self._weights = [w for w, _ in ties]
        self._tie_groups = [g for _, g in ties]
        self.lag = lag
        self._dp_group, self._replica = dp_group, replica  # checkpoints hold every replica's sums
        # oldest first; each entry one update's sums: [(work or None when complete, tensor)]
        self._pending: collections.deque[list[tuple[object, torch.Tensor]]] = collections.deque()
        self.norm_before_clip: float | None = None  # the last clip_apart's stage gradient norm (unscaled)

    @property
    def weights(self) -> list[torch.Tensor]:
        return self._weights

    def held_tensors(self) -> list[torch.Tensor]:
        """The sums in flight, uncopied (no wait)."""
        return [t for entry in self._pending for _, t in entry]

    @staticmethod
    def _wait(entry: list[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
        for work, _ in entry:
            if work is not None:
                work.wait()
        return [t for _, t in entry]

    @torch.no_grad()
    def exchange(self) -> bool:
        """Roughly: at an update, before the data-parallel all-reduce, start summing this update's
        tied gradients and put the sums of ``lag`` updates ago in their place. False while there
        is none (the first ``lag`` updates: the caller leaves the tied weights out of the step)."""
        grads = self._store.of(self._weights)
        self._pending.append(
            [
                (dist.all_reduce(t, group=group, async_op=True), t)
                for t, group in zip((g.clone() for g in grads), self._tie_groups)
            ]
        )
        if len(self._pending) <= self.lag:
            for g in grads:
                g.zero_()
            return False
        for g, total in zip(grads, self._wait(self._pending.popleft())):
            g.copy_(total)
        return True

    @torch.no_grad()
    def clip_apart(self, clip: float, scale: float = 1.0) -> None:
        """Roughly: after the data-parallel all-reduce, clip the tied weights' gradients by their
        norm and the stage's other gradients by theirs (DeepSpeed's own clipping function, local
        norms), instead of the optimizer's clipping by the whole stage's norm. ``scale``: the loss
        scale the gradients carry (fp16 + ZeRO-1), clipped as their unscaled values would be."""
        tied = {id(w) for w in self._weights}
        squares = 0.0
        for part in (self._weights, [p for p in self._store.params if id(p) not in tied]):
            grads = self._store.of(part)
            if grads:
                squares += float(clip_tensors_by_global_norm(grads, max_norm=clip * scale, eps=1e-6 * scale)) ** 2
        # what the engine reports as its gradient norm (a client logs it): the stage's, before clipping
        self.norm_before_clip = squares**0.5 / scale

    @torch.no_grad()
    def rescale_pending(self, factors: list[float]) -> None:
        """The sums in flight (oldest first) multiplied by ``factors`` (fp16 + ZeRO-1: each brought to
        the loss scale a drain leaves, adapter/precision/fp16_async.py); waited for first."""
        for i, (entry, factor) in enumerate(zip(list(self._pending), factors)):
            sums = self._wait(entry)
            if factor != 1.0:
                for t in sums:
                    torch.Tensor.mul_(t, factor)
            self._pending[i] = [(None, t) for t in sums]

    @property
    def in_flight(self) -> int:
        """How many updates' sums are started and not applied yet."""
        return len(self._pending)

    def state_dict(self) -> dict | None:
        """The sums the next updates apply, of every replica (each replica's own until the next
        data-parallel all-reduce; DeepSpeed saves one replica's client state): waited for (every
        holder has started them by then), gathered over the data-parallel group. None: none."""
        if not self._pending:
            return None
        replicas = dist.get_world_size(group=self._dp_group)
        entries = []
        for i, entry in enumerate(self._pending):
            sums = self._wait(entry)
            self._pending[i] = [(None, t) for t in sums]
            gathered = [[torch.empty_like(t) for _ in range(replicas)] for t in sums]
            for out, t in zip(gathered, sums):
                dist.all_gather(out, t, group=self._dp_group)
            entries.append(gathered)  # [weight][replica]
        return {
            "lag": self.lag,
            "replicas": [[[out[r].clone() for out in gathered] for gathered in entries] for r in range(replicas)],
        }

    def load_state_dict(self, state: dict | None, device) -> None:
        """``state``: None (a checkpoint without it: the lag restarts, nothing applied first)."""
        self._pending.clear()
        if state is None:
            return
        replicas = dist.get_world_size(group=self._dp_group)
        if state["lag"] != self.lag or len(state["replicas"]) != replicas:
            raise ValueError(
                f"the checkpoint holds the tied-gradient sums of a {state['lag']}-update lag over "
                f"{len(state['replicas'])} data-parallel replicas, this run lags {self.lag} over "
                f"{replicas}; resume with the same schedule, stages and replicas"
            )
        for sums in state["replicas"][self._replica]:
            self._pending.append([(None, torch.Tensor.to(t, device)) for t in sums])
