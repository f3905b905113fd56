"""Checkpoints of a ``HippiePipelineEngine``: DeepSpeed's, plus the in-flight training state
(the deferred gradient buffer, weight versions with the continuous schedules' call cursor
(:class:`~hippie_ds.adapter.engine.call_cursor.CallCursor`, saved as ``call``), the staleness
correction's deltas, each holder's copy of a tied module under schedules that never flush) and
the stage layout. In-flight state is
wrapped so that stock DeepSpeed refuses it (:mod:`hippie_ds.adapter.checkpoint.state`);
checkpoints of stock DeepSpeed and of other stage layouts load (weights follow by layer). And the
warning at exit when what is in flight is neither applied nor saved (:func:`warn_in_flight_at_exit`).
"""
from __future__ import annotations

import os

import torch

from ..checkpoint import state as ckpt
from ..ds import checkpoint as ds_checkpoint, module as ds_module


def warn_in_flight_at_exit(ref) -> None:
    """A training loop need not call ``drain()`` (stock DeepSpeed has no such call): checkpoints
    keep what is in flight, ``eval_batch`` drains first. Weights read straight from the module
    after the last ``train_batch`` lack it; say so once, from each such stage's first replica,
    unless a ``save_checkpoint`` since holds it (Megatron's ``--exit-interval`` saves, then exits)."""
    engine = ref()
    if engine is None or engine.grid.data_parallel_id != 0 or engine._saved_since_training():
        return
    what = ("batches in flight" if engine.has_in_flight() else
            "the last step's delayed gradient" if engine.has_pending_update() else None)
    if what is not None:
        from deepspeed.utils import logger
        logger.warning(f"hippie-ds: schedule {engine.compiled_schedule.name!r} stage {engine.stage_id} exits with "
                       f"{what} not applied to the weights in memory; engine.drain() on every rank applies them, "
                       "save_checkpoint keeps them")


class CheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` with hippie-ds's state: what the components
    (gradients, weight versions, their staleness correction) return from ``state_dict``, in one
    client-state entry with a format field (:func:`~hippie_ds.adapter.checkpoint.state.training_state`)."""

    def _prediction(self):
        """This stage's staleness correction (deferred stage or versioned stage), or None."""
        return self._gradients.prediction or self._versions.prediction

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        # Continuous schedules: drain the batches in flight first (activations cannot be saved;
        # the math does not depend on the drain), then save the weight versions still needed.
        state = dict(client_state)
        state[ckpt.LAYOUT_KEY] = ckpt.layout(self.module.parts)
        versions = None
        if self._continuous:
            self.drain()
            versions = {**self._cursor.state_dict(), **self._versions.state_dict()}  # the module holds the current version
        # The pending gradient is part of the training state: its all-reduce finishes first.
        self._exec_wait_sends()
        prediction = self._prediction()
        # tied copies: the schedules that never flush update them apart, the others keep them equal
        state[ckpt.STATE_KEY] = ckpt.training_state(self._gradients.state_dict(), versions,
                                                    None if prediction is None else prediction.state_dict(),
                                                    self._tied_copies(clone=True) if self._continuous else None)
        saved = super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
        self._checkpointed_batch = self._batch_index  # it holds the in-flight state until the next train_batch
        return saved

    def _saved_since_training(self) -> bool:
        """The last ``save_checkpoint`` came after the last ``train_batch``: it holds what is in flight."""
        return getattr(self, "_checkpointed_batch", None) == self._batch_index

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, **kwargs):
        """DeepSpeed's ``load_checkpoint``, plus hippie-ds's state. Loads checkpoints of stock
        DeepSpeed and of other stage layouts (re-planned runs): weights follow by layer; optimizer
        state cannot, so a layout change needs ``load_optimizer_states=False`` (an explicit
        restart of the optimizer state) and a checkpoint with nothing in flight."""
        self._gradients.wait_buffer()
        changed, why = self._checkpoint_layout_change(load_dir, tag)
        if changed and load_optimizer_states:
            raise ValueError(f"load_checkpoint({str(load_dir)!r}): {why}")
        with ckpt.loading():
            path, client_state = super().load_checkpoint(load_dir, tag=tag,
                                                         load_optimizer_states=load_optimizer_states, **kwargs)
        if client_state is None:
            return path, client_state
        client_state.pop(ckpt.LAYOUT_KEY, None)
        saved = ckpt.read_training_state(client_state)
        buffer, versions, prediction = saved["grad_buffer"], saved["weight_versions"], saved["prediction"]
        if saved["tied_copies"] is not None and self._continuous and not changed:
            self._restore_tied_copies(saved["tied_copies"], load_dir)  # else DeepSpeed's: stage 0's copy
        if changed:
            if ckpt.holds_in_flight(buffer, versions):
                raise ValueError(f"load_checkpoint({str(load_dir)!r}): the checkpoint holds in-flight state (a deferred "
                                 "gradient, tied-gradient sums or weight versions) of another stage layout; save it "
                                 "after engine.drain() to resume with new stage boundaries")
            prediction = None  # the previous weights of other stages: the prediction restarts
        if buffer is not None and buffer["buffer"] is not None:
            delayed = sum(g.numel() for g in self._gradients.delayed_grads())  # bf16: the accumulator, padding included
            if buffer["buffer"].numel() != delayed:
                raise ValueError(f"load_checkpoint({str(load_dir)!r}): stage {self.stage_id}'s buffered gradient has "
                                 f"{buffer['buffer'].numel()} elements, this run delays {delayed} (config key "
                                 '"hippie.deferred_layers" differs from the saved run\'s; '
                                 'the default was 1 before "untied", the first layer not tied to another stage, '
                                 'and "all" before that); resume with the same '
                                 "value, or save after engine.drain()")
        if buffer is not None:
            self._gradients.load_state_dict(buffer, self.device)
        own = self._prediction()
        if own is not None:  # a checkpoint without a prediction (or of another layout) restarts it
            if prediction is not None:
                own.load_state_dict(prediction, self.device)
            else:
                own.deltas = {}
        if versions is not None:
            self._cursor.load_state_dict(versions)
            self._versions.load_state_dict(versions, self.device)
        return path, client_state

    def _tied_copies(self, clone: bool = False) -> dict[str, torch.Tensor] | None:
        """{"key.attr": this stage's copy of a tied weight}, None without any. Under ``2bw`` and
        ``pipedream`` the holders apply the same tie sums at other times of the pipeline (and so,
        under an LR schedule, at other learning rates): the copies differ, and DeepSpeed's load
        overwrites every copy with the first holder's (``_synchronize_tied_weights``)."""
        copies = {f"{key}.{attr}": (torch.Tensor.clone(torch.Tensor.detach(w)) if clone else w)
                  for key, comm in self.module.tied_comms.items() for attr in comm["weight_attr"]
                  for w in (ds_module.recursive_getattr(self.module, self.module.tied_modules[key], attr), )}
        return copies or None

    @torch.no_grad()
    def _restore_tied_copies(self, saved: dict, load_dir) -> None:
        """Put this stage's saved tied copies back over the first holder's (under bf16 the module's
        bf16 copy; the fp32 master weights come with the stage's own optimizer state)."""
        own = self._tied_copies() or {}
        if set(saved) != set(own):
            raise ValueError(f"load_checkpoint({str(load_dir)!r}): stage {self.stage_id} saved tied weights "
                             f"{sorted(saved)}, this model ties {sorted(own)} here")
        for name, weight in own.items():
            torch.Tensor.copy_(weight, saved[name].to(weight.device, weight.dtype))

    def _checkpoint_layout_change(self, load_dir, tag) -> tuple[bool, str]:
        """Whether the checkpoint's stage layout differs from this model's, and the message. A
        stock checkpoint carries no layout: its stage count (DeepSpeed's, tensor parallelism
        included: :func:`~hippie_ds.adapter.checkpoint.state.checkpoint_stages`) and whether
        this rank's optimizer state fits its parameters tell."""
        import glob
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return False, ""  # DeepSpeed warns and loads nothing
            with open(latest) as f:
                tag = f.read().strip()
        files = ds_checkpoint.checkpoint_files(self, load_dir, tag)  # the model-state files DeepSpeed reads (mp_rank_XX)
        if not files:
            return False, ""
        own = ds_checkpoint.own_checkpoint_file(self, load_dir, tag)  # the one this rank's DeepSpeed load reads
        with ckpt.loading():
            saved = torch.load(own if os.path.exists(own) else files[0], map_location="cpu", weights_only=False)
        current = ckpt.layout(self.module.parts)
        saved_layout = saved.get(ckpt.LAYOUT_KEY)
        stages = ckpt.checkpoint_stages(saved, files, glob.glob(os.path.join(load_dir, str(tag), "layer_*")))
        shapes_match = True
        optimizer = saved.get("optimizer")
        if saved_layout is None and os.path.exists(own) and isinstance(optimizer, dict) and \
                {"state", "param_groups"} <= set(optimizer) and hasattr(self.optimizer, "param_groups"):
            shapes_match = ckpt.optimizer_state_fits(optimizer["state"], optimizer["param_groups"],
                                                     [g["params"] for g in self.optimizer.param_groups])
        changed = ckpt.layout_changed(saved_layout, current, stages, shapes_match)
        return changed, ckpt.layout_change_message(saved_layout, current, stages) if changed else ""
