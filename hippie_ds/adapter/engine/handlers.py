"""The handlers of the instructions the components run (:class:`ComponentHandlers`, a part of
``HippiePipelineEngine``): all-reduces and the gradient buffer (``StageGradients``,
adapter/gradients/stage.py), per-stage updates (``StageStep``, adapter/precision/step.py, and the
continuous schedules' updates, adapter/precision/fp16_async.py), weight versions (``WeightVersions``,
adapter/staleness/versions.py) and the split backward (``SplitBackward``, adapter/gradients/split.py).
Each takes exactly its ``OP_INFO`` entry's ``args`` and calls the component that owns the state it
touches."""
from __future__ import annotations


class ComponentHandlers:
    """Mixin of ``HippiePipelineEngine``: the handlers DeepSpeed's ``_INSTRUCTION_MAP`` calls for the
    component instructions, and DeepSpeed's output hook that the split backward changes."""

    def _exec_start_allreduce(self, target, chunk):
        if target == "chunk":  # virtual stages: one chunk's gradients, its backwards done
            self._gradients.start_chunk_allreduce(self.module.chunk_parameters(chunk))
        else:
            self._gradients.start_allreduce(target)

    def _exec_wait_allreduce(self, target):
        self._gradients.wait_allreduce(target)

    def _exec_copy_grads_to_buffer(self):
        self._gradients.copy_to_buffer()

    def _exec_apply_buffered_update(self):
        with self._gradients.buffered_update() as updates:  # the buffered gradient in place
            self._stage_step.step() if updates else self._stage_step.count_only()

    def _exec_stage_optimizer_step(self, batch: int = 0):
        if not self._continuous:
            self._stage_step.step()
            return
        # a per-stage update of a continuous schedule: on the current version, per-stage
        # clipping, no step counters (the call advances them), at its batch's learning rates
        # (an update may run in the next call: every stage, and every holder of a tied module,
        # applies a batch's gradient at the same rate wherever the call boundary falls)
        rates = self._cursor.lrs(batch)
        self._updates.update(rates)  # on the current version (fp16: once the overflow vote decides, fp16_async)

    def _exec_stash_weights(self, batch: int, version: int):
        self._updates.before_use(self._abs_version(batch, version))  # fp16: the held update making it, decided
        self._versions.stash(self._abs_version(batch, version))

    def _exec_free_weights(self, batch: int, version: int):
        self._versions.free(self._abs_version(batch, version, clamp=False))

    # ------------------------------------------------------------------ the split backward
    def _exec_backward_input_pass(self, buffer_id):
        """Roughly: ``buffers['inputs'][buf].grad = d out / d inputs`` (no parameter gradients)."""
        if self._split.whole_backward_in_input:  # DeepSpeed's activation checkpoint: its own backward
            self._exec_backward_pass(buffer_id)
            return
        loss = self._losses.pop(buffer_id) if self.is_last_stage() else None
        self._split.backward_input(buffer_id, loss, self._chunks.chunk)

    def _exec_backward_weight_pass(self, buffer_id):
        """Roughly: ``grads += d out / d params`` of the buffer's micro-batch; frees what I kept."""
        if not self._split.whole_backward_in_input:
            self._split.backward_weight(buffer_id)

    def _backward_prologue_per_tensor(self, grad):
        """Overrides ``DeepSpeedEngine._backward_prologue_per_tensor`` (DeepSpeed's output hook): it
        divides by the accumulation steps unless engine.backward(loss) already did; the loss stage's
        backward_input divides the loss itself."""
        if self._split is not None and self._split.loss_scaled:
            return grad
        return super()._backward_prologue_per_tensor(grad)
