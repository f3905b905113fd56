"""Checkpoints of a ``HippiePipelineEngine``: DeepSpeed's, plus the in-flight training state
(the deferred gradient buffer, weight versions, the staleness correction's previous weights)
and the stage layout. In-flight state is wrapped so that stock DeepSpeed refuses it
(:mod:`hippie_ds.adapter.checkpoint_state`); checkpoints of stock DeepSpeed and of other stage layouts
load (weights follow by layer).
"""
from __future__ import annotations

import os

import torch

from . import checkpoint_state as ckpt

GRAD_BUFFER_KEY = "hippie_ds_grad_buffer"
WEIGHT_PREDICTION_KEY = "hippie_ds_weight_prediction"
WEIGHT_VERSIONS_KEY = "hippie_ds_weight_versions"


class CheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` with hippie-ds's state."""

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        # Continuous schedules: drain the batches in flight first (activations cannot be saved;
        # the math does not depend on the drain), then save the weight versions still needed.
        # In-flight state is wrapped so that stock DeepSpeed refuses it (hippie_ds.adapter.checkpoint_state).
        state = dict(client_state)
        state[ckpt.LAYOUT_KEY] = ckpt.layout(self.module.parts)
        if self._continuous:
            self.drain()
            if self._versioned:
                self._use_version(self._wv_count)  # the module's states are the current version
            versions = {"call": self._call, "count": self._wv_count,
                        "stashed": {v: self._wv_store[v].clone() for v in sorted(self._wv_stashed)}}
            state[WEIGHT_VERSIONS_KEY] = ckpt.InFlightState(versions) if versions["stashed"] else versions
        # The pending gradient is part of the training state: finish its all-reduce (identical on
        # every replica afterwards) and save it with this stage's model states.
        self._exec_wait_sends()
        if self._grad_buffer_state == "filled":  # each replica holds its own part: reduce it now
            self._exec_start_allreduce("buffer")
        self._wait_buffer()
        empty = self._grad_buffer_state == "empty" or self._grad_buffer is None  # a spare buffer is not state
        buffer = {"state": self._grad_buffer_state, "buffer": None if empty else self._grad_buffer.clone()}
        state[GRAD_BUFFER_KEY] = buffer if self._grad_buffer_state == "empty" else ckpt.InFlightState(buffer)
        if self._corrector is not None:
            state[WEIGHT_PREDICTION_KEY] = self._corrector.state_dict()
        if self._wv_deltas is not None:  # drained above: the module holds the true current version
            state[WEIGHT_PREDICTION_KEY] = {"deltas": {v: d.clone() for v, d in self._wv_deltas.items()}}
        return super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, **kwargs):
        """DeepSpeed's ``load_checkpoint``, plus hippie-ds's state. Loads checkpoints of stock
        DeepSpeed and of other stage layouts (re-planned runs): weights follow by layer; optimizer
        state cannot, so a layout change needs ``load_optimizer_states=False`` (an explicit
        restart of the optimizer state) and a checkpoint with nothing in flight."""
        self._wait_buffer()
        changed, why = self._checkpoint_layout_change(load_dir, tag)
        if changed and load_optimizer_states:
            raise ValueError(f"load_checkpoint({str(load_dir)!r}): {why}")
        with ckpt.loading():
            path, client_state = super().load_checkpoint(load_dir, tag=tag,
                                                         load_optimizer_states=load_optimizer_states, **kwargs)
        if client_state is None:
            return path, client_state
        client_state.pop(ckpt.LAYOUT_KEY, None)
        buffer = ckpt.unwrap(client_state.pop(GRAD_BUFFER_KEY, None))
        versions = ckpt.unwrap(client_state.pop(WEIGHT_VERSIONS_KEY, None))
        prediction = client_state.pop(WEIGHT_PREDICTION_KEY, None)
        if changed:
            if (buffer and buffer["state"] != "empty") or (versions and versions["stashed"]):
                raise ValueError(f"load_checkpoint({str(load_dir)!r}): the checkpoint holds in-flight state (a deferred "
                                 "gradient or weight versions) of another stage layout; save it after engine.drain() "
                                 "to resume with new stage boundaries")
            prediction = None  # the previous weights of other stages: the prediction restarts
        if buffer is not None and buffer["buffer"] is not None:
            delayed = sum(g.numel() for g in self._delayed_grads())  # bf16: the accumulator, padding included
            if buffer["buffer"].numel() != delayed:
                raise ValueError(f"load_checkpoint({str(load_dir)!r}): stage {self.stage_id}'s buffered gradient has "
                                 f"{buffer['buffer'].numel()} elements, this run delays {delayed} (config key "
                                 '"hippie.deferred_layers" differs from the saved run\'s; '
                                 'before it defaulted to 1, a deferred stage delayed "all"); resume with the same '
                                 "value, or save after engine.drain()")
        if buffer is not None:
            self._grad_buffer_state = buffer["state"]
            # an empty buffer is re-allocated at this layout's size on first use
            self._grad_buffer = None if buffer["buffer"] is None else buffer["buffer"].to(self.device)
        if prediction is not None and self._corrector is not None and "deltas" not in prediction:
            self._corrector.load_state_dict(prediction, self.device)
        if self._wv_deltas is not None:
            deltas = (prediction or {}).get("deltas", {})
            self._wv_deltas = {int(v): d.to(self.device) for v, d in deltas.items()}
        if versions is not None:
            self._call = self._op_call = self._first_batch = versions["call"]
            self._in_flight = False
            self._wv_count = self._wv_loaded = versions["count"]
            self._wv_predicted = False
            self._wv_store = {int(v): t.to(self.device) for v, t in versions["stashed"].items()}
            self._wv_stashed = set(self._wv_store)
        return path, client_state

    def _checkpoint_layout_change(self, load_dir, tag) -> tuple[bool, str]:
        """Whether the checkpoint's stage layout differs from this model's, and the message."""
        import glob
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return False, ""  # DeepSpeed warns and loads nothing
            with open(latest) as f:
                tag = f.read().strip()
        files = sorted(glob.glob(os.path.join(load_dir, str(tag), "mp_rank_*_model_states.pt")))
        if not files:
            return False, ""
        own = os.path.join(load_dir, str(tag), f"mp_rank_{self.stage_id:02d}_model_states.pt")
        with ckpt.loading():
            saved = torch.load(own if os.path.exists(own) else files[0], map_location="cpu", weights_only=False)
        current = ckpt.layout(self.module.parts)
        saved_layout = saved.get(ckpt.LAYOUT_KEY)
        shapes_match = True
        if saved_layout is None and os.path.exists(own) and isinstance(saved.get("optimizer"), dict):
            states = saved["optimizer"].get("state", {})
            params = self._version_params()
            shapes_match = all(not torch.is_tensor(t) or t.dim() == 0 or (int(i) < len(params) and
                                                                          t.shape == params[int(i)].shape)
                               for i, st in states.items() for t in st.values())
        changed = ckpt.layout_changed(saved_layout, current, len(files), shapes_match)
        return changed, ckpt.layout_change_message(saved_layout, current, len(files)) if changed else ""
