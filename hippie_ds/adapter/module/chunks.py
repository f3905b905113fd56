"""Virtual stages in ``hippie_ds.PipelineModule``: a stage builds ``v`` model chunks (non-adjacent
parts of the same ``LayerSpec`` list, placed by a :class:`~hippie_ds.schedules.layout.Layout`) and
runs one of them at a time. DeepSpeed's ``PipelineModule`` has no chunk concept (DeepSpeed issue
#4035): it builds one contiguous range ``[_local_start, _local_stop)`` into ``forward_funcs`` and
its ``forward``, activation checkpointing and per-layer checkpoint files all read those three.
:class:`ChunkedLayers` builds every chunk with DeepSpeed's own ``_build`` and, per chunk, swaps
them in (:meth:`ChunkedLayers.set_chunk`), so DeepSpeed's code runs unchanged on one chunk; layer
indices stay global, so checkpoint files are DeepSpeed's per-layer files whatever the layout.
"""

from __future__ import annotations

import contextlib
import io

from ...schedules.layout import Layout
from ..ds import module as ds_module


def chunks_phrase(n: int, layout: str | None) -> str:
    """'2 model chunks per stage (interleaved layout)'; one chunk: no layout."""
    return f"{n} model chunk{'s' if n != 1 else ''} per stage" + (f" ({layout} layout)" if n > 1 else "")


def held_chunks(model) -> tuple[int, str]:
    """(model chunks per stage, layout) a pipeline module holds: DeepSpeed's own holds one."""
    return getattr(model, "virtual_stages", 1), getattr(model, "layout_kind", "interleaved")


class ChunkedLayers:
    """Mixin for a DeepSpeed ``PipelineModule`` subclass; :meth:`_init_chunks` before DeepSpeed's
    ``__init__`` (which partitions and builds)."""

    def _init_chunks(self, virtual_stages: int, layout: str) -> None:
        object.__setattr__(self, "virtual_stages", int(virtual_stages))
        object.__setattr__(self, "layout_kind", layout)
        object.__setattr__(self, "_chunk_views", [])  # per chunk: the layers, range and attributes set_chunk swaps in
        object.__setattr__(self, "_whole_view", None)
        object.__setattr__(self, "current_chunk", None)

    @property
    def chunked(self) -> bool:
        return self.virtual_stages > 1

    def chunk_layout(self) -> Layout:
        return Layout(self.layout_kind, self.num_stages, self.virtual_stages)

    def _partition_chunks(self, method: str, planned: list[int] | None) -> None:
        """``parts``: K * v + 1 boundaries (the plan's, or DeepSpeed's method over K * v parts)."""
        layout = self.chunk_layout()
        if planned is not None:
            self.parts = list(planned)
            object.__setattr__(self, "one_chunk_parts", None)  # a plan's parts have no one-chunk counterpart
        else:
            with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints the partition it makes
                super()._partition_layers(method=method)
            # what 1F1B's module would hold per stage: its clip coefficient (layout_clip.py) is computed on these
            object.__setattr__(self, "one_chunk_parts", list(self.parts))
            stages = self.num_stages
            self.num_stages = layout.parts  # DeepSpeed's partitioner cuts num_stages parts
            try:
                super()._partition_layers(method=method)
            finally:
                self.num_stages = stages
        if len(self.parts) != layout.parts + 1:
            raise ValueError(
                f"{len(self.parts) - 1} model parts for {self.num_stages} stages x {self.virtual_stages} "
                f"virtual stages: expected {layout.parts}"
            )
        stage = ds_module.stage_of_rank(self, self.global_rank)
        self._chunk_bounds = [(self.parts[p], self.parts[p + 1]) for p in layout.chunks(stage)]
        ds_module.set_bounds(self, *self._chunk_bounds[0])

    def _build_chunks(self, build_one) -> None:
        """Build every chunk with DeepSpeed's ``_build`` (``build_one``), then record each one's view."""
        funcs: list = []
        for start, stop in self._chunk_bounds:
            ds_module.set_bounds(self, start, stop)
            self.forward_funcs = []
            build_one()
            self._chunk_views.append(
                {"forward_funcs": self.forward_funcs, "local_range": (start, stop), **self._chunk_extra(start, stop)}
            )
            funcs += self.forward_funcs
        # The whole stage: every chunk's layers (parameters, compile, state); forward needs a chunk.
        first = self._chunk_bounds[0]
        self._whole_view = {"forward_funcs": funcs, "local_range": first, **self._chunk_extra(*first)}
        self._apply_view(self._whole_view)

    def _chunk_extra(self, start: int, stop: int) -> dict:
        """Other per-chunk attributes of the subclass (its checkpointed runs)."""
        return {}

    def _apply_view(self, view: dict) -> None:
        for name, value in view.items():
            if name == "local_range":
                ds_module.set_local_range(self, *value)  # DeepSpeed's _local_start / _local_stop
            else:
                object.__setattr__(self, name, value)
        # DeepSpeed caches which interval blocks of forward_funcs are checkpointable
        self.is_checkpointable_results_interval = None
        if self.activation_checkpoint_interval > 0:
            ds_module.precompute_checkpointable_values(self)

    def set_chunk(self, chunk: int | None) -> None:
        """Run chunk ``chunk`` from now on (None: the whole stage, which ``forward`` refuses)."""
        if not self.chunked or chunk == self.current_chunk:
            return
        self._apply_view(self._whole_view if chunk is None else self._chunk_views[chunk])
        object.__setattr__(self, "current_chunk", chunk)

    def local_layers(self) -> list[tuple[int, object]]:
        """(global layer index, layer) of every layer this stage holds, all chunks."""
        views = (
            self._chunk_views
            if self.chunked
            else [{"forward_funcs": self.forward_funcs, "local_range": (ds_module.local_start(self), None)}]
        )
        return [(view["local_range"][0] + i, f) for view in views for i, f in enumerate(view["forward_funcs"])]

    def chunk_parameters(self, chunk: int) -> list:
        """The trainable parameters of chunk ``chunk``'s own layers (tied modules, which chunks and
        stages share, left out)."""
        tied = {id(p) for m in self.tied_modules.values() for p in m.parameters()}
        return [
            p
            for f in self._chunk_views[chunk]["forward_funcs"]
            if hasattr(f, "parameters")
            for p in f.parameters()
            if p.requires_grad and id(p) not in tied
        ]

    def chunk_owner(self, layer_idx: int) -> int:
        """The stage holding global layer ``layer_idx``."""
        for p in range(len(self.parts) - 1):
            if self.parts[p] <= layer_idx < self.parts[p + 1]:
                return self.chunk_layout().place(p)[0]
        raise RuntimeError(f"layer {layer_idx} is in no model part (parts {self.parts})")

    def _each_chunk(self, fn) -> None:
        """``fn()`` with every chunk selected in turn (DeepSpeed's per-layer checkpoint I/O)."""
        previous = self.current_chunk
        try:
            for c in range(self.virtual_stages):
                self.set_chunk(c)
                fn()
        finally:
            self.set_chunk(previous)
