"""Weight versions of a ``HippiePipelineEngine`` stage (schedules whose compute ops declare a
``version``: 2bw, pipedream), and their prediction (``hippie.staleness``, for stages one update
behind: :class:`~hippie_ds.adapter.staleness.prediction.WeightPrediction`).

A stage's version counts its updates. The module's parameters hold one version at a time; the
others live as flat copies (the store): a compute op first swaps its version in (copying the
parameters' values through ``.data``), an update swaps the current version in, and
``stash`` keeps a copy of it before it is overwritten. Autograd's saved-tensor check would
reject a backward after an in-place optimizer step on the parameters its forward saved; the engine
guarantees (and the validator proves statically) that the backward sees the values its forward
used, so :meth:`WeightVersions.update` restores the parameters' version counters after the step.

A prediction (or a stashed version) is in the module only while the ops that use it run: at the
end of every ``train_batch`` and ``drain`` the module holds the true current version again
(:meth:`WeightVersions.hold_current`), which is what a user reads, exports, evaluates or saves.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._utils import _unflatten_dense_tensors

from ...schedules.ir import weight_version
from ..module.tensor_calls import flat_copy
from .prediction import WeightPrediction


class WeightVersions:
    """One stage's weight versions: which the module holds, which are stored, the count."""

    def __init__(
        self,
        params: list[torch.Tensor],
        stage: int,
        updates_per_batch: int,
        versioned: bool,
        prediction: WeightPrediction | None = None,
    ):
        self.params = params
        self.stage = stage
        self.versioned = versioned
        self.updates_per_batch = updates_per_batch
        self.count = 0  # updates applied: the current version
        self.loaded = 0  # the version the module's parameters hold
        self.store: dict[int, torch.Tensor] = {}  # versions not in the module (flat copies)
        self.stashed: set[int] = set()
        self.peak = 1
        self.prediction = prediction  # None: compute on the true versions
        self._predicted = False  # the module holds the prediction of `loaded` (true copy in the store)

    def absolute(self, batch: int, version: int, clamp: bool = True) -> int:
        """Absolute weight version of an op of absolute ``batch`` declaring ``version``
        (``ir.weight_version``; below 0: the initial weights, unless ``clamp``)."""
        return weight_version(batch, self.updates_per_batch, version, clamp)

    def use(self, version: int, predicted: bool = False) -> None:
        """Make the module's parameters hold ``version`` (its prediction when ``predicted`` and
        the correction knows its delta), keeping the true values of the one they hold."""
        predicted = predicted and self.prediction is not None and self.prediction.knows(version)
        if version == self.loaded and predicted == self._predicted:
            return
        data = [p.data for p in self.params]
        loaded = self.loaded
        if not self._predicted and (loaded == self.count or loaded in self.stashed) and loaded not in self.store:
            self.store[loaded] = flat_copy(data)
        if version not in self.store:
            raise RuntimeError(
                f"stage {self.stage}: weight version {version} is not available (current "
                f"{self.count}, stashed {sorted(self.stashed)}); the validator should "
                "have rejected this schedule"
            )
        # a prediction leaves the true values in the store; the true version moves into the module
        values = self.prediction.predicted(version, [self.store[version]])[0] if predicted else self.store.pop(version)
        for dst, src in zip(data, _unflatten_dense_tensors(values, data)):
            dst.copy_(src)
        self.loaded, self._predicted = version, predicted

    def hold_current(self) -> None:
        """Between calls: the module holds the true current version, not the prediction or the
        stashed version the last compute op used (the next compute op swaps its own in again)."""
        if self.versioned:
            self.use(self.count)

    def use_for_compute(self, version: int) -> None:
        """Before a compute op declaring ``version``: that version, predicted when corrected."""
        self.use(version, predicted=self.prediction is not None)

    def stash(self, version: int) -> None:
        if version != self.count:
            raise RuntimeError(f"stage {self.stage}: stash_weights of version {version}, current is {self.count}")
        self.use(version)
        if version not in self.store:
            self.store[version] = flat_copy([p.data for p in self.params])
        self.stashed.add(version)
        self.peak = max(self.peak, len(self.stashed) + 1)

    def free(self, version: int) -> None:
        if version < 0:
            return  # the initial weights are freed as version 0
        self.stashed.discard(version)
        if version == self.count and (self.loaded != self.count or self._predicted):
            self._prune()  # fp16's held update (fp16_async): still the current version, kept for it
            return
        self.store.pop(version, None)
        self._prune()

    def _prune(self) -> None:
        if self.prediction is not None:  # the deltas of the versions compute may still use
            self.prediction.keep_only({self.count} | self.stashed)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The stored versions and the prediction's state, uncopied (a memory probe's view)."""
        return {
            "weight_versions": list(self.store.values()),
            "prediction": [] if self.prediction is None else self.prediction.held_tensors(),
        }

    def summary(self) -> dict:
        """current (updates applied), stashed, the most held at once."""
        return {"current": self.count, "stashed": sorted(self.stashed), "peak": self.peak}

    def update(self, step: Callable[[], None]) -> None:
        """A per-stage update by ``step()`` on the current version; the new values become the
        current version (and their delta the next prediction)."""
        if self.versioned:
            self.use(self.count)
            if self.count in self.stashed and self.count not in self.store:  # fp16's held update (fp16_async):
                self.store[self.count] = flat_copy([p.data for p in self.params])  # the stash outlives the step
        versions = tuple(p._version for p in self.params)
        before = None if self.prediction is None else flat_copy([p.data for p in self.params])
        step()
        if before is not None:
            after = flat_copy([p.data for p in self.params])
            self.prediction.record(self.count + 1, [torch.sub(after, before, out=after)])
        if self.versioned:
            # Saved tensors of forwards still awaiting their backward refer to these parameters;
            # the version swap gives each backward its forward's values (see the module docstring).
            torch._C._autograd._unsafe_set_version_counter(tuple(self.params), versions)
        self.count += 1
        self.loaded = self.count
        self._prune()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The current version goes into the module (its states are what DeepSpeed saves); the
        stashed versions still needed are saved here."""
        if self.versioned:
            self.use(self.count)
        return {"count": self.count, "stashed": {v: self.store[v].clone() for v in sorted(self.stashed)}}

    def load_state_dict(self, state: dict, device) -> None:
        self.count = self.loaded = state["count"]
        self._predicted = False
        self.store = {int(v): torch.Tensor.to(t, device) for v, t in state["stashed"].items()}
        self.stashed = set(self.store)
