"""Single-process reference of the declared update rules, for the distributed tests.

Gradient of step t: the mean over replicas of the sum over micro-batches of grad(loss / M),
as DeepSpeed computes it. Immediate stages apply g(t) at step t; deferred stages apply g(t-1)
(nothing at t = 0). Clipping, when on, is per stage (see hippie_ds.adapter.engine.engine). Staleness
correction ``extrapolate`` (``hippie.staleness``): a deferred stage computes step t on
W(t) + c * (W(t) - W(t-1)) and its update applies to W(t). Partial deferral
(``hippie.deferred_layers``): only the parameters of a deferred stage's first k layers follow the
delayed rule (and the correction); the rest of the stage applies g(t) at step t, at t = 0 alone.
The schedules that never flush (2bw, pipedream) have theirs in reference_async.py.
"""

import torch
from deepspeed.runtime import utils as ds_utils

import model as tiny


def ranges(part):
    """A stage's layer ranges: (start, stop), or a list of them (one per model chunk, virtual stages)."""
    return [part] if isinstance(part[0], int) else list(part)


def stage_of_layers(parts):
    """parts: per stage (start, stop) or [(start, stop) per chunk] -> {layer index: stage}."""
    return {i: s for s, part in enumerate(parts) for a, b in ranges(part) for i in range(a, b)}


