"""Staleness correction for updates that apply a gradient computed one update earlier
(``hippie.staleness``): one rule, one state, one checkpoint format, for every schedule that has it.

A delayed stage follows W(v+1) = W(v) - lr * g(.), where the gradient was computed while the
stage was one update behind. ``extrapolate`` runs that compute on a prediction of the weights
instead (SpecTrain / PipeMare style weight prediction)::

    roughly: W_hat(v) = W(v) + c * delta(v),   delta(v) = W(v) - W(v-1)  (the last update)
             the optimizer updates the true W(v), never W_hat(v)

With c = 1 the prediction repeats the last update. Version 0 has no delta (nothing predicted);
an update that changed nothing gives a zero delta.

Two ways a stage holds its versions, one :class:`WeightPrediction` state (``deltas``):

- **in place** (hippie's deferred stages, :class:`InPlacePrediction`): the module's parameters
  hold W(v) between steps and W_hat(v) during one; a single weight-sized buffer holds delta(v)
  between steps and the true W(v) during the step (swapped per parameter, see ``predict``), so
  the correction costs one buffer, as before it was unified.
- **per version** (2bw, :class:`~hippie_ds.adapter.staleness.versions.WeightVersions`): the true
  versions live in the version store; the delta of each version still computed on is kept
  (at most two per stage) and applied when the version is swapped in.

Schedules whose stages are more than one update behind (``pipedream``) are not corrected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The state saved in checkpoints: {"format": 2, "coefficient": c, "deltas": {version: [tensors]}}.
# Format 1 had two shapes: hippie's {"coefficient", "previous": [W(v-1)] | None} and 2bw's
# {"deltas": {version: flat}}; both still load (load_state_dict).
STATE_FORMAT = 2


class WeightPrediction:
    """delta(v) of the versions still computed on, and the prediction W(v) + c * delta(v)."""

    method = "extrapolate"  # hippie.staleness.method; staleness/adam.py's classes keep W_hat(v) instead

    def __init__(self, coefficient: float):
        self.coefficient = coefficient
        self.deltas: dict[int, list[torch.Tensor]] = {}

    def knows(self, version: int) -> bool:
        """Whether delta(version) is known (else the version is computed on unpredicted)."""
        return version in self.deltas

    @torch.no_grad()
    def predicted(self, version: int, true: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """W_hat(version) from the true values, or None when its delta is not known."""
        delta = self.deltas.get(version)
        if delta is None:
            return None
        return [torch.add(w, d, alpha=self.coefficient) for w, d in zip(true, delta)]

    def record(self, version: int, delta: list[torch.Tensor]) -> None:
        """delta(version) = W(version) - W(version - 1), known once that update is applied."""
        self.deltas[version] = delta

    def keep_only(self, versions) -> None:
        """Forget the deltas of versions that compute will not use again."""
        for v in [v for v in self.deltas if v not in versions]:
            del self.deltas[v]

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors it keeps between steps (its deltas), uncopied."""
        return [d for ds in self.deltas.values() for d in ds]

    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "method": self.method,
            "coefficient": self.coefficient,
            "deltas": {v: [d.clone() for d in ds] for v, ds in self.deltas.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, device, params: list[torch.Tensor] | None = None) -> None:
        """Format 2, or format 1's two shapes (hippie's previous weights need ``params``, the
        current weights, already loaded: delta = W - W_previous, the subtraction the old
        prediction made, so a resumed run stays bit-identical). A state saved by another method
        (no "method": extrapolate) is not this one's: the prediction restarts."""
        if state.get("method", "extrapolate") != self.method:
            self.deltas = {}
            return
        if state.get("format") == STATE_FORMAT or ("deltas" in state and "format" not in state):
            deltas = {
                int(v): (list(ds) if isinstance(ds, (list, tuple)) else [ds]) for v, ds in state["deltas"].items()
            }
        elif "previous" in state:
            previous = state["previous"]
            deltas = (
                {}
                if previous is None
                else {0: [torch.Tensor.detach(p) - q.to(device) for p, q in zip(params, previous)]}
            )
        else:
            raise ValueError(f"staleness correction state of unknown format: keys {sorted(state)}")
        self.deltas = {v: [d.to(device) for d in ds] for v, ds in deltas.items()}


