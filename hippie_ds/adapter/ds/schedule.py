"""DeepSpeed's pipeline schedules and instructions (``deepspeed.runtime.pipe.schedule``), re-exported:
the base classes hippie-ds's instructions and schedules derive from, DeepSpeed's own instruction
classes by name (:func:`instruction`) and its stock schedules."""

from __future__ import annotations

from deepspeed.runtime.pipe.schedule import (
    BufferOpInstruction,
    InferenceSchedule,
    PipeInstruction,
    PipeSchedule,
    TrainSchedule,
)
from deepspeed.runtime.pipe import schedule as _schedule

__all__ = [
    "BufferOpInstruction",
    "InferenceSchedule",
    "PipeInstruction",
    "PipeSchedule",
    "TrainSchedule",
    "instruction",
]


def instruction(name: str) -> type:
    """Roughly: ``getattr(deepspeed.runtime.pipe.schedule, name)`` (one of DeepSpeed's instruction classes,
    ``ForwardPass``...)."""
    return getattr(_schedule, name)
