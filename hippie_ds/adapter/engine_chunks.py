"""Virtual stages in ``HippiePipelineEngine``: before each op of a model chunk the engine selects
that chunk (:class:`ChunkSelection`), so DeepSpeed's own handlers run on it unchanged:

* the module runs the chunk's layers (``hippie_ds.PipelineModule.set_chunk``);
* ``is_first_stage()`` / ``is_last_stage()`` mean the first / last model part (loads, the loss,
  bf16's gradient hand-off), outside ops DeepSpeed's meaning (the loss broadcast);
* ``next_stage`` / ``prev_stage`` are the chunk's neighbours in the layout (the interleaved
  layout's last stage sends to the first over DeepSpeed's wrap-around p2p);
* DeepSpeed's per-engine p2p state (activation shape handshake, receive buffers) is kept per
  chunk: each chunk boundary has its own shapes.

``eval_batch`` runs :func:`hippie_ds.schedules.compiler.inference_stream` instead of DeepSpeed's
``InferenceSchedule``, which knows one part per stage.
"""
from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds_schedule

from ..schedules.compiler import inference_stream

# PipelineEngine attributes describing one p2p boundary (reset_activation_shape's list)
_P2P_STATE = {"first_output_send": True, "pipe_recv_buf": None, "grad_layer": None, "meta_buffer": None,
              "pipe_partition_input_meta_cache": None, "pipe_partition_output_meta_cache": None,
              "pipe_partition_grad_meta_cache": None, "grad_partition_grad_layer_meta_cache": None}


class _InferenceSteps(ds_schedule.PipeSchedule):
    """A precomputed instruction stream as DeepSpeed's engine consumes a schedule."""

    def __init__(self, steps, micro_batches, stages, stage_id):
        super().__init__(micro_batches, stages, stage_id)
        self._steps = steps

    def steps(self):
        for step in self._steps:
            yield list(step)

    def num_pipe_buffers(self):
        return 2


class ChunkSelection:
    """Mixin of ``HippiePipelineEngine``; ``_init_chunk_selection`` after DeepSpeed's ``__init__``."""

    _chunk = None  # the chunk selected; None outside ops (and always with one chunk per stage)

    def _init_chunk_selection(self, compiled) -> None:
        self._layout = compiled.layout
        self._chunked = compiled.virtual_stages > 1
        self._chunk_p2p: dict[int, dict] = {}
        self._stock_neighbours = (self.prev_stage, self.next_stage)

    def is_first_stage(self):
        return super().is_first_stage() if self._chunk is None else self._layout.is_first(self.stage_id, self._chunk)

    def is_last_stage(self):
        return super().is_last_stage() if self._chunk is None else self._layout.is_last(self.stage_id, self._chunk)

    def _select_chunk(self, chunk: int | None) -> None:
        """Make ``chunk`` the one DeepSpeed's handlers act on (None: the stage as DeepSpeed sees it)."""
        if not self._chunked or chunk == self._chunk:
            return
        if self._chunk is not None:
            self._chunk_p2p[self._chunk] = {name: getattr(self, name) for name in _P2P_STATE}
        if chunk is None:
            self.prev_stage, self.next_stage = self._stock_neighbours
        else:
            for name, value in self._chunk_p2p.get(chunk, _P2P_STATE).items():
                setattr(self, name, value)
            nxt, prv = self._layout.next(self.stage_id, chunk), self._layout.prev(self.stage_id, chunk)
            self.next_stage = nxt[0] if nxt else self._stock_neighbours[1]
            self.prev_stage = prv[0] if prv else self._stock_neighbours[0]
        self._chunk = chunk
        self.module.set_chunk(chunk)

    def reset_activation_shape(self):
        self._chunk_p2p = {}
        super().reset_activation_shape()

    def _inference_schedule(self, micro_batches):
        if not self._chunked:
            return super()._inference_schedule(micro_batches)
        from .instructions import DeclaredSchedule
        steps = [[DeclaredSchedule._instruction(op) for op in step]
                 for step in inference_stream(self._layout, self.stage_id, micro_batches)]
        return _InferenceSteps(steps, micro_batches, self.num_stages, self.stage_id)
