"""Error feedback on a one-update-late stage's updates (``hippie.staleness.error_feedback`` = g).

A stage one update behind applies, at update t, the optimizer's step u(t) computed from a gradient
of the weights one update older. Error feedback (after arXiv 2606.30634's correction for
PipeDream-2BW's one-step delay, as its summaries describe it: the recent delayed updates mixed to
cut the delay's mismatch; the paper's own text was not reachable from here, so the formula is
ours) adds the change of the update since the last one, which the delay hides::

    roughly: W(t+1) = W(t) - u(t) - g * (u(t) - u(t-1)),   u(t) the optimizer's own step, u(-1) = 0

It wraps the optimizer the config names and nothing else: a step pre-hook keeps the values the
step starts from, a post-hook takes u(t) from them and applies the correction to the same values
the optimizer steps, the fp32 ones (fp32 without ZeRO: the module's parameters; fp16, bf16 and
ZeRO-1: DeepSpeed's fp32 masters, flat and partitioned, whose low-precision copy the wrapper
makes after the step, so it carries the correction). Elementwise, so a partition is corrected as
the whole would be. An update that is skipped (an fp16 overflow: the wrapper never steps) changes
nothing, u(t-1) included.

u(t-1) lives in the optimizer's own state (``state[p]["hippie_error_feedback"]``), so every
checkpoint DeepSpeed saves carries it, per rank and partition, and a resumed run continues
bit-identically. A parameter the optimizer has not stepped yet has no state and takes no
correction (its u is zero). Memory: one fp32 value per master element, and one more during the
step (the values it starts from).

Applied on ``2bw``'s stages that compute one update behind (every stage but a last stage that
computes on the weights it has made, ``extrapolate-made``): :func:`attach` as the engine is built. Not built
for the hippie family's delayed layers (part of a stage's masters) or ``pipedream`` (more than one
update behind): refused at start-up (:func:`check`).
"""

from __future__ import annotations

import torch

from ...config import ConfigError
from .step_hooks import hooked_optimizer, require_stage_one_behind

KEY = "hippie.staleness.error_feedback"
STATE_KEY = "hippie_error_feedback"


def _gain(staleness) -> float:
    """``hippie.staleness.error_feedback`` (0: off, also when no staleness config is given)."""
    return 0.0 if staleness is None else staleness.error_feedback


class ErrorFeedback:
    """The correction on one torch optimizer (module docstring), for as long as the optimizer lives."""

    def __init__(self, optimizer: torch.optim.Optimizer, gain: float):
        if gain <= 0:
            raise ValueError(f"error feedback gain {gain!r}: needs > 0")
        self.optimizer, self.gain = optimizer, gain
        self._start: list[tuple[torch.Tensor, torch.Tensor]] = []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    @torch.no_grad()
    def _before(self, optimizer, args, kwargs) -> None:
        self._start = [
            (p, torch.Tensor.clone(torch.Tensor.detach(p)))
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    @torch.no_grad()
    def _after(self, optimizer, args, kwargs) -> None:
        for p, start in self._start:
            state = optimizer.state.get(p)
            if not state:
                continue  # not stepped (no state): u = 0
            update = start.sub_(p)  # u(t) = W(t) - W_stepped
            previous = state.get(STATE_KEY)
            change = update if previous is None else update - previous  # u(-1) = 0
            torch.Tensor.sub_(p, change, alpha=self.gain)  # p: a user's parameter in fp32 without ZeRO
            state[STATE_KEY] = update
        self._start = []


def check(staleness, compiled) -> None:
    """At start-up, before any process group: error feedback only where it is built (module
    docstring), with a correction that predicts the compute weights."""
    gain = _gain(staleness)
    if not gain:
        return
    require_stage_one_behind(KEY, gain, compiled)
    if staleness.method == "none":
        raise ConfigError(
            f'config key "{KEY}" = {gain!r} with "hippie.staleness.method" = '
            '"none": error feedback corrects the update of a stage whose compute weights are predicted; '
            'allowed with "extrapolate-made" (the default), "extrapolate" or "adam"'
        )


def attach(optimizer, gain: float) -> ErrorFeedback:
    """The correction on DeepSpeed's ``optimizer`` (its torch optimizer, ds.runtime.torch_optimizer)."""
    return ErrorFeedback(hooked_optimizer(optimizer, KEY, gain), gain)


def bind(optimizer, prediction, staleness) -> ErrorFeedback | None:
    """As the engine is built (adapter/stage/build.py), once the stage's prediction is (it knows
    whether the stage makes its weights first, ``PredictionInputs.made``): the correction on a stage
    one update behind (``prediction``: its weight prediction, None on other stages) that does not
    compute on weights it has already made; kept on the prediction. None where it does not apply."""
    gain = _gain(staleness)
    if not gain or prediction is None or getattr(prediction, "made", False):
        return None
    prediction.error_feedback = attach(optimizer, gain)
    return prediction.error_feedback
