"""What the planner maximizes: a registry of objectives over a configuration's figures. Pure
Python. Add one with :func:`register_objective`; ``hippie-ds plan --objective NAME`` and
``make_plan(objective=NAME)`` accept every registered name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .profile import PlannerError


@dataclass(frozen=True)
class Figures:
    """A configuration's predicted figures, as every objective sees them."""

    throughput: float  # samples/s
    scalability: float  # throughput / (devices x single-device throughput)
    memory: float  # bytes per device: the mean or the max over devices (the plan's memory_metric)
    memory_efficiency: float  # scalability x throughput / memory, samples/s per GB (Hippie's ME)


OBJECTIVES: dict[str, Callable[[Figures], float]] = {
    "me": lambda f: f.memory_efficiency,
    "throughput": lambda f: f.throughput,
}


def register_objective(name: str, score: Callable[[Figures], float]) -> None:
    """Make ``name`` plannable: ``score(figures)`` is maximized, subject to the memory limits."""
    OBJECTIVES[name] = score


def check_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise PlannerError(f"objective {name!r}: expected one of {', '.join(sorted(OBJECTIVES))}")
    return name


def score(name: str, throughput: float, scalability: float, memory: float, memory_efficiency: float) -> float:
    """The objective ``name`` of these figures (larger is better)."""
    return OBJECTIVES[name](Figures(throughput, scalability, memory, memory_efficiency))
