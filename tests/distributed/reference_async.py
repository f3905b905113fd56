"""Single-process reference of the update rules of the schedules that never flush: PipeDream-2BW
(``run_2bw``: double-buffered weights, every stage one step late) and PipeDream (``run_pipedream``:
one weight version per in-flight micro-batch, ``vertical_sync`` optionally), for the distributed
tests; the synchronous and deferred rules, and what both share, are reference.py's."""

import math

import torch

import model as tiny
from reference import (
    FP32,
    _batch_grads,
    _clipped,
    _load,
    _micro_batch_grads,
    _result,
    _snapshot,
    _stage_params,
    _tied_slots,
    build_tied_layers,
)


def _continuous_model(parts, precision, tied):
    """(layers, per-stage parameters, tied slots) of the tiny model or, ``tied``, the tied one."""
    layers = precision.model(build_tied_layers(parts) if tied else tiny.build_layers())
    stage_params = [[p for _, p in ps] for ps in _stage_params(layers, parts)]
    return layers, stage_params, _tied_slots(stage_params, layers) if tied else []


def _lag_tied(grads, slots, pending, lag=1, precision=None):
    """Tied copies under a schedule that never flushes (hippie_ds/adapter/gradients/tied.py's
    LaggedTieSums): each copy's update u applies the sum over the copies of their update-(u-lag)
    gradients (none before u = lag: the copies are left out of the step). ``pending``: a list
    of the sums not applied yet, oldest first (updated here). ``lag=0``: the sum of update u
    itself (a rule the tests tell apart from hippie-ds's). fp16 + ZeRO-1 (a ``precision`` whose
    gradients carry the loss scale): the sum of update u - lag, made at that update's scale, is
    applied at update u's, multiplied by S(u) / S(u - lag) (a power of two)."""
    if not slots:
        return
    scale = None if precision is None else precision.grad_scale()
    if precision is not None and precision.tie_before_dp and precision.accumulates_per_rank:
        # fp16: each replica summed its copies before the average (_batch_grads): every slot holds the sum; an
        # overflow injected into any copy reaches it
        total = grads[slots[0][0]][slots[0][1]]
        if any(not bool(torch.isfinite(grads[s][j]).all()) for s, j in slots):
            total = total * math.inf
        pending.append((total, scale))
    else:
        pending.append((sum(grads[s][j] for s, j in slots), scale))
    applied = pending.pop(0) if len(pending) > lag else None
    if (
        applied is not None
        and scale is not None
        and applied[1] != scale
        and getattr(precision, "rescales_tie_sums", True)
    ):
        applied = (applied[0] * (scale / applied[1]), scale)
    for s, j in slots:
        grads[s][j] = None if applied is None else applied[0].clone()


def _fp16_inject(precision, batch, indices, grads):
    """fp16 (reference_fp16.Fp16Async): the overflows injected into the backwards of micro-batches
    ``indices`` of ``batch`` (before the tie sum: a tied copy's overflow reaches the sum)."""
    inject = getattr(precision, "inject_backwards", None)
    if inject is not None:
        inject(batch, indices, grads)


def _fp16_decision(precision, grads):
    """fp16: the update's one decision over every stage's gradient it applies, the lagged tie sum
    included (True: skipped on every stage, that sum dropped). False under the other precisions."""
    return hasattr(precision, "inject_backwards") and precision.decide(grads)


