"""Delay compensation on a one-update-late stage's gradients (``hippie.staleness.delay_compensation`` = L).

A stage one update behind steps, at update t, with a gradient g computed on weights W_g one update
older than the weights W(t) it updates. DC-ASGD-a (Zheng et al., "Asynchronous Stochastic Gradient
Descent with Delay Compensation", ICML 2017) moves g towards the gradient at W(t) by a first-order
Taylor term whose Hessian is approximated by g * g, normalised by the gradient's second moment::

    roughly: g_stepped = g + L * g * g * (W(t) - W_g) / (sqrt(v_hat) + eps),   elementwise
             v = 0.999 v + 0.001 g_stepped^2 after each update,  v_hat = v / (1 - 0.999^n),  eps = 1e-8

v is the correction's own moving average of the squared gradients the optimizer stepped with, over
the n updates before this one (the first update has neither v nor W_g, and takes no correction), so
that under AdamW with betas[1] = 0.999 v_hat is Adam's own bias-corrected second moment (the
staleness study's rule, tools/bench/studies/staleness_stage.py), and under any other optimizer the
same. W_g is the values the previous applied update started from: on ``2bw`` with ``method: "none"``
exactly the weights batch t computed on, W(t-1), unless the update before was skipped (an fp16
overflow: the wrapper never steps, so the correction never sees it), in which case the correction
takes the last applied update's change as the delay. Built only with ``method: "none"``: a predicted
compute weight (``extrapolate``, ``extrapolate-made``, ``adam``) already moves the compute towards
W(t), and the two corrections of one delay are not stacked (refused at start-up, :func:`check`).
For the same reason it does not combine with ``error_feedback``, which needs a predicted weight.

It wraps the optimizer the config names and nothing else: a step pre-hook replaces the gradient the
optimizer steps with by the corrected one (the original goes back after the step, so DeepSpeed's own
gradient buffers are left as they were), a post-hook folds the stepped gradient into v. Both act on
the values the optimizer steps, the fp32 ones (fp32 without ZeRO: the module's parameters; fp16, bf16
and ZeRO-1: DeepSpeed's fp32 masters, flat and partitioned), whose gradients every wrapper has
unscaled and clipped before it steps (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer,
DeepSpeedZeroOptimizer in DeepSpeed 0.19). Elementwise, so a partition is corrected as the whole
would be. A skipped update changes nothing, state included.

W_g, v and n live in the optimizer's own state (``state[p]["hippie_delay_compensation_*"]``), so
every checkpoint DeepSpeed saves carries them, per rank and partition, and a resumed run continues
bit-identically. Memory: two fp32 values per master element (W_g, v), and two more during the step
(the corrected gradient and its denominator).

Applied on every ``2bw`` stage that computes one update behind (with ``method: "none"``, all of
them): :func:`bind` as the engine is built. Not built for the hippie family's delayed layers (part
of a stage's masters) or ``pipedream`` (more than one update behind): refused at start-up.
"""

from __future__ import annotations

import torch

from ...config import ConfigError
from .step_hooks import hooked_optimizer, require_stage_one_behind

KEY = "hippie.staleness.delay_compensation"
STATE_PREFIX = "hippie_delay_compensation"
COMPUTED_ON_KEY = STATE_PREFIX + "_computed_on"  # W_g: the values the last applied update started from
SECOND_MOMENT_KEY = STATE_PREFIX + "_second_moment"  # v
COUNT_KEY = STATE_PREFIX + "_count"  # n: the updates folded into v
DECAY, EPS = 0.999, 1e-8  # Adam's default betas[1] and eps: v_hat is AdamW's second moment at those


def _strength(staleness) -> float:
    """``hippie.staleness.delay_compensation`` (0: off, also when no staleness config is given)."""
    return 0.0 if staleness is None else staleness.delay_compensation