class InPlacePrediction(WeightPrediction):
    """A deferred stage's prediction on its own parameters, one buffer (module docstring).

    Per step: ``predict`` (step start) -> compute on W_hat -> ``restore`` (before the update) ->
    ``begin_update`` -> the optimizer step -> ``end_update``. Versions are counted from 0 at
    construction; the one delta kept is stored under version 0 (it is always the latest)."""

    def __init__(self, params: list[torch.Tensor], coefficient: float):
        super().__init__(coefficient)
        self.params = params
        self._true: list[torch.Tensor] | None = None  # the buffer while it holds W (during a step)
        self.predicted_now = False

    @torch.no_grad()
    def predict(self) -> None:
        """Roughly: ``buffer, params = params, params + c * delta`` (no-op when already predicted)."""
        self._swap_in(lambda p, delta: torch.Tensor.add_(p, delta, alpha=self.coefficient))

    def _swap_in(self, make) -> None:
        """The swap every in-place prediction makes: the kept buffer takes the true weights W and
        each parameter becomes ``make(param, what the buffer held)``, in place; the buffer holds W
        until :meth:`restore` (no-op when already predicted; nothing kept yet: W is copied)."""
        if self._true is not None:
            return
        kept = self.deltas.pop(0, None)
        if kept is None:
            self._true = [torch.Tensor.clone(torch.Tensor.detach(p)) for p in self.params]
            return
        for p, buf in zip(self.params, kept):
            held = buf.clone()  # one parameter at a time: the buffer turns into W
            buf.copy_(p)
            make(p, held)
        self._true, self.predicted_now = kept, True

    @torch.no_grad()
    def restore(self) -> None:
        """Roughly: ``params = buffer`` (the true weights), keeping the buffer for the update."""
        if self.predicted_now:
            for p, w in zip(self.params, self._true):
                torch.Tensor.copy_(p, w)
            self.predicted_now = False

    @torch.no_grad()
    def begin_update(self) -> None:
        """Before an optimizer step on the true weights: the buffer holds them (an update outside
        a step, e.g. the final flush, moves the buffer from delta to W first)."""
        self.restore()
        if self._true is None:
            self.predict()
            self.restore()

    @torch.no_grad()
    def end_update(self) -> None:
        """After the optimizer step: the buffer becomes the update just applied, W_new - W."""
        for p, w in zip(self.params, self._true):
            torch.sub(p, w, out=w)
        self.deltas[0], self._true = self._true, None

    def held_tensors(self) -> list[torch.Tensor]:
        return super().held_tensors() + list(self._true or ())

    def state_dict(self) -> dict:
        if self._true is not None:
            raise RuntimeError(
                "weight prediction: cannot save during a step (the parameters may hold predicted weights)"
            )
        return super().state_dict()

    def load_state_dict(self, state: dict, device, params: list[torch.Tensor] | None = None) -> None:
        super().load_state_dict(state, device, self.params)
        self._true, self.predicted_now = None, False


class MadeWeightsPrediction(WeightPrediction):
    """``extrapolate-made``: 2bw's versions as ``extrapolate`` predicts them, except on a stage that
    makes W(v+1) before its first compute on version v (``made``: its updates run in their own
    batch's call, as 2bw's last stage's do, and the next call's micro-batches all compute on the
    version before; :func:`made_before_use`): there version v computes on the weights already made,
    W(v) + c (W(v+1) - W(v)), W(v+1) itself at c = 1, as ``adam`` does on that stage
    (adapter/staleness/adam.py), with any optimizer. A version compute has already used when the
    next is made (version 0: batch 0 computes on it; a ``drain()`` that ran the update early) keeps
    its prediction: the rule is the schedule's, not the order ops happen to run in."""

    method = "extrapolate-made"

    def __init__(self, coefficient: float):
        super().__init__(coefficient)
        self.used: set[int] = set()  # versions compute has asked for (their prediction is fixed)
        self.made = False  # set as it is built, from the compiled schedule (PredictionInputs.made)

    def knows(self, version: int) -> bool:
        self.used.add(version)  # WeightVersions asks before every compute on ``version``
        return super().knows(version)

    def record(self, version: int, delta: list[torch.Tensor]) -> None:
        """delta(version) = W(version) - W(version - 1); on a ``made`` stage also version - 1's
        prediction made exact: W(version - 1) + c * delta(version), if no compute has used it."""
        if self._may_make(version - 1):
            self.deltas[version - 1] = delta
        super().record(version, delta)
        self._forget_used_before(version - 1)

    def _may_make(self, before: int) -> bool:
        """Whether version ``before``, now that the next is made, computes on the made weights: a
        ``made`` stage, a version still kept, no compute has used it (class docstring)."""
        return self.made and before in self.deltas and before not in self.used

    def _forget_used_before(self, before: int) -> None:
        self.used = {v for v in self.used if v >= before}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "used": sorted(self.used)}

    def load_state_dict(self, state: dict, device, params=None) -> None:
        super().load_state_dict(state, device, params)
        self.used = set(state.get("used", ())) if state.get("method") == self.method else set()


def made_before_use(compiled, stage: int) -> bool:
    """Whether every update of ``stage`` runs in its own batch's call on a schedule that never
    flushes, so that the version a batch computes on is one update behind weights already made
    (2bw's last stage)."""
    from ...schedules.ir import OP_INFO

    steps = [op for op in compiled.ops(stage) if OP_INFO[op.kind].new_version]
    return compiled.continuous and bool(steps) and all(op.batch == 0 for op in steps)


@dataclass
class PredictionInputs:
    """What a stage's correction reads besides its weights, given when it is built (the engine
    makes them): ``optimizer``, DeepSpeed's ``engine.optimizer`` (``adam`` reads its state);
    ``params``, the stage's trained parameters (a per-version correction's); ``made``, whether the
    stage makes its next weights before it computes on the version before (:func:`made_before_use`;
    False where fp16 holds the update until the pipeline's overflow vote is in,
    adapter/precision/fp16_async.py: every stage of 2bw but the first)."""

    optimizer: object = None
    params: list | None = None
    made: bool = False