def _clip_apart(grads, slots, clip, precision=None):
    """Clipping of the tied model under a schedule that never flushes (LaggedTieSums.clip_apart):
    on each stage, its tied copy by the norm of its (summed) gradient, the rest by theirs. Returns
    the clip the step itself applies after that (0 when clipped here). Gradients that carry the
    loss scale S (fp16 + ZeRO-1): DeepSpeed's rule at ``max_norm`` clip * S and ``eps`` 1e-6 * S."""
    if not slots or clip <= 0:
        return clip
    scale = None if precision is None else precision.grad_scale()
    if getattr(precision, "ds_clipping", False):  # fp16: DeepSpeed's own function, as the engine clips (its rounding)
        from deepspeed.runtime.utils import clip_tensors_by_global_norm

        for s, stage in enumerate(grads):
            tied = {j for t, j in slots if t == s}
            for part in ([j for j in range(len(stage)) if j in tied], [j for j in range(len(stage)) if j not in tied]):
                present = [j for j in part if stage[j] is not None]
                for j in present:
                    stage[j] = stage[j].clone()
                if present:
                    clip_tensors_by_global_norm(
                        [stage[j] for j in present], max_norm=clip * (scale or 1.0), eps=1e-6 * (scale or 1.0)
                    )
        return 0.0
    if scale is not None:
        for s, stage in enumerate(grads):
            tied = {j for t, j in slots if t == s}
            for part in ([j for j in range(len(stage)) if j in tied], [j for j in range(len(stage)) if j not in tied]):
                present = [j for j in part if stage[j] is not None]
                if present:
                    norm = float(torch.stack([stage[j].float().norm(2) for j in present]).pow(2).sum().sqrt())
                    coef = clip * scale / (norm + 1e-6 * scale)
                    if coef < 1:
                        for j in present:
                            stage[j] = stage[j] * coef
        return 0.0
    for s, stage in enumerate(grads):
        tied = {j for t, j in slots if t == s}
        for part in ([j for j in range(len(stage)) if j in tied], [j for j in range(len(stage)) if j not in tied]):
            present = [stage[j] for j in part if stage[j] is not None]
            if not present:
                continue
            for j, g in zip((j for j in part if stage[j] is not None), _clipped(present, clip)):
                stage[j] = g
    return 0.0