class DelayCompensation:
    """The correction on one torch optimizer (module docstring), for as long as the optimizer lives."""

    def __init__(self, optimizer: torch.optim.Optimizer, strength: float):
        if strength <= 0:
            raise ValueError(f"delay compensation strength {strength!r}: needs > 0")
        self.optimizer, self.strength = optimizer, strength
        # during a step: (param, its own gradient, the one stepped with, W(t) when no W_g buffer exists yet)
        self._stepping: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    @torch.no_grad()
    def _before(self, optimizer, args, kwargs) -> None:
        if kwargs.get("grads") is not None:  # DeepSpeed's legacy fusion: still scaled, and not in .grad
            raise RuntimeError(
                f"{KEY}: the optimizer is stepped with gradients passed to step() (DeepSpeed's "
                '"legacy_fusion"), which the correction does not see; turn legacy_fusion off'
            )
        self._stepping = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = optimizer.state.get(p) or {}
                computed_on = state.get(COMPUTED_ON_KEY)  # with v and n, after the first update
                stepped, start = grad, None
                if computed_on is None:
                    # the state is written after the step only: an optimizer sets its own up on an empty one
                    start = torch.Tensor.clone(torch.Tensor.detach(p))
                else:
                    stepped = corrected(
                        grad,
                        torch.Tensor.detach(p),
                        computed_on,
                        state[SECOND_MOMENT_KEY],
                        state[COUNT_KEY],
                        self.strength,
                    )
                    p.grad = stepped  # p: a user's parameter in fp32 without ZeRO, a master otherwise
                    computed_on.copy_(p)  # W(t): the next update's W_g
                self._stepping.append((p, grad, stepped, start))

    @torch.no_grad()
    def _after(self, optimizer, args, kwargs) -> None:
        for p, grad, stepped, start in self._stepping:
            state = optimizer.state[p]
            if start is not None:
                state[COMPUTED_ON_KEY] = start
            v = state.get(SECOND_MOMENT_KEY)
            if v is None:
                v = state[SECOND_MOMENT_KEY] = torch.zeros_like(stepped)
            v.mul_(DECAY).addcmul_(stepped, stepped, value=1 - DECAY)  # as torch's Adam folds its exp_avg_sq
            state[COUNT_KEY] = state.get(COUNT_KEY, 0) + 1
            p.grad = grad  # DeepSpeed's gradient buffer as it was
        self._stepping = []


def corrected(grad, weights, computed_on, second_moment, count: int, strength: float) -> torch.Tensor:
    """g + L * g * g * (W(t) - W_g) / (sqrt(v_hat) + eps), v_hat = v / (1 - 0.999^n): a new tensor."""
    denominator = torch.div(second_moment, 1 - DECAY**count).sqrt_().add_(EPS)
    return torch.sub(weights, computed_on).mul_(grad).mul_(grad).mul_(strength).div_(denominator).add_(grad)


def check(staleness, compiled) -> None:
    """At start-up, before any process group: delay compensation only where it is built (module
    docstring): a stage one update behind, computing on the unpredicted weights."""
    strength = _strength(staleness)
    if not strength:
        return
    require_stage_one_behind(KEY, strength, compiled)
    if staleness.method != "none":
        raise ConfigError(
            f'config key "{KEY}" = {strength!r} with "hippie.staleness.method" = '
            f'"{staleness.method}": delay compensation corrects the gradient of weights one update '
            'old, not predicted ones; allowed with "none" only (or "delay_compensation": 0 with '
            '"extrapolate-made", "extrapolate" or "adam")'
        )


def attach(optimizer, strength: float) -> DelayCompensation:
    """The correction on DeepSpeed's ``optimizer`` (its torch optimizer, ds.runtime.torch_optimizer)."""
    return DelayCompensation(hooked_optimizer(optimizer, KEY, strength), strength)


def bind(optimizer, behind: bool, staleness) -> DelayCompensation | None:
    """As the engine is built (adapter/stage/build.py): the correction on a stage one update
    behind (``behind``); None where it does not apply. The hooks keep it alive with the optimizer."""
    strength = _strength(staleness)
    if not strength or not behind:
        return None
    return attach(optimizer, strength)
