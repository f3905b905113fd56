"""Virtual stages' per-chunk state of one ``HippiePipelineEngine`` stage (:class:`ChunkSelector`),
and the tagged point-to-point transfers its gradients travel by (:func:`send`, :func:`recv`,
:func:`isend`).

Gradients between two chunks' stages carry their own tag (:data:`GRADIENT_TAG`): a stage pair's
link can carry activations and gradients in each direction, in different orders (the V,
interleaved at K=2), and DeepSpeed's p2p matches messages in order per (peer, tag); the validator
models it so (``schedules.deadlock.link_of``). DeepSpeed's ``runtime/pipe/p2p.py`` sends with no
tag; hippie's chunked gradient handlers (:mod:`~hippie_ds.adapter.stage.p2p`) call the
functions here instead, which pass ``tag=`` explicitly to ``deepspeed.comm`` and otherwise do
what ``p2p.send`` / ``p2p.recv`` do on torch >= 1.8 (the only torch hippie-ds runs on): the
neighbour check, the peer's global rank from the grid, the default (world) group, on every backend
(gloo included). DeepSpeed's p2p module itself is left untouched.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from deepspeed import comm as dist

from ..ds.engine import P2P_STATE, Boundary  # P2P_STATE re-exported: the engine's p2p boundary state, by name

ACTIVATION_TAG = 0  # DeepSpeed's p2p: activations (and everything without virtual stages)
GRADIENT_TAG = 1  # gradients' p2p tag under virtual stages


def _check_link(grid, src_stage: int, dest_stage: int) -> None:
    """DeepSpeed p2p's check (``_is_valid_send_recv``): neighbours, or the first and last stage (wrap-around)."""
    last = grid.pipe_parallel_size - 1
    if abs(src_stage - dest_stage) != 1 and {src_stage, dest_stage} != {0, last}:
        raise RuntimeError(
            f"p2p between stages {src_stage} and {dest_stage}: only neighbouring stages (or the "
            f"first and the last, 0 and {last}) exchange tensors"
        )


def send(grid, tensor, dest_stage: int, tag: int):
    """``p2p.send(tensor, dest_stage)`` with ``tag``."""
    _check_link(grid, grid.get_stage_id(), dest_stage)
    return dist.send(tensor, grid.stage_to_global(stage_id=dest_stage), tag=tag)


def recv(grid, tensor, src_stage: int, tag: int):
    """``p2p.recv(tensor, src_stage)`` with ``tag``."""
    _check_link(grid, src_stage, grid.get_stage_id())
    return dist.recv(tensor, grid.stage_to_global(stage_id=src_stage), tag=tag)


def isend(grid, tensor, dest_stage: int, tag: int):
    """A non-blocking :func:`send`; returns the work handle."""
    _check_link(grid, grid.get_stage_id(), dest_stage)
    return dist.isend(tensor, grid.stage_to_global(stage_id=dest_stage), tag=tag)


