"""What the planner maximizes: a registry of objectives over a configuration's figures. Pure
Python. Add one with :func:`register_objective`; ``hippie-ds plan --objective NAME`` and
``make_plan(objective=NAME)`` accept every registered name.

An objective names one figure, and that figure is the one the planner ranks by, the plan file
records (``prediction.objective_value``) and the bench reads from the plan. It also says how the
deferred stages' layers are chosen:

* ``free`` (``me``, ``throughput``): no deeper than the convergence studies measured free, at most
  one layer with parameters per deferred stage (``hippie.deferred_layers`` "untied", the default:
  +0.04% held-out loss against data parallelism on the GPT example, a steps factor of 1.005),
  chosen for the least step time; the figure is the raw step's.
* ``priced`` (``time-to-loss``): any depth, chosen for the least step x steps factor, the steps
  factor priced at the measured :data:`hippie_ds.schedules.deferral.STALENESS_PRICE`
  (:data:`PRICE_SOURCE`); the figure is samples per second to a loss, throughput / steps factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from .profile import PlannerError

FREE, PRICED = "free", "priced"
# Where the staleness price comes from: the plan file records it beside the price.
PRICE_SOURCE = (
    "docs/results/deferred_layers_auto.md, 'The price, measured' (GPT example, 3 seeds, steps to dp's "
    "held-out loss): one layer delayed (2.6% of the gradient) +0.04% loss, steps factor 1.005; stage 0's "
    "first two layers (27%) 1.19; all of stage 0 (50%) +4.24% loss, 1.27; least squares through the "
    "origin 0.54 per stale share"
)
# Layers with parameters a deferred stage delays at most under a free objective: the measured-free depth.
FREE_LAYERS = 1


@dataclass(frozen=True)
class Figures:
    """A configuration's predicted figures, as every objective sees them."""

    throughput: float  # samples/s
    scalability: float  # throughput / (devices x single-device throughput)
    memory: float  # bytes per device: the mean or the max over devices (the plan's memory_metric)
    memory_efficiency: float  # scalability x throughput / memory, samples/s per GB (Hippie's ME)
    steps_factor: float = 1.0  # steps to a loss relative to no staleness, at the measured price


@dataclass(frozen=True)
class Objective:
    """One objective: its figure (``score``, larger is better), what the figure is, and how the
    deferred layers are chosen for it (``deferral``: :data:`FREE` or :data:`PRICED`)."""

    score: Callable[[Figures], float]
    figure: str
    deferral: Literal["free", "priced"] = FREE


OBJECTIVES: dict[str, Objective] = {
    "me": Objective(lambda f: f.memory_efficiency, "ME, samples/s per GB (raw step)"),
    "throughput": Objective(lambda f: f.throughput, "samples/s (raw step)"),
    "time-to-loss": Objective(
        lambda f: f.throughput / f.steps_factor, "samples/s to a loss: throughput / steps factor", PRICED
    ),
}


def register_objective(
    name: str,
    score: Callable[[Figures], float],
    *,
    figure: str | None = None,
    deferral: Literal["free", "priced"] = FREE,
) -> None:
    """Make ``name`` plannable: ``score(figures)`` is maximized, subject to the memory limits."""
    if deferral not in (FREE, PRICED):
        raise PlannerError(f"objective {name!r}: deferral {deferral!r}, expected {FREE!r} or {PRICED!r}")
    OBJECTIVES[name] = Objective(score, figure or name, deferral)


def check_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise PlannerError(f"objective {name!r}: expected one of {', '.join(sorted(OBJECTIVES))}")
    return name


def priced(name: str) -> bool:
    """The objective chooses deferred layers at the staleness price (else no deeper than free)."""
    return OBJECTIVES[name].deferral == PRICED


def score(
    name: str, throughput: float, scalability: float, memory: float, memory_efficiency: float, steps_factor: float = 1.0
) -> float:
    """The objective ``name`` of these figures (larger is better)."""
    return OBJECTIVES[name].score(Figures(throughput, scalability, memory, memory_efficiency, steps_factor))
