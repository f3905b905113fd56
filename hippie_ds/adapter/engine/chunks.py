"""Virtual stages in ``HippiePipelineEngine``: what the engine's overrides of DeepSpeed's methods
delegate to, each a function of the stage's :class:`~hippie_ds.adapter.stage.chunk_selector.ChunkSelector`
(None while DeepSpeed's ``__init__`` runs) and of DeepSpeed's own method (``stock``), which answers
where there are no chunks. Before each op of a model chunk the
engine selects that chunk, so DeepSpeed's own handlers run on it unchanged:

* the module runs the chunk's layers (``hippie_ds.PipelineModule.set_chunk``);
* ``is_first_stage()`` / ``is_last_stage()`` mean the first / last model part (loads, the loss,
  bf16's gradient hand-off), outside ops DeepSpeed's meaning (the loss broadcast);
* ``next_stage`` / ``prev_stage`` are the chunk's neighbours in the layout (the interleaved
  layout's last stage sends to the first over DeepSpeed's wrap-around p2p);
* DeepSpeed's per-engine p2p state (activation shape handshake, receive buffers) is kept per
  chunk: each chunk boundary has its own shapes;
* gradients travel with their own tag (:data:`~hippie_ds.adapter.stage.chunk_selector.GRADIENT_TAG`),
  sent and received by hippie's handlers (:mod:`~hippie_ds.adapter.stage.p2p`) through
  :mod:`~hippie_ds.adapter.stage.chunk_selector`'s tagged p2p (DeepSpeed's own send no tag);
* a hand-over between two chunks of one stage (the V's turn at the last stage) is local: the
  tensors go through a queue, as if sent and received (a receive gives a contiguous tensor);
* the V's first stage holds the first and the last part: it reads the data iterator once per
  micro-batch (the labels' load takes what the inputs' load read) and computes the loss
  (``_loss_stage_global_rank``).

``eval_batch`` runs :func:`hippie_ds.schedules.compiler.inference_stream` instead of DeepSpeed's
``InferenceSchedule``, which knows one part per stage.
"""

from __future__ import annotations

from typing import Callable

from ...schedules.compiler import inference_stream
from ..precision.layout_clip import clip_like_one_chunk
from ..stage.chunk_selector import ChunkSelector


def _chunked(chunks: ChunkSelector | None) -> bool:
    return chunks is not None and chunks.chunked


def is_first(chunks: ChunkSelector | None, stock: Callable[[], bool]) -> bool:
    """``is_first_stage``: the first model part."""
    first = None if chunks is None else chunks.is_first()
    return stock() if first is None else first


def is_last(chunks: ChunkSelector | None, stock: Callable[[], bool]) -> bool:
    """``is_last_stage``: the last model part."""
    last = None if chunks is None else chunks.is_last()
    return stock() if last is None else last


def loss_stage_global_rank(chunks: ChunkSelector | None, grid, stock: Callable[[], int]) -> int:
    """``_loss_stage_global_rank``: the stage of the last part."""
    return grid.stage_to_global(chunks.loss_stage()) if _chunked(chunks) else stock()


def next_batch(chunks: ChunkSelector | None, is_first_stage: Callable[[], bool], stock: Callable[[], object]):
    """``_next_batch``: the V's first stage reads a micro-batch once; the inputs' load reads, the labels'
    load of the same micro-batch reuses it."""
    if chunks is None or not chunks.both_ends or chunks.chunk is None:
        return stock()
    return chunks.read(stock()) if is_first_stage() else chunks.reread()


def forget_shapes(chunks: ChunkSelector | None, stock: Callable[[], None]) -> None:
    """``reset_activation_shape``: every chunk's shapes go, then DeepSpeed's."""
    if chunks is not None:
        chunks.forget_shapes()
    stock()


def inference_schedule(chunks: ChunkSelector | None, micro_batches: int, stages: int, stock: Callable[[int], object]):
    """``_inference_schedule``: chunk by chunk (DeepSpeed's ``InferenceSchedule`` knows one part per stage)."""
    if not _chunked(chunks):
        return stock(micro_batches)
    from ..stage.instructions import OpSchedule

    return OpSchedule(
        inference_stream(chunks.layout, chunks.stage, micro_batches), micro_batches, stages, chunks.stage, num_buffers=2
    )


def clip_fp32_gradients(
    chunks: ChunkSelector | None, module, grid, mpu, device, max_norm: float, stock: Callable[[], object]
):
    """``clip_fp32_gradients``, called by DeepSpeed's ``OptimizerStep`` (the pipeline-wide norm; a
    per-stage step swaps in its own mpu): a virtual layout clips by 1F1B's clip coefficient, whatever
    the layout (layout_clip.py)."""
    if _chunked(chunks) and getattr(module, "one_chunk_parts", None) and mpu is grid:
        return clip_like_one_chunk(module, grid, mpu, device, max_norm)
    return stock()
