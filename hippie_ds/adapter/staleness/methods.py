"""The staleness methods by name (``hippie.staleness.method``), and :func:`make_prediction`, which
builds a delayed stage's correction from its row. The table names every method: no module adds
itself to it when imported, so what it holds does not depend on what was imported first."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...config import StalenessConfig
from . import adam
from .prediction import InPlacePrediction, MadeWeightsPrediction, PredictionInputs, WeightPrediction


class Method(NamedTuple):
    """A staleness method beyond extrapolation: ``factory``, (coefficient, params or None) -> its
    prediction; ``take``, (prediction, coefficient, inputs) -> None, called as the prediction is
    built, for what it reads besides the weights (:class:`~.prediction.PredictionInputs`; what it
    cannot read is refused at start-up, adapter/startup/checks.py)."""

    factory: Callable
    take: Callable | None = None


METHODS: dict[str, Method] = {adam.METHOD: Method(adam.make_adam_prediction, adam.take_inputs)}


def make_prediction(
    config: StalenessConfig | None, params: list[torch.Tensor] | None = None, inputs: PredictionInputs | None = None
):
    """The correction a delayed stage applies (:class:`InPlacePrediction` on ``params``, or a
    per-version :class:`WeightPrediction` when ``params`` is None), or None (no correction), built
    with what it reads (``inputs``)."""
    prediction = _new_prediction(config, params)
    if prediction is not None and inputs is not None:
        if config.method == MadeWeightsPrediction.method and isinstance(prediction, MadeWeightsPrediction):
            prediction.made = inputs.made
        method = METHODS.get(config.method)
        if method is not None and method.take is not None:
            method.take(prediction, config.coefficient, inputs)
    return prediction


def _new_prediction(config: StalenessConfig | None, params: list[torch.Tensor] | None):
    if config is None or config.method == "none":
        return None
    if config.method == MadeWeightsPrediction.method:  # hippie's delayed layers make nothing before use
        return (
            MadeWeightsPrediction(config.coefficient)
            if params is None
            else InPlacePrediction(params, config.coefficient)
        )
    if config.method != "extrapolate":  # e.g. "adam": Adam's own prediction (bound to the optimizer as built)
        method = METHODS.get(config.method)
        if method is None:
            raise RuntimeError(
                f"hippie.staleness.method {config.method!r}: no row in hippie_ds.adapter.staleness.methods.METHODS"
            )
        return method.factory(config.coefficient, params)
    return WeightPrediction(config.coefficient) if params is None else InPlacePrediction(params, config.coefficient)