def interleaved_stages(parts, stages):
    """The engine's K * v model parts [(start, stop)] grouped per stage of the interleaved layout
    (chunk c of stage s is part c * K + s), as ``run`` takes them."""
    return [[parts[c * stages + s] for c in range(len(parts) // stages)] for s in range(stages)]


def build_tied_layers(parts):
    """The tied model (``tiny.tied_layer_specs``) as its stages hold it: one copy of the tied
    module per stage that holds it, each initialised from the first holder's (DeepSpeed
    broadcasts it), seeded per layer as PipelineModule(seed_layers=True)."""
    import functools
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    stage = stage_of_layers(parts)
    layers, copies = [], {}
    for idx, spec in enumerate(tiny.tied_layer_specs()):
        ds_utils.set_random_seed(tiny.BASE_SEED + idx)
        if not isinstance(spec, TiedLayerSpec):
            layers.append(spec.build())
            continue
        if (spec.key, stage[idx]) not in copies:
            module = spec.build()
            first = next((m for (k, _), m in copies.items() if k == spec.key), None)
            if first is not None:
                module.load_state_dict(first.state_dict())
            module.tied_key = spec.key
            for p in module.parameters():  # reference_fp16.Fp16Fused: the engine holds a tied copy first
                p.tied_key = spec.key
            copies[spec.key, stage[idx]] = module
        module = copies[spec.key, stage[idx]]
        layers.append(module if spec.forward_fn is None else functools.partial(spec.forward_fn, module))
    return layers


def _stage_params(layers, parts):
    """Per stage: [(layer index, parameter)], each parameter once (a tied copy under its first use)."""
    out = []
    for part in parts:
        seen, ps = set(), []
        for i in (i for a, b in ranges(part) for i in range(a, b)):
            module = layers[i].args[0] if hasattr(layers[i], "args") else layers[i]
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    ps.append((i, p))
        out.append(ps)
    return out


def _tied_slots(stage_params, layers):
    """[(stage, index)] of the tied copies' weights (the one tied module of the tiny model)."""
    modules = (layer.args[0] if hasattr(layer, "args") else layer for layer in layers)
    tied = {id(m.weight) for m in modules if hasattr(m, "tied_key")}
    return [(s, j) for s, ps in enumerate(stage_params) for j, p in enumerate(ps) if id(p) in tied]


def _sum_tied(grads, slots):
    """Every tied copy gets the sum of the copies' gradients (DeepSpeed's reduce_tied_grads)."""
    if slots:
        total = sum(grads[s][j] for s, j in slots)
        for s, j in slots:
            grads[s][j] = total.clone()


def run(
    parts,
    dp,
    micro_batches,
    steps,
    deferred=(),
    optimizer="SGD",
    lr=0.05,
    clip=0.0,
    staleness=None,
    delayed_layers=None,
    precision=None,
    tied=False,
    untied=False,
    flush=False,
):
    """``staleness``: None or an object with ``method`` ("none", "extrapolate", "extrapolate-made", "adam": the
    delayed parameters compute on reference_async.adam_predicted) and ``coefficient``;
    ``delayed_layers``: {deferred stage: its leading layers that are delayed} (default: all);
    ``precision``: a :class:`Precision` (default fp32); ``tied``: the tied model, whose tied
    copies follow one rule: delayed on every holder when a holder delays it (hippie_ds/adapter/gradients/tied.py);
    ``untied`` (``hippie.deferred_layers: "untied"``): in-step on every holder, even among a
    stage's delayed leading layers. ``flush``: ``drain()`` after the last step (the deferred stages'
    last buffered gradient applied, one more update; their in-step parameters left as they are)."""
    precision = precision or FP32
    layers = precision.model(build_tied_layers(parts) if tied else tiny.build_layers())
    indexed = _stage_params(layers, parts)
    stage_params = [[p for _, p in ps] for ps in indexed]
    slots = _tied_slots(stage_params, layers) if tied else []
    delayed_layers = delayed_layers or {}
    # partial deferral delays a stage's leading layers: those of its first chunk
    delayed = [
        [
            s in deferred and (s not in delayed_layers or i < ranges(part)[0][0] + delayed_layers[s])
            for i, _ in indexed[s]
        ]
        for s, part in enumerate(parts)
    ]
    if untied or any(delayed[s][j] for s, j in slots):
        for s, j in slots:
            delayed[s][j] = not untied
    opts = precision.optimizers(stage_params, optimizer, lr)
    pending = [None] * len(parts)
    made_at = [None] * len(parts)  # the loss scale a buffered gradient carries (fp16 + ZeRO-1)
    # "extrapolate-made" is extrapolate on hippie's delayed layers: they make nothing before they compute
    extrapolate = staleness is not None and staleness.method in ("extrapolate", "extrapolate-made")
    adam = staleness is not None and staleness.method == "adam"  # reference_async.adam_predicted
    true_weights = [None] * len(parts)  # W(t) of a deferred stage while it computes on the prediction
    previous = [_snapshot(ps) for ps in stage_params]  # W(t-1)
    losses = []
    for t in range(steps):
        for s in deferred if adam else ():
            from reference_async import adam_predicted

            true_weights[s] = _snapshot(stage_params[s])
            _load(
                [p for p, late in zip(stage_params[s], delayed[s]) if late],
                [w for w, late in zip(adam_predicted(opts[s], staleness.coefficient, precision), delayed[s]) if late],
            )
        for s in deferred if extrapolate else ():
            true_weights[s] = _snapshot(stage_params[s])
            with torch.no_grad():
                for p, w, q, late in zip(stage_params[s], true_weights[s], previous[s], delayed[s]):
                    if late:
                        p.add_(w - q, alpha=staleness.coefficient)
            previous[s] = true_weights[s]
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
            losses.append(sum(batch_losses) / micro_batches)
        else:
            grads = [[torch.zeros_like(p) for p in ps] for ps in stage_params]
            total = 0.0
            for r in range(dp):
                for m in range(micro_batches):
                    x, y = tiny.micro_batch(t, r, m)
                    out = x
                    for layer in layers:
                        out = layer(out)
                    loss = tiny.loss_fn(out, y)
                    total += loss.item() / (micro_batches * dp)
                    for p in (q for ps in stage_params for q in ps):
                        p.grad = None
                    (loss / micro_batches).backward()
                    for s, ps in enumerate(stage_params):
                        for g, p in zip(grads[s], ps):
                            g += p.grad / dp
            losses.append(total)
        if not (precision.accumulates_per_rank and precision.tie_before_dp):
            _sum_tied(grads, slots)
        precision.inject(t, grads)
        applies = []
        for s, ps in enumerate(stage_params):
            apply = grads[s]
            if s in deferred:
                if true_weights[s] is not None:
                    _load(ps, true_weights[s])
                buffered = precision.rescaled(pending[s], made_at[s]) if pending[s] else [None] * len(ps)
                apply = [b if late else g for b, g, late in zip(buffered, grads[s], delayed[s])]
                pending[s], made_at[s] = grads[s], precision.grad_scale()
            applies.append(apply)
        # the holders of a tied module clip by their joint norm (each holder's gradients counted)
        holders = {s for s, _ in slots}
        first = min(holders, default=None)  # DeepSpeed marks the other holders' copies ds_pipe_replicated
        replicated = [{j for t, j in slots if t == s and s != first} for s in sorted(holders)]
        joint = (
            None
            if not holders or clip <= 0
            else precision.joint_norm([applies[s] for s in sorted(holders)], replicated)
            if hasattr(precision, "joint_norm")
            else _norm([g for s in holders for g in applies[s]])
        )
        skip = precision.decide(applies)  # fp16: one overflow decision for the whole update
        for s, ps in enumerate(stage_params):
            if skip or all(g is None for g in applies[s]):
                continue
            precision.apply(ps, opts[s], applies[s], clip, joint if s in holders else None)
    if flush:  # drain(): one more update, the deferred stages' buffers alone
        applies = {
            s: [b if late else None for b, late in zip(precision.rescaled(pending[s], made_at[s]), delayed[s])]
            for s in deferred
            if pending[s] is not None
        }
        if not precision.decide(list(applies.values())):
            for s, apply in applies.items():
                precision.apply_only(stage_params[s], opts[s], apply, clip)
    return _result(layers), losses


# ---------------------------------------------------------------------------------------------
# Helpers of the references (``run`` here, and reference_async.py's never-flushing rules)


def _make_optimizers(stage_params, optimizer, lr):
    make = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=lr),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=lr),
        "NAdam": lambda ps: torch.optim.NAdam(ps, lr=lr),
    }[optimizer]
    return [make(ps) for ps in stage_params]


