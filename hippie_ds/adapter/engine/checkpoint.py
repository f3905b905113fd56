"""Checkpoints of a ``HippiePipelineEngine``: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``
overridden to carry the in-flight training state (:class:`~hippie_ds.adapter.checkpoint.in_flight.TrainingState`,
built with the components), and the warning at exit when what is in flight is neither applied nor
saved (:func:`warn_in_flight_at_exit`).
"""
from __future__ import annotations

from ..checkpoint import state as ckpt


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
    """``save_checkpoint`` / ``load_checkpoint`` with hippie-ds's state (``self._in_flight``, a
    :class:`~hippie_ds.adapter.checkpoint.in_flight.TrainingState`), in one client-state entry
    with a format field (:func:`~hippie_ds.adapter.checkpoint.state.training_state`)."""

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Overrides ``DeepSpeedEngine.save_checkpoint`` (calls it) with the in-flight state."""
        # Continuous schedules: drain the batches in flight first (activations cannot be saved;
        # the math does not depend on the drain), then save the weight versions still needed.
        if self._continuous:
            self.drain()
        # The pending gradient is part of the training state: its all-reduce finishes first.
        self._exec_wait_sends()
        state = self._in_flight.gather(client_state)
        saved = super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
        self._checkpointed_batch = self._batch_index  # it holds the in-flight state until the next train_batch
        return saved

    def _saved_since_training(self) -> bool:
        """The last ``save_checkpoint`` came after the last ``train_batch``: it holds what is in flight."""
        return getattr(self, "_checkpointed_batch", None) == self._batch_index

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, **kwargs):
        """Overrides ``DeepSpeedEngine.load_checkpoint`` (calls it), plus hippie-ds's state. Loads
        checkpoints of stock DeepSpeed and of other stage layouts (re-planned runs): weights follow
        by layer; optimizer state cannot, so a layout change needs ``load_optimizer_states=False`` (an
        explicit restart of the optimizer state) and a checkpoint with nothing in flight."""
        self._gradients.wait_buffer()
        changed, why = self._in_flight.layout_change(load_dir, tag)
        if changed and load_optimizer_states:
            raise ValueError(f"load_checkpoint({str(load_dir)!r}): {why}")
        with ckpt.loading():
            path, client_state = super().load_checkpoint(load_dir, tag=tag,
                                                         load_optimizer_states=load_optimizer_states, **kwargs)
        if client_state is not None:
            self._in_flight.restore(client_state, load_dir, changed)
        return path, client_state
