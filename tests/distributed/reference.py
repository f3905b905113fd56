"""Single-process reference of the declared update rules, for the distributed tests.

Gradient of step t: the mean over replicas of the sum over micro-batches of grad(loss / M),
as DeepSpeed computes it. Immediate stages apply g(t) at step t; deferred stages apply g(t-1)
(nothing at t = 0). Clipping, when on, is per stage (see hippie_ds.engine).
"""
import torch

import model as tiny


def stage_of_layers(parts):
    """parts: list of (start, stop) per stage -> {layer index: stage}."""
    return {i: s for s, (a, b) in enumerate(parts) for i in range(a, b)}


def run(parts, dp, micro_batches, steps, deferred=(), optimizer="SGD", lr=0.05, clip=0.0):
    layers = tiny.build_layers()
    stage_params = [[p for i in range(a, b) for p in layers[i].parameters()] for a, b in parts]
    make = {"SGD": lambda ps: torch.optim.SGD(ps, lr=lr),
            "AdamW": lambda ps: torch.optim.AdamW(ps, lr=lr)}[optimizer]
    opts = [make(ps) for ps in stage_params]
    pending = [None] * len(parts)
    losses = []
    for t in range(steps):
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
        for s, ps in enumerate(stage_params):
            apply = grads[s]
            if s in deferred:
                apply, pending[s] = pending[s], grads[s]
                if apply is None:
                    continue
            if clip > 0:
                norm = torch.stack([g.norm(2) for g in apply]).pow(2).sum().sqrt()
                coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
                apply = [g * coef for g in apply]
            for p, g in zip(ps, apply):
                p.grad = g.clone()
            opts[s].step()
    return {i: {k: v.detach().clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(layers)
            if isinstance(layer, torch.nn.Module) and list(layer.parameters())}, losses