class Precision:
    """How a reference keeps weights and gradients.

    fp32: a torch optimizer steps the model's parameters. bf16: DeepSpeed's BF16_Optimizer (bf16
    and bf16 + ZeRO-1): a bf16 model computes; each rank adds each micro-batch's bf16 gradient into
    an accumulator of dtype ``accumulate``; the replicas' accumulators are averaged in bf16 on the
    wire (DeepSpeed's default communication_data_type under bf16: each divided by dp and rounded,
    then summed and rounded); the optimizer steps fp32 master copies (made from the bf16 initial weights)
    and the model takes their bf16 rounding. Flat optimizer partitions cannot skip a parameter: a
    part with nothing to apply yet (partial deferral's first step) takes a zero gradient; ``flat``
    says so of an fp32 model too (ZeRO-1's DeepSpeedZeroOptimizer; bf16 is always flat)."""

    def __init__(self, bf16=False, accumulate=torch.float32, comm=None, flat=False):
        self.bf16, self.accumulate = bf16, accumulate
        self.flat = flat or bf16
        # the all-reduce's wire (DeepSpeed's communication_data_type): bf16 under bf16 unless given;
        # None: the fp32 model's gradients averaged unrounded
        self.comm = comm if comm is not None else (torch.bfloat16 if bf16 else None)

    @property
    def accumulates_per_rank(self) -> bool:
        """Whether each rank's accumulated gradient is averaged as a whole (:func:`_batch_grads`):
        it is rounded (bf16 accumulators, or a rounding wire), so the order of sums shows."""
        return self.bf16 or self.comm is not None

    def model(self, layers):
        if self.bf16:  # in place; a tied copy used through a function (build_tied_layers) too
            for layer in layers:
                (layer.args[0] if hasattr(layer, "args") else layer).to(torch.bfloat16)
        return layers

    def data(self, x, y):
        return (x.bfloat16(), y.bfloat16()) if self.bf16 else (x, y)

    def zeros(self, p):
        return torch.zeros_like(p, dtype=self.accumulate if self.bf16 else p.dtype)

    def optimizers(self, stage_params, optimizer, lr):
        """Per stage: (optimizer, the tensors it steps: the parameters or their fp32 masters)."""
        steps = [[p.detach().float().clone() for p in ps] for ps in stage_params] if self.bf16 else stage_params
        return list(zip(_make_optimizers(steps, optimizer, lr), steps))

    tie_before_dp = False  # fp16 (reference_fp16.Fp16): each replica sums a tied module's copies before the average

    def scale_loss(self, loss):
        """The loss as the backward takes it (fp16 + ZeRO-1: times the loss scale)."""
        return loss

    def grad_scale(self):
        """The loss scale gradients made now carry (None: none)."""
        return None

    def rescaled(self, grads, made_at):
        """Buffered ``grads`` made at scale ``made_at``, as the update applying them now takes them."""
        return grads

    def inject(self, step, grads):
        """Change batch ``step``'s gradients (reference_fp16: an overflow injected)."""

    def decide(self, applies) -> bool:
        """Whether the update applying ``applies`` (per stage) is skipped (fp16's overflow)."""
        return False

    def apply_only(self, ps, opt, grads, clip):
        """``apply`` of the parameters with a gradient, the others left unmoved (weights and state)."""
        self.apply(ps, opt, grads, clip)

    def apply(self, ps, opt, grads, clip, norm=None):
        optimizer, steps = opt
        if self.bf16:
            grads = [None if g is None else g.float() for g in grads]
        if self.flat:
            grads = [torch.zeros_like(m) if g is None else g for g, m in zip(grads, steps)]
        _apply(steps, optimizer, grads, clip, norm)
        if self.bf16:
            with torch.no_grad():
                for p, m in zip(ps, steps):
                    p.copy_(m)


