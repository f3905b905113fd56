"""Staleness correction for stages that apply their gradient one step late (``hippie.staleness``).

A deferred stage follows W(t+1) = W(t) - lr * g(.), where the gradient applied at the end of
step t was computed during step t-1. Without correction it was computed on W(t-1), one update
behind the weights it is applied to. ``extrapolate`` computes it on a prediction of those
weights instead (SpecTrain / PipeMare style weight prediction):

    roughly: W_hat(t) = W(t) + c * (W(t) - W(t-1))     forward and backward of step t run on W_hat
             params <- W(t) before the update           the optimizer updates the true weights

With c = 1 the prediction is the last applied update repeated. It costs one weight-sized buffer
(W(t-1), kept between steps and saved in checkpoints) and, per step, three in-place passes over
the stage's parameters; at t = 0 and t = 1 the difference is zero (no update applied yet).

PipeDream-2BW (``2bw``) follows the same rule on every stage, W(t+1) = W(t) - lr * g(W(t-1)),
with its compute on a stashed weight version; there the engine predicts that version instead
(W(t-1) + c * (W(t-1) - W(t-2)), the delta kept per version still computed on, at most two
weight-sized buffers per stage; ``HippiePipelineEngine._use_version``). Schedules whose stages
are more than one update behind (``pipedream``) are not corrected.
"""
from __future__ import annotations

import torch

from ..config import StalenessConfig


class WeightExtrapolation:
    """Runs a deferred stage's compute on W + c * (W - W_previous) and restores W before its
    update. ``predict`` at the start of a step, ``restore`` before the optimizer step."""

    def __init__(self, params: list[torch.Tensor], coefficient: float):
        self.params = params
        self.coefficient = coefficient
        self.previous: list[torch.Tensor] | None = None  # W(t-1) between steps, W(t) while predicted
        self.predicted = False

    @torch.no_grad()
    def predict(self) -> None:
        """Roughly: ``previous, params = params, params + c * (params - previous)``."""
        if self.predicted:
            return
        if self.previous is None:
            self.previous = [p.detach().clone() for p in self.params]
        else:
            for p, q in zip(self.params, self.previous):
                delta = p - q
                q.copy_(p)
                p.add_(delta, alpha=self.coefficient)
        self.predicted = True

    @torch.no_grad()
    def restore(self) -> None:
        """Roughly: ``params = previous`` (the true weights the update applies to)."""
        if not self.predicted:
            return
        for p, q in zip(self.params, self.previous):
            p.copy_(q)
        self.predicted = False

    def state_dict(self) -> dict:
        if self.predicted:
            raise RuntimeError("weight extrapolation: cannot save while the parameters hold predicted weights")
        return {"coefficient": self.coefficient,
                "previous": None if self.previous is None else [q.clone() for q in self.previous]}

    def load_state_dict(self, state: dict, device) -> None:
        self.previous = None if state["previous"] is None else [q.to(device) for q in state["previous"]]
        self.predicted = False


def make_corrector(config: StalenessConfig, params: list[torch.Tensor]) -> WeightExtrapolation | None:
    """The correction a delayed stage applies, or None (``method: none``)."""
    if config.method == "none":
        return None
    return WeightExtrapolation(params, config.coefficient)
