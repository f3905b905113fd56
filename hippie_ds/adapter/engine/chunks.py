"""Virtual stages in ``HippiePipelineEngine``: the engine's overrides of DeepSpeed's methods
(:class:`ChunkedEngine`), reading one :class:`~hippie_ds.adapter.engine.chunk_selector.ChunkSelector`
(``engine._chunks``) that holds every per-chunk state. Before each op of a model chunk the
engine selects that chunk, so DeepSpeed's own handlers run on it unchanged:

* the module runs the chunk's layers (``hippie_ds.PipelineModule.set_chunk``);
* ``is_first_stage()`` / ``is_last_stage()`` mean the first / last model part (loads, the loss,
  bf16's gradient hand-off), outside ops DeepSpeed's meaning (the loss broadcast);
* ``next_stage`` / ``prev_stage`` are the chunk's neighbours in the layout (the interleaved
  layout's last stage sends to the first over DeepSpeed's wrap-around p2p);
* DeepSpeed's per-engine p2p state (activation shape handshake, receive buffers) is kept per
  chunk: each chunk boundary has its own shapes;
* gradients travel with their own tag (:data:`~hippie_ds.adapter.engine.chunk_selector.GRADIENT_TAG`),
  sent and received by hippie's handlers (:mod:`~hippie_ds.adapter.engine.p2p`) through
  :mod:`~hippie_ds.adapter.engine.chunk_selector`'s tagged p2p (DeepSpeed's own send no tag);
* a hand-over between two chunks of one stage (the V's turn at the last stage) is local: the
  tensors go through a queue, as if sent and received (a receive gives a contiguous tensor);
* the V's first stage holds the first and the last part: it reads the data iterator once per
  micro-batch (the labels' load takes what the inputs' load read) and computes the loss
  (``_loss_stage_global_rank``).

``eval_batch`` runs :func:`hippie_ds.schedules.compiler.inference_stream` instead of DeepSpeed's
``InferenceSchedule``, which knows one part per stage.
"""
from __future__ import annotations

from ...schedules.compiler import inference_stream
from ..ds import engine as ds_engine
from .chunk_selector import ChunkSelector
from ..precision.layout_clip import clip_like_one_chunk


class ChunkedEngine:
    """Mixin of ``HippiePipelineEngine``: DeepSpeed's methods that virtual stages change, each
    asking ``self._chunks`` (made by :meth:`_init_chunks` after DeepSpeed's ``__init__``, which
    asks ``is_first_stage`` with its own meaning)."""

    _chunks: ChunkSelector | None = None

    def _init_chunks(self, compiled) -> None:
        self._chunks = ChunkSelector(compiled.layout, compiled.virtual_stages, self.stage_id, ds_engine.Boundary(self),
                                     getattr(self.module, "set_chunk", None),  # one chunk: DeepSpeed's own module
                                     self.is_pipe_partitioned or self.is_grad_partitioned)

    def is_first_stage(self):
        """Overrides ``PipelineEngine.is_first_stage`` (calls it without chunks): the first model part."""
        first = None if self._chunks is None else self._chunks.is_first()
        return super().is_first_stage() if first is None else first

    def is_last_stage(self):
        """Overrides ``PipelineEngine.is_last_stage`` (calls it without chunks): the last model part."""
        last = None if self._chunks is None else self._chunks.is_last()
        return super().is_last_stage() if last is None else last

    def _chunked(self) -> bool:
        return self._chunks is not None and self._chunks.chunked  # DeepSpeed's __init__ runs before _init_chunks

    def clip_fp32_gradients(self):
        """Overrides ``DeepSpeedEngine.clip_fp32_gradients`` (calls it): a virtual layout clips by 1F1B's coefficient."""
        # DeepSpeed's OptimizerStep (the pipeline-wide norm; a per-stage step swaps in its own mpu):
        # 1F1B's clip coefficient, whatever the layout (layout_clip.py)
        if self._chunked() and getattr(self.module, "one_chunk_parts", None) and self.mpu is self.grid:
            return clip_like_one_chunk(self.module, self.grid, self.mpu, self.device, self.gradient_clipping())
        return super().clip_fp32_gradients()

    def _loss_stage_global_rank(self):
        """Overrides ``PipelineEngine._loss_stage_global_rank`` (calls it without chunks): the stage of the last part."""
        if not self._chunked():
            return super()._loss_stage_global_rank()
        return self.grid.stage_to_global(self._chunks.loss_stage())

    def _next_batch(self):
        """Overrides ``PipelineEngine._next_batch`` (calls it): the V's first stage reads a micro-batch once."""
        chunks = self._chunks
        if chunks is None or not chunks.both_ends or chunks.chunk is None:
            return super()._next_batch()
        # the inputs' load reads; the labels' load of the same micro-batch reuses it
        return chunks.read(super()._next_batch()) if self.is_first_stage() else chunks.reread()

    def reset_activation_shape(self):
        """Overrides ``PipelineEngine.reset_activation_shape`` (calls it): every chunk's shapes go."""
        if self._chunks is not None:
            self._chunks.forget_shapes()
        super().reset_activation_shape()

    def _inference_schedule(self, micro_batches):
        """Overrides ``PipelineEngine._inference_schedule`` (calls it without chunks): chunk by chunk."""
        if not self._chunked():
            return super()._inference_schedule(micro_batches)
        from .instructions import OpSchedule
        return OpSchedule(inference_stream(self._chunks.layout, self.stage_id, micro_batches), micro_batches,
                          self.num_stages, self.stage_id, num_buffers=2)
