"""Weight versions of a ``HippiePipelineEngine`` stage (schedules whose compute ops declare a
``version``: 2bw, pipedream), and 2bw's prediction of them (``hippie.staleness``).

A stage's version counts its updates. The module's parameters hold one version at a time; the
others live as flat copies (``_wv_store``): a compute op first swaps its version in (copying the
parameters' values through ``.data``), an update swaps the current version in, and
``stash_weights`` keeps a copy of it before it is overwritten. Autograd's saved-tensor check would
reject a backward after an in-place optimizer step on the parameters its forward saved; the engine
guarantees (and the validator proves statically) that the backward sees the values its forward
used, so it restores the parameters' version counters after each such step.
"""
from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..schedules.ir import CompiledSchedule, weight_version


class WeightVersionsMixin:
    """The engine's weight-version state and handlers (``StashWeights``, ``FreeWeights``, the
    per-stage update of a continuous schedule)."""

    def _init_weight_versions(self, compiled: CompiledSchedule, staleness) -> None:
        self._versioned = compiled.versioned
        self._wv_updates = compiled.updates_per_batch[self.stage_id] if compiled.continuous else 0
        self._wv_count = 0  # updates applied: the current version
        self._wv_loaded = 0  # the version the module's parameters hold
        self._wv_store: dict[int, torch.Tensor] = {}  # versions not in the module (flat copies)
        self._wv_stashed: set[int] = set()
        self._wv_peak = 1
        # 2bw's staleness correction: versioned stages one update behind compute on
        # W(v) + c * (W(v) - W(v-1)); the deltas of the versions still computed on are kept
        self._wv_deltas: dict[int, torch.Tensor] | None = None
        self._wv_predicted = False  # the module holds the prediction of _wv_loaded (true copy in _wv_store)
        self._wv_coefficient = 0.0
        if (staleness is not None and staleness.method == "extrapolate" and self._versioned
                and compiled.one_version_behind(self.stage_id)):
            self._wv_deltas, self._wv_coefficient = {}, staleness.coefficient

    def _abs_version(self, batch: int, version: int, clamp: bool = True) -> int:
        """Absolute weight version of an op of ``batch`` (relative to the running call) declaring
        ``version`` (``ir.weight_version``; below 0: the initial weights, unless ``clamp``)."""
        return weight_version(self._op_call + batch, self._wv_updates, version, clamp)

    def _version_params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _use_version(self, version: int, predicted: bool = False) -> None:
        """Make the module's parameters hold ``version`` (its prediction W + c * delta when
        ``predicted`` and a delta is known), keeping the true values of the one they hold."""
        delta = self._wv_deltas.get(version) if predicted and self._wv_deltas is not None else None
        predicted = delta is not None
        if version == self._wv_loaded and predicted == self._wv_predicted:
            return
        params = self._version_params()
        data = [p.data for p in params]
        loaded = self._wv_loaded
        if (not self._wv_predicted and (loaded == self._wv_count or loaded in self._wv_stashed)
                and loaded not in self._wv_store):
            self._wv_store[loaded] = _flatten_dense_tensors(data)
        if version not in self._wv_store:
            raise RuntimeError(f"stage {self.stage_id}: weight version {version} is not available (current "
                               f"{self._wv_count}, stashed {sorted(self._wv_stashed)}); the validator should "
                               "have rejected this schedule")
        # a prediction leaves the true values in the store; the true version moves into the module
        values = self._wv_store[version] + self._wv_coefficient * delta if predicted else self._wv_store.pop(version)
        for dst, src in zip(data, _unflatten_dense_tensors(values, data)):
            dst.copy_(src)
        self._wv_loaded, self._wv_predicted = version, predicted

    def _exec_stash_weights(self, batch: int, version: int):
        version = self._abs_version(batch, version)
        if version != self._wv_count:
            raise RuntimeError(f"stage {self.stage_id}: stash_weights of version {version}, current is "
                               f"{self._wv_count}")
        self._use_version(version)
        if version not in self._wv_store:
            self._wv_store[version] = _flatten_dense_tensors([p.data for p in self._version_params()])
        self._wv_stashed.add(version)
        self._wv_peak = max(self._wv_peak, len(self._wv_stashed) + 1)

    def _exec_free_weights(self, batch: int, version: int):
        version = self._abs_version(batch, version, clamp=False)
        if version < 0:
            return  # the initial weights are freed as version 0
        self._wv_stashed.discard(version)
        self._wv_store.pop(version, None)
        self._prune_deltas()

    def _prune_deltas(self):
        """Keep the deltas of the versions compute may still use (current and stashed)."""
        for v in [v for v in self._wv_deltas or () if v != self._wv_count and v not in self._wv_stashed]:
            del self._wv_deltas[v]

    def weight_versions(self) -> dict:
        """This stage's weight versions: current (updates applied), stashed, the most held at once."""
        return {"current": self._wv_count, "stashed": sorted(self._wv_stashed), "peak": self._wv_peak}

    def _continuous_step(self):
        """A per-stage update of a continuous schedule: on the current version, per-stage clipping,
        no step counters (the call advances them); the new values become the current version."""
        if self._versioned:
            self._use_version(self._wv_count)
        params = self._version_params()
        versions = tuple(p._version for p in params)
        before = None if self._wv_deltas is None else _flatten_dense_tensors([p.data for p in params])
        self._stage_step_without_counters()
        if before is not None:  # this update's delta: the next version's prediction
            self._wv_deltas[self._wv_count + 1] = _flatten_dense_tensors([p.data for p in params]).sub_(before)
        if self._versioned:
            # Saved tensors of forwards still awaiting their backward refer to these parameters;
            # the version swap gives each backward its forward's values (see the module docstring).
            torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
        self._wv_count += 1
        self._wv_loaded = self._wv_count
        self._prune_deltas()
