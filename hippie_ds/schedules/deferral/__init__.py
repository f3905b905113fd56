"""Deferral in one place (pure Python): which stages apply their gradient one step late and what
each of them delays.

* :mod:`.auto_stages`: ``deferred_stages: auto``, the stages whose all-reduce exceeds their slack
  (:func:`resolve_auto_params`);
* :mod:`.auto_layers`: ``hippie.deferred_layers: "auto"``, the leading layers each deferred stage
  delays, priced by staleness (:func:`choose_deferred_layers`);
* :mod:`.decide`: what every stage delays, in global layer indices, with the tie rule
  (:func:`decide`).

:func:`hippie_ds.schedules.resolve.resolve` runs them in order; the engine, ``hippie-ds schedule
simulate`` and the planner read its result and decide nothing.
"""

from .auto_layers import STALENESS_PRICE, LayersChoice, choose_deferred_layers, stale_share
from .auto_stages import resolve_auto_params, stage_slack
from .decide import (
    AUTO_LAYERS,
    DEFAULT_DEFERRED_LAYERS,
    NOT_DEFERRED,
    UNTIED_LAYERS,
    WHOLE_STAGE,
    Deferral,
    StageDeferral,
    StageLayers,
    decide,
    delayed_layers,
    with_parameters,
    with_ties,
)

__all__ = [
    "AUTO_LAYERS",
    "DEFAULT_DEFERRED_LAYERS",
    "NOT_DEFERRED",
    "STALENESS_PRICE",
    "UNTIED_LAYERS",
    "WHOLE_STAGE",
    "Deferral",
    "LayersChoice",
    "StageDeferral",
    "StageLayers",
    "choose_deferred_layers",
    "decide",
    "delayed_layers",
    "resolve_auto_params",
    "stage_slack",
    "stale_share",
    "with_parameters",
    "with_ties",
]