def adam_predicted(opt, coefficient, precision=None):
    """The ``adam`` staleness correction's prediction (``hippie.staleness.method: "adam"``), written
    out from a reference's (optimizer, tensors it steps) pair (``Precision.optimizers``): per
    tensor W + c * u_hat, u_hat = -lr (m_hat / (sqrt(s_hat) + eps) + wd W) with Adam's moments m,
    s bias-corrected for the next step k + 1 (torch.optim.AdamW's decoupled decay), or W where
    the optimizer has no state yet. bf16: the prediction of the fp32 masters, rounded to bf16."""
    optimizer, tensors = opt
    assert isinstance(optimizer, torch.optim.AdamW), "the adam correction's reference reads AdamW"
    group = optimizer.param_groups[0]
    (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
    out = []
    with torch.no_grad():
        for w in tensors:
            state = optimizer.state.get(w)
            if not state:
                predicted = w.detach().clone()
            else:
                k = float(state["step"]) + 1
                m_hat, s_hat = state["exp_avg"] / (1 - b1**k), state["exp_avg_sq"] / (1 - b2**k)
                predicted = w - coefficient * lr * (m_hat / (s_hat.sqrt() + eps) + wd * w)
            out.append(predicted.to(torch.bfloat16) if precision is not None and precision.bf16 else predicted)
    return out


def error_feedback(optimizer, gain):
    """``hippie.staleness.error_feedback`` = ``gain`` on one stage's optimizer, written from its rule:
    after each step of the values the optimizer steps (the masters, before a precision copies them
    to the model), W -= gain * (u - u_prev), u = W before the step - W after it, u_prev the last
    one (0 at first); a value the optimizer holds no state for (never stepped) is left alone."""
    last, start = {}, []

    def before(opt, args, kwargs):
        start[:] = [
            (p, p.detach().clone()) for group in opt.param_groups for p in group["params"] if p.grad is not None
        ]

    def after(opt, args, kwargs):
        with torch.no_grad():
            for p, w in start:
                if not opt.state.get(p):
                    continue
                u = w - p
                p.sub_(u - last[p] if p in last else u, alpha=gain)
                last[p] = u

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def delay_compensation(optimizer, strength):
    """``hippie.staleness.delay_compensation`` = ``strength`` on one stage's optimizer, written from its
    rule: each step of the values the optimizer steps (the masters) takes the gradient g + L g g (W -
    W_g) / (sqrt(v / (1 - 0.999^n)) + 1e-8), W_g the values the last step started from, v the moving
    average (0.999) of the n gradients stepped before; the first step takes g as it is."""
    computed_on, second_moment, counts, stepping = {}, {}, {}, []

    def before(opt, args, kwargs):
        stepping.clear()
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    g = p.grad
                    if p in computed_on:
                        n = counts[p]
                        denominator = (second_moment[p] / (1 - 0.999**n)).sqrt() + 1e-8
                        p.grad = (p - computed_on[p]) * g * g * strength / denominator + g
                    computed_on[p] = p.detach().clone()
                    stepping.append((p, g))

    def after(opt, args, kwargs):
        with torch.no_grad():
            for p, g in stepping:
                stepped = p.grad
                second_moment[p] = torch.addcmul(
                    second_moment.get(p, torch.zeros_like(p)) * 0.999, stepped, stepped, value=1 - 0.999
                )  # torch Adam's exp_avg_sq, its rounding
                counts[p] = counts.get(p, 0) + 1
                p.grad = g

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def run_2bw(
    parts,
    dp,
    micro_batches,
    steps,
    optimizer="SGD",
    lr=0.05,
    clip=0.0,
    staleness=None,
    precision=None,
    tied=False,
    tie_lag=1,
):
    """PipeDream-2BW: every micro-batch of batch t runs forward and backward on W(t-1) (W(-1) =
    W(0)); the batch's gradient (summed over micro-batches, averaged over replicas) is applied
    to W(t): W(t+1) = W(t) - lr * grad(W(t-1)), on every stage. With ``staleness`` extrapolate
    (``hippie.staleness``), batch t computes on W(t-1) + c * (W(t-1) - W(t-2)) instead (no
    prediction while t-1 < 1: version 0 has no previous update); with ``adam`` on
    :func:`adam_predicted` of W(t-1), from the optimizer's state right after the update that made
    W(t-1), except on the last stage, which has made W(t) before batch t computes: there on
    W(t-1) + c (W(t) - W(t-1)) (t-1 >= 1); ``extrapolate-made``: extrapolate's, with the last stage's
    made weights as ``adam``'s (not in fp16: the last stage holds its update until the vote is in);
    ``error_feedback`` > 0 (:func:`error_feedback`) on every stage that does not compute on made weights;
    ``delay_compensation`` > 0 (:func:`delay_compensation`, ``method`` "none") on every stage. ``tied``: the
    tied model, its copies ``tie_lag`` updates later (:func:`_lag_tied`), clipped apart (:func:`_clip_apart`). fp16
    (``precision`` reference_fp16.Fp16Async): batch t's update is skipped on every stage when any gradient it applies
    (the lagged tie sum included) is not finite (:func:`_fp16_decision`)."""
    precision = precision or FP32
    layers, stage_params, slots = _continuous_model(parts, precision, tied)
    tie_sums = []
    everything = [p for ps in stage_params for p in ps]
    opts = precision.optimizers(stage_params, optimizer, lr)
    extrapolate = staleness is not None and staleness.method in ("extrapolate", "extrapolate-made")
    adam = staleness is not None and staleness.method == "adam"
    # "extrapolate-made": not in fp16, where the last stage holds its update until the vote is in
    made_weights = adam or (
        staleness is not None and staleness.method == "extrapolate-made" and not hasattr(precision, "inject_backwards")
    )
    gain = getattr(staleness, "error_feedback", 0.0) if staleness is not None else 0.0
    for s, opt in enumerate(opts if gain else ()):  # every stage computing one update behind
        if not (made_weights and s == len(opts) - 1):
            error_feedback(opt[0] if isinstance(opt, tuple) else opt, gain)
    strength = getattr(staleness, "delay_compensation", 0.0) if staleness is not None else 0.0
    if strength:
        assert staleness.method == "none", "delay compensation: built with no prediction only"
        for opt in opts:  # every stage computes on W(t-1)
            delay_compensation(opt[0] if isinstance(opt, tuple) else opt, strength)
    history = {0: _snapshot(everything)}  # W(v) for the versions still computed on
    predicted = {}  # adam: W_hat(v), made right after the update that made W(v)
    losses = []
    for t in range(steps):
        current = _snapshot(everything)  # W(t)
        v = max(0, t - 1)
        compute = history[v]
        if extrapolate and v >= 1:
            compute = [w + staleness.coefficient * (w - q) for w, q in zip(history[v], history[v - 1])]
        if made_weights and v >= 1:
            last = len(everything) - len(stage_params[-1])  # the last stage's tensors: the made W(t)
            made = [
                w + staleness.coefficient * (n - w) if staleness.coefficient != 1 else n.clone()
                for w, n in zip(history[v][last:], current[last:])
            ]
            compute = (predicted[v] if adam else compute)[:last] + made
        _load(everything, compute)
        if precision.accumulates_per_rank:
            grads, batch_losses = _batch_grads(
                layers,
                stage_params,
                t,
                range(micro_batches),
                dp,
                micro_batches,
                precision,
                slots if precision.tie_before_dp else (),
            )
            total = sum(batch_losses) / micro_batches
        else:
            grads = [[torch.zeros_like(p) for p in ps] for ps in stage_params]
            total = 0.0
            for m in range(micro_batches):
                g, loss = _micro_batch_grads(layers, stage_params, t, m, dp, micro_batches)
                total += loss / micro_batches
                for s in range(len(parts)):
                    for acc, x in zip(grads[s], g[s]):
                        acc += x
        losses.append(total)
        _load(everything, current)
        _fp16_inject(precision, t, range(micro_batches), grads)
        _lag_tied(grads, slots, tie_sums, tie_lag, precision)
        step_clip = _clip_apart(grads, slots, clip, precision)
        skip = _fp16_decision(precision, grads)
        for s, ps in enumerate(stage_params):
            if not skip:
                precision.apply(ps, opts[s], grads[s], step_clip)
        history[t + 1] = _snapshot(everything)
        if adam:
            predicted[t + 1] = [w for opt in opts for w in adam_predicted(opt, staleness.coefficient, precision)]
    return _result(layers), losses


def pipedream_version(stage, stages, index, vertical_sync=False):
    """The weight version (updates applied on the stage) micro-batch ``index`` (counted over the
    whole run) uses on ``stage`` in PipeDream's 1F1B: the stage's latest when it forwards it,
    i.e. after the backwards of every micro-batch up to index - (stages - stage); with vertical
    sync, the version the first stage used."""
    warmup = stages - 1 if vertical_sync else stages - 1 - stage
    return max(0, index - warmup)


def run_pipedream(
    parts,
    dp,
    micro_batches,
    steps,
    vertical_sync=False,
    optimizer="SGD",
    lr=0.05,
    clip=0.0,
    precision=None,
    tied=False,
    tie_lag=1,
):
    """PipeDream with weight stashing: micro-batch i runs forward and backward on stage s with
    weight version ``pipedream_version(s, K, i)``; each stage applies micro-batch i's gradient
    (grad(loss / M), averaged over replicas) as its (i+1)-th update. ``tied``: the tied model,
    its copies ``tie_lag`` updates later (:func:`_lag_tied`), clipped apart (:func:`_clip_apart`).
    fp16 (reference_fp16.Fp16Async): micro-batch i's update is skipped on every stage when any
    gradient it applies is not finite; the loss scale moves once per batch, at its last update."""
    K = len(parts)
    precision = precision or FP32
    layers, stage_params, slots = _continuous_model(parts, precision, tied)
    tie_sums = []
    opts = precision.optimizers(stage_params, optimizer, lr)
    if hasattr(precision, "updates_per_batch"):  # fp16: the loss scale moves once per batch of M updates
        precision.updates_per_batch = micro_batches
    history = [[_snapshot(ps)] for ps in stage_params]  # stage -> version -> values
    losses = []
    for i in range(steps * micro_batches):
        t, m = divmod(i, micro_batches)
        for s, ps in enumerate(stage_params):
            _load(ps, history[s][pipedream_version(s, K, i, vertical_sync)])
        if precision.accumulates_per_rank:
            grads, (loss,) = _batch_grads(
                layers, stage_params, t, [m], dp, micro_batches, precision, slots if precision.tie_before_dp else ()
            )
        else:
            grads, loss = _micro_batch_grads(layers, stage_params, t, m, dp, micro_batches)
        if m == 0:
            losses.append(0.0)
        losses[-1] += loss / micro_batches
        _fp16_inject(precision, t, [m], grads)
        _lag_tied(grads, slots, tie_sums, tie_lag, precision)
        step_clip = _clip_apart(grads, slots, clip, precision)
        skip = _fp16_decision(precision, grads)
        for s, ps in enumerate(stage_params):
            _load(ps, history[s][-1])
            if not skip:
                precision.apply(ps, opts[s], grads[s], step_clip)
            history[s].append(_snapshot(ps))
    return _result(layers), losses
