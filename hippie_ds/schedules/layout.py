"""Where the model's parts live: ``K`` pipeline stages (ranks) each holding ``v`` model chunks
(virtual stages). Pure Python; the one place of this arithmetic for the compiler, validator,
simulator and the DeepSpeed adapter.

The model is cut into ``K * v`` consecutive parts. A layout says which (stage, chunk) holds part p:

* ``interleaved`` (Megatron's interleaved 1F1B): chunk c of stage s is part ``c * K + s``; the
  last stage hands a chunk's output to the first stage's next chunk (DeepSpeed's wrap-around p2p);
* ``v`` (V-shape: ZB-V, DualPipeV): stage s holds parts s and ``2K - 1 - s``; the hand-over at the
  last stage is local and the first stage holds both the first and the last part.

With ``v == 1`` both are DeepSpeed's plain layout: stage s is part s.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("interleaved", "v")


@dataclass(frozen=True)
class Layout:
    kind: str  # one of LAYOUTS
    stages: int
    virtual_stages: int = 1

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout = {self.kind!r}: allowed {', '.join(LAYOUTS)}")
        if self.kind == "v" and self.virtual_stages not in (1, 2):
            raise ValueError(f"layout 'v' holds 2 chunks per stage, not virtual_stages = {self.virtual_stages}")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages = {self.virtual_stages}: must be >= 1")

    @property
    def parts(self) -> int:
        return self.stages * self.virtual_stages

    def part(self, stage: int, chunk: int) -> int:
        """The model part chunk ``chunk`` of ``stage`` holds."""
        K = self.stages
        if self.kind == "v" and chunk == 1:
            return 2 * K - 1 - stage
        return chunk * K + stage

    def place(self, part: int) -> tuple[int, int]:
        """(stage, chunk) holding model part ``part``."""
        K = self.stages
        if self.kind == "v" and part >= K:
            return 2 * K - 1 - part, 1
        return part % K, part // K

    def next(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) that consumes this chunk's output; None for the last part."""
        p = self.part(stage, chunk)
        return self.place(p + 1) if p + 1 < self.parts else None

    def prev(self, stage: int, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) whose output this chunk consumes; None for the first part."""
        p = self.part(stage, chunk)
        return self.place(p - 1) if p > 0 else None

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.part(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.part(stage, chunk) == self.parts - 1

    def holds_first(self, stage: int) -> bool:
        """True when ``stage`` holds the model's first part (it loads the inputs)."""
        return any(self.is_first(stage, c) for c in range(self.virtual_stages))

    def holds_last(self, stage: int) -> bool:
        """True when ``stage`` holds the model's last part (it loads the labels, computes the loss)."""
        return any(self.is_last(stage, c) for c in range(self.virtual_stages))

    def loads(self, stage: int) -> bool:
        """True when the stage reads the data iterator (holds the first or the last part)."""
        return self.holds_first(stage) or self.holds_last(stage)

    def chunks(self, stage: int) -> list[int]:
        """The parts stage ``stage`` holds, by chunk."""
        return [self.part(stage, c) for c in range(self.virtual_stages)]