class ChunkSelector:
    """Which model chunk of a stage DeepSpeed's handlers act on, and everything kept per chunk.

    :meth:`select` makes a chunk current: it sets what DeepSpeed's handlers read on the engine, through
    its :class:`~hippie_ds.adapter.ds.engine.Boundary` (``prev_stage`` / ``next_stage``: the chunk's
    neighbours in the layout; DeepSpeed's p2p boundary state, :data:`P2P_STATE`, saved and restored
    per chunk: each chunk boundary has its own shapes) and the module's chunk
    (``PipelineModule.set_chunk``). Between ops (``None``) the engine is the stage as DeepSpeed sees
    it. With one chunk per stage (``chunked`` False) selecting does nothing and every answer is
    DeepSpeed's.

    Read by the engine's overrides (:mod:`~hippie_ds.adapter.engine.chunks`): :meth:`is_first` /
    :meth:`is_last` (None: DeepSpeed's meaning), :meth:`loss_stage`, :attr:`gradient_tag`,
    :meth:`local` and the hand-over queues (:meth:`hand_over` / :meth:`take`), the V's first
    stage's batch reuse (:meth:`read` / :meth:`reread`), :meth:`forget_shapes`.
    """

    def __init__(
        self,
        layout,
        virtual_stages: int,
        stage: int,
        boundary: Boundary,
        set_chunk: Callable[[int | None], None] | None,
        partitioned: bool = False,
    ):
        """``stage``: this stage; ``boundary`` (:class:`~hippie_ds.adapter.ds.engine.Boundary`): the
        engine's neighbours and p2p state, which DeepSpeed's handlers read; ``set_chunk``: the module's
        (``PipelineModule.set_chunk``; None: a module of one chunk); ``partitioned``: DeepSpeed
        partitions pipeline activations or gradients (tensor-slice parallelism)."""
        self._boundary, self._set_chunk = boundary, set_chunk
        self.layout = layout
        self.stage = stage
        self.chunked = virtual_stages > 1
        self.chunk: int | None = None  # the chunk selected; None outside ops (and always with one chunk)
        self._p2p: dict[int, dict] = {}  # chunk -> its saved P2P_STATE
        self._stock_neighbours = boundary.neighbours()
        self._local = {"activation": deque(), "gradient": deque()}  # hand-overs between own chunks
        self.both_ends = self.chunked and layout.holds_first(self.stage) and layout.holds_last(self.stage)
        self._read_batches = deque()  # the V's first stage: batches read for inputs, awaiting labels
        if self.chunked and partitioned:
            raise ValueError(
                f"{virtual_stages} virtual stages do not support partitioned pipeline activations or "
                "gradients (tensor-slice parallelism: DeepSpeed's pipe_partitioned / grad_partitioned)"
            )

    @property
    def gradient_tag(self) -> int:
        """The tag gradient sends and receives carry now."""
        return GRADIENT_TAG if self.chunked else ACTIVATION_TAG

    def is_first(self) -> bool | None:
        """Whether the stage is the first model part now: the chunk's when one is selected, the stage
        holding the first part outside ops; None without chunks (DeepSpeed's meaning)."""
        if not self.chunked:
            return None
        if self.chunk is not None:
            return self.layout.is_first(self.stage, self.chunk)
        return self.layout.holds_first(self.stage)

    def is_last(self) -> bool | None:
        if not self.chunked:
            return None
        if self.chunk is not None:
            return self.layout.is_last(self.stage, self.chunk)
        return self.layout.holds_last(self.stage)

    def loss_stage(self) -> int:
        """The stage that computes the loss (holds the last model part)."""
        return self.layout.place(self.layout.parts - 1)[0]

    def local(self, peer_stage: int) -> bool:
        """Whether a transfer to or from ``peer_stage`` is a hand-over between this stage's own chunks."""
        return self.chunked and peer_stage == self.stage

    def hand_over(self, kind: str, tensors) -> None:
        """Queue ``tensors`` (``kind``: "activation" or "gradient") for this stage's next chunk to :meth:`take`."""
        self._local[kind].append(tensors)

    def take(self, kind: str):
        return self._local[kind].popleft()

    def read(self, batch):
        """The V's first stage: the inputs' load read ``batch``; the labels' load will :meth:`reread` it."""
        self._read_batches.append(batch)
        return batch

    def reread(self):
        return self._read_batches.popleft()

    def forget_shapes(self) -> None:
        """``reset_activation_shape``: every chunk's saved p2p state goes (DeepSpeed resets the current one)."""
        self._p2p = {}

    def select(self, chunk: int | None) -> None:
        """Make ``chunk`` the one DeepSpeed's handlers act on (None: the stage as DeepSpeed sees it)."""
        if not self.chunked or chunk == self.chunk:
            return
        boundary = self._boundary
        if self.chunk is not None:
            self._p2p[self.chunk] = boundary.state()
        if chunk is None:
            boundary.set_neighbours(*self._stock_neighbours)
        else:
            boundary.set_state(self._p2p.get(chunk, P2P_STATE))
            nxt, prv = self.layout.next(self.stage, chunk), self.layout.prev(self.stage, chunk)
            boundary.set_neighbours(
                prv[0] if prv else self._stock_neighbours[0], nxt[0] if nxt else self._stock_neighbours[1]
            )
        self.chunk = chunk
        self._set_chunk(chunk)
