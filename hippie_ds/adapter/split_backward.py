"""Split backward (zero-bubble schedules): a micro-batch's input gradient now (I, the paper's
B), its parameter gradients later (W), without computing anything twice. Torch only.

Built on torch's own split, ``torch.distributed.pipelining._backward`` (``stage_backward_input``
/ ``stage_backward_weight``): I runs ``autograd.grad`` towards the stage's inputs only, with
hooks that keep, for every op that uses a parameter, the gradient flowing into it; W runs
``autograd.grad`` from those kept gradients to the parameters only. Every autograd node runs
once for I or W, never for both, except the few nodes between a parameter and the main path
(a transpose, a broadcast), which W repeats for the parameter's part only.

What a micro-batch holds between I and W (the zero-bubble paper's "memory until W"):
- its autograd graph with every tensor the forward saved (I retains the graph: W needs the
  saved inputs of the parameter ops; the other saved tensors are not freed early either);
- for every parameter op, the gradient of its output (about one activation per op);
- not the stage's output, which I releases.
W frees all of it.

A stage whose inputs need no gradient (the first stage, fed token ids) has no input gradient to
compute: I keeps the output and its gradient, W runs the whole backward.

Parameters inside a re-entrant activation checkpoint (:mod:`hippie_ds.adapter.checkpointing`) get their
gradients during I: the checkpoint's backward re-runs its layers and back-propagates through
them at once. Values and accumulation order are unchanged; only W has less to do.

The module is private in torch; hippie-ds checks the tested torch range (:data:`TESTED_TORCH`)
when a schedule splits its backward.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

TESTED_TORCH = ((2, 13), (2, 14))  # [2.13, 2.14): torch.distributed.pipelining._backward as used here


class SplitBackwardError(RuntimeError):
    """A model the split backward cannot serve exactly; the message says which parameter."""


def check_torch_version(version: str | None = None) -> None:
    """Refuse torch versions whose private split-backward helpers were not tested."""
    version = version or torch.__version__
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise ImportError(f"hippie-ds cannot parse the torch version {version!r}") from None
    lo, hi = TESTED_TORCH
    if not lo <= (major, minor) < hi:
        raise ImportError(f"schedules that split the backward (backward_input / backward_weight) use torch's "
                          f"private torch.distributed.pipelining._backward, tested with torch >= {lo[0]}.{lo[1]}, "
                          f"< {hi[0]}.{hi[1]}; found torch {version}. Use a schedule without a split backward "
                          f"(e.g. 1f1b) or install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}'.")


class PendingWeightGrad:
    """What I leaves for W of one micro-batch."""

    __slots__ = ("param_groups", "outputs", "output_grads")

    def __init__(self, param_groups=None, outputs=None, output_grads=None):
        self.param_groups = param_groups  # torch's split: gradients kept at the parameter ops
        self.outputs = outputs  # no input gradient: the whole backward runs in W
        self.output_grads = output_grads

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for W that are not saved tensors of the graph (memory meters count
        saved tensors already): the gradients kept at the parameter ops, or the kept output
        gradients."""
        if self.param_groups is None:
            return [g for g in self.output_grads or () if torch.is_tensor(g)]
        return [g for group in self.param_groups for grads in group.get("grads") or () for g in grads or ()
                if torch.is_tensor(g)]


def _float_tensors(values) -> list[torch.Tensor]:
    values = values if isinstance(values, (tuple, list)) else (values, )
    return [t for t in values if torch.is_tensor(t) and t.is_floating_point()]


def backward_input(outputs, output_grads, inputs, params: Sequence[torch.nn.Parameter]) -> PendingWeightGrad:
    """I: set ``inputs[i].grad`` for the stage inputs that require grad; return what W needs.
    ``outputs``: the stage's output tensor(s), or the (scaled) loss with ``output_grads=None``."""
    from torch.distributed.pipelining._backward import stage_backward_input
    outs = _float_tensors(outputs)
    grads = None if output_grads is None else _float_tensors(output_grads)
    if grads is not None and len(grads) != len(outs):
        raise SplitBackwardError(f"{len(outs)} floating-point output(s) but {len(grads)} output gradient(s)")
    needs = [t for t in _float_tensors(inputs) if t.requires_grad]
    if not needs:
        return PendingWeightGrad(outputs=outs, output_grads=grads)
    _, groups = stage_backward_input(outs, grads, needs, iter(params))
    return PendingWeightGrad(param_groups=groups)


def backward_weight(pending: PendingWeightGrad, params: Sequence[torch.nn.Parameter]) -> None:
    """W: accumulate the micro-batch's parameter gradients into ``param.grad``."""
    if pending.param_groups is None:
        torch.autograd.backward(pending.outputs, pending.output_grads)
        return
    from torch.distributed.pipelining._backward import stage_backward_weight
    stage_backward_weight(iter(params), pending.param_groups)


def check_coverage(outputs, inputs, params: Sequence[torch.nn.Parameter], names: Iterable[str]) -> None:
    """Raise when a parameter reaches the stage's output without passing through a path from its
    inputs (e.g. a layer that ignores its input): torch's split would silently skip its
    gradient. Run once, on the first micro-batch, before its I."""
    from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                        get_param_groups)
    needs = [t for t in _float_tensors(inputs) if t.requires_grad]
    if not needs:
        return  # W runs the whole backward
    roots = [n for n in map(_get_grad_fn_or_grad_acc, _float_tensors(outputs)) if n is not None]
    reverse = construct_reverse_graph(roots)
    accs = [_get_grad_fn_or_grad_acc(p) for p in params]
    groups = get_param_groups([_get_grad_fn_or_grad_acc(t) for t in needs], accs, reverse)
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    missing = [name for name, acc in zip(names, accs) if acc in reverse and acc not in covered]
    if missing:
        raise SplitBackwardError(f"parameter(s) {', '.join(missing)} reach the stage's output on no path from its "
                                 "input: a split backward (backward_input / backward_weight) cannot compute their "
                                 "gradients apart; use a schedule without a split backward (e.g. 1f1b)")
