"""The in-flight training state of a ``HippiePipelineEngine`` checkpoint, as a component
(:class:`TrainingState`): the deferred gradient buffer, weight versions with the continuous
schedules' call cursor (:class:`~hippie_ds.adapter.stage.call_cursor.CallCursor`, saved as ``call``),
the staleness correction's deltas, each holder's copy of a tied module under schedules that never
flush, and the stage layout; what a save gathers and a load restores. In-flight state is wrapped so
that stock DeepSpeed refuses it (:mod:`hippie_ds.adapter.checkpoint.state`); checkpoints of stock
DeepSpeed and of other stage layouts load (weights follow by layer). The engine's
``save_checkpoint`` / ``load_checkpoint`` overrides (adapter/engine/engine.py, through the stage runtime) call it.
"""

from __future__ import annotations

import os

import torch

from . import state as ckpt
from ..ds import checkpoint as ds_checkpoint, module as ds_module


class TrainingState:
    """Built with what it saves and restores: the ``module`` (its parts and tied modules), the
    stage's ``gradients`` (StageGradients), weight ``versions`` (WeightVersions), the call ``cursor``,
    whether the schedule is ``continuous``, the ``stage`` and the ``device`` loads go to; and with what
    a load's layout check reads: the ``optimizer`` (its parameter groups) and the checkpoint ``files``
    DeepSpeed's load reads (:class:`~hippie_ds.adapter.ds.checkpoint.CheckpointFiles`)."""

    def __init__(
        self,
        module,
        gradients,
        versions,
        cursor,
        continuous: bool,
        stage: int,
        device,
        optimizer,
        files: ds_checkpoint.CheckpointFiles,
    ):
        self.module, self.gradients, self.versions, self.cursor = module, gradients, versions, cursor
        self.continuous, self.stage, self.device = continuous, stage, device
        self.optimizer, self.files = optimizer, files
        # this stage's staleness correction (deferred stage or versioned stage), or None
        self.prediction = gradients.prediction or versions.prediction

    def gather(self, client_state: dict) -> dict:
        """``client_state`` with hippie-ds's entries (after the engine drained what is in flight and
        waited for its sends): the layout, and the training state in one entry with a format field
        (:func:`~hippie_ds.adapter.checkpoint.state.training_state`)."""
        state = dict(client_state)
        state[ckpt.LAYOUT_KEY] = ckpt.layout(self.module.parts)
        versions = {**self.cursor.state_dict(), **self.versions.state_dict()} if self.continuous else None
        prediction = self.prediction
        # tied copies: the schedules that never flush update them apart, the others keep them equal
        state[ckpt.STATE_KEY] = ckpt.training_state(
            self.gradients.state_dict(),
            versions,
            None if prediction is None else prediction.state_dict(),
            self.tied_copies(clone=True) if self.continuous else None,
        )
        return state

    def restore(self, client_state: dict, load_dir, changed: bool) -> None:
        """Put the saved training state of ``client_state`` (a load's) back; ``changed``: the
        checkpoint's stage layout differs from this model's."""
        client_state.pop(ckpt.LAYOUT_KEY, None)
        saved = ckpt.read_training_state(client_state)
        buffer, versions, prediction = saved["grad_buffer"], saved["weight_versions"], saved["prediction"]
        if saved["tied_copies"] is not None and self.continuous and not changed:
            self.restore_tied_copies(saved["tied_copies"], load_dir)  # else DeepSpeed's: stage 0's copy
        if changed:
            if ckpt.holds_in_flight(buffer, versions):
                raise ValueError(
                    f"load_checkpoint({str(load_dir)!r}): the checkpoint holds in-flight state (a deferred "
                    "gradient, tied-gradient sums or weight versions) of another stage layout; save it "
                    "after engine.drain() to resume with new stage boundaries"
                )
            prediction = None  # the previous weights of other stages: the prediction restarts
        if buffer is not None and buffer["buffer"] is not None:
            delayed = sum(g.numel() for g in self.gradients.delayed_grads())  # bf16: the accumulator, padding included
            if buffer["buffer"].numel() != delayed:
                raise ValueError(
                    f"load_checkpoint({str(load_dir)!r}): stage {self.stage}'s buffered gradient has "
                    f"{buffer['buffer'].numel()} elements, this run delays {delayed} (config key "
                    '"hippie.deferred_layers" differs from the saved run\'s; '
                    'the default was 1 before "untied", the first layer not tied to another stage, '
                    'and "all" before that); resume with the same '
                    "value, or save after engine.drain()"
                )
        if buffer is not None:
            self.gradients.load_state_dict(buffer, self.device)
        own = self.prediction
        if own is not None:  # a checkpoint without a prediction (or of another layout) restarts it
            if prediction is not None:
                own.load_state_dict(prediction, self.device)
            else:
                own.deltas = {}
        if versions is not None:
            self.cursor.load_state_dict(versions)
            self.versions.load_state_dict(versions, self.device)

    def tied_copies(self, clone: bool = False) -> dict[str, torch.Tensor] | None:
        """{"key.attr": this stage's copy of a tied weight}, None without any. Under ``2bw`` and
        ``pipedream`` the holders apply the same tie sums at other times of the pipeline (and so,
        under an LR schedule, at other learning rates): the copies differ, and DeepSpeed's load
        overwrites every copy with the first holder's (``_synchronize_tied_weights``)."""
        copies = {
            f"{key}.{attr}": (torch.Tensor.clone(torch.Tensor.detach(w)) if clone else w)
            for key, comm in self.module.tied_comms.items()
            for attr in comm["weight_attr"]
            for w in (ds_module.recursive_getattr(self.module, self.module.tied_modules[key], attr),)
        }
        return copies or None

    @torch.no_grad()
    def restore_tied_copies(self, saved: dict, load_dir) -> None:
        """Put this stage's saved tied copies back over the first holder's (under bf16 the module's
        bf16 copy; the fp32 master weights come with the stage's own optimizer state)."""
        own = self.tied_copies() or {}
        if set(saved) != set(own):
            raise ValueError(
                f"load_checkpoint({str(load_dir)!r}): stage {self.stage} saved tied weights "
                f"{sorted(saved)}, this model ties {sorted(own)} here"
            )
        for name, weight in own.items():
            torch.Tensor.copy_(weight, saved[name].to(weight.device, weight.dtype))

    def layout_change(self, load_dir, tag) -> tuple[bool, str]:
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
        files = self.files.all(load_dir, tag)  # the model-state files DeepSpeed reads (mp_rank_XX)
        if not files:
            return False, ""
        own = self.files.own(load_dir, tag)  # the one this rank's DeepSpeed load reads
        with ckpt.loading():
            saved = torch.load(own if os.path.exists(own) else files[0], map_location="cpu", weights_only=False)
        current = ckpt.layout(self.module.parts)
        saved_layout = saved.get(ckpt.LAYOUT_KEY)
        stages = ckpt.checkpoint_stages(saved, files, glob.glob(os.path.join(load_dir, str(tag), "layer_*")))
        shapes_match = True
        optimizer = saved.get("optimizer")
        if (
            saved_layout is None
            and os.path.exists(own)
            and isinstance(optimizer, dict)
            and {"state", "param_groups"} <= set(optimizer)
            and hasattr(self.optimizer, "param_groups")
        ):
            shapes_match = ckpt.optimizer_state_fits(
                optimizer["state"], optimizer["param_groups"], [g["params"] for g in self.optimizer.param_groups]
            )
        changed = ckpt.layout_changed(saved_layout, current, stages, shapes_match)
        return changed, ckpt.layout_change_message(saved_layout, current, stages) if changed else ""