FP32 = Precision()


def _snapshot(ps):
    return [p.detach().clone() for p in ps]


def _load(ps, values):
    with torch.no_grad():
        for p, v in zip(ps, values):
            p.copy_(v)


def _micro_batch_grads(layers, stage_params, step, index, dp, micro_batches):
    """Mean over replicas of grad(loss / M) of micro-batch ``index`` of batch ``step`` (as the
    engine computes it), per stage; and the mean loss over replicas."""
    grads = [[torch.zeros_like(p) for p in ps] for ps in stage_params]
    total = 0.0
    for r in range(dp):
        x, y = tiny.micro_batch(step, r, index)
        out = x
        for layer in layers:
            out = layer(out)
        loss = tiny.loss_fn(out, y)
        total += loss.item() / dp
        for p in (q for ps in stage_params for q in ps):
            p.grad = None
        (loss / micro_batches).backward()
        for s, ps in enumerate(stage_params):
            for g, p in zip(grads[s], ps):
                g += p.grad / dp
    return grads, total


def _batch_grads(layers, stage_params, step, indices, dp, micro_batches, precision, slots=()):
    """bf16 or a rounding wire: the gradient of micro-batches ``indices`` of batch ``step`` as the engine
    computes it (each rank accumulates its micro-batches, the replicas' sums are averaged); and
    the mean loss per micro-batch over replicas. ``slots``: tied copies whose accumulated gradients
    each replica sums over the tie group before the average (the hippie family's order)."""
    grads = [[precision.zeros(p) for p in ps] for ps in stage_params]
    losses = [0.0] * len(indices)
    for r in range(dp):
        rank = [[precision.zeros(p) for p in ps] for ps in stage_params]
        for n, index in enumerate(indices):
            x, y = precision.data(*tiny.micro_batch(step, r, index))
            out = x
            for layer in layers:
                out = layer(out)
            loss = tiny.loss_fn(out, y)
            losses[n] += loss.item() / dp
            for p in (q for ps in stage_params for q in ps):
                p.grad = None
            precision.scale_loss(loss / micro_batches).backward()
            for s, ps in enumerate(stage_params):
                for acc, p in zip(rank[s], ps):
                    acc += p.grad.to(acc.dtype)
        _sum_tied(rank, slots)
        for s in range(len(stage_params)):
            for g, acc in zip(grads[s], rank[s]):
                g += (acc / dp).to(precision.comm).to(g.dtype)  # each replica's share, rounded on the wire
    for g in (g for gs in grads for g in gs):
        g.copy_(g.to(precision.comm))  # their sum, rounded on the wire
    return grads, losses


def _norm(grads):
    return torch.stack([g.norm(2) for g in grads if g is not None]).pow(2).sum().sqrt()


def _clipped(grads, clip, norm=None):
    """``grads`` scaled by min(1, clip / (norm + 1e-6)), DeepSpeed's clipping rule (``norm``:
    default these gradients')."""
    norm = _norm(grads) if norm is None else norm
    coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
    return [None if g is None else g * coef for g in grads]


def _apply(ps, opt, grads, clip, norm=None):
    """``norm``: the norm to clip by (default: these gradients', per stage as hippie_ds.adapter.engine.engine's
    per-stage updates)."""
    if clip > 0:
        grads = _clipped(grads, clip, norm)
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.clone()  # None: the optimizer skips it
    opt.step()


def _result(layers):
    return {
        i: {k: v.detach().clone() for k, v in layer.state_dict().items()}
        for i, layer in enumerate(layers)
        if isinstance(layer, torch.nn.Module) and list(layer.parameters())
    }
