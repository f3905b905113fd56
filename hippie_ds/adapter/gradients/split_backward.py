"""Split backward (zero-bubble schedules): a micro-batch's input gradient now (I, the paper's
B), its parameter gradients later (W), without computing anything twice. Torch only.

Built on torch's own split, ``torch.distributed.pipelining._backward`` (its graph helpers, its
``stage_backward_weight``, and its ``stage_backward_input`` restated to accept outputs that are
views): I runs ``autograd.grad`` towards the stage's inputs only, with hooks that keep, for every
op that uses a parameter, the gradient flowing into it; W runs ``autograd.grad`` from those kept
gradients to the parameters only. Every autograd node runs
once for I or W, never for both, except the few nodes between a parameter and the main path
(a transpose, a broadcast), which W repeats for the parameter's part only.

What a micro-batch holds between I and W (the zero-bubble paper's "memory until W"):
- its autograd graph with every tensor the forward saved (I retains the graph: W needs the
  saved inputs of the parameter ops; the other saved tensors are not freed early either);
- for every parameter op, the gradient of its output (about one activation per op; a copy where
  it would be a view of the output gradient the caller gave, which DeepSpeed reuses);
- not the stage's output, which I releases (a view output: the caller's last reference does).
W frees all of it.

Gradients are laid out as a full backward leaves them: the ``.grad`` of an input or a parameter
as torch's AccumulateGrad stores it (:func:`as_accumulated`: the leaf's strides, or contiguous),
not as ``autograd.grad`` returns it (an input transposed by the stage's first op, as in
sequence-first activations, would get transposed strides, which a send refuses).

A stage whose inputs need no gradient (the first stage, fed token ids) has no input gradient to
compute: I keeps the output and a copy of its gradient, W runs the whole backward.

Parameters that take no part in the stage's output (unused there) get no gradient, as from
autograd; :func:`check_coverage` refuses the one case the split would get wrong.

Parameters inside a re-entrant activation checkpoint (:mod:`hippie_ds.adapter.module.recompute`) get their
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
        raise ImportError(
            f"schedules that split the backward (backward_input / backward_weight) use torch's "
            f"private torch.distributed.pipelining._backward, tested with torch >= {lo[0]}.{lo[1]}, "
            f"< {hi[0]}.{hi[1]}; found torch {version}. Use a schedule without a split backward "
            f"(e.g. 1f1b) or install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}'."
        )


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
        return [
            g
            for group in self.param_groups
            for grads in group.get("grads") or ()
            for g in grads or ()
            if torch.is_tensor(g)
        ]


def _float_tensors(values) -> list[torch.Tensor]:
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [t for t in values if torch.is_tensor(t) and torch.Tensor.is_floating_point(t)]


def backward_input(outputs, output_grads, inputs, params: Sequence[torch.nn.Parameter]) -> PendingWeightGrad:
    """I: set ``inputs[i].grad`` for the stage inputs that require grad; return what W needs.
    ``outputs``: the stage's output tensor(s), or the (scaled) loss with ``output_grads=None``."""
    outs = _float_tensors(outputs)
    grads = None if output_grads is None else _float_tensors(output_grads)
    if grads is not None and len(grads) != len(outs):
        raise SplitBackwardError(f"{len(outs)} floating-point output(s) but {len(grads)} output gradient(s)")
    needs = [t for t in _float_tensors(inputs) if t.requires_grad]
    if not needs:
        # W runs later from these: a copy, since the caller may receive the next gradient into them
        return PendingWeightGrad(
            outputs=outs, output_grads=None if grads is None else [torch.Tensor.clone(g) for g in grads]
        )
    groups = _input_pass(outs, grads, needs, params)
    _own_gradients(groups, needs, grads)
    return PendingWeightGrad(param_groups=groups)


def _dense(t: torch.Tensor) -> bool:
    """torch's ``is_non_overlapping_and_dense``: the strides, ordered, are a contiguous tensor's."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, torch.Tensor.stride(t)) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def obeys_layout(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """torch's gradient layout contract (``obeys_layout_contract``): ``grad`` has ``leaf``'s strides
    (dimensions of size 1 aside) when ``leaf`` is dense and non-overlapping, else is contiguous."""
    if _dense(leaf):
        return all(
            gs == ls if n != 1 else gs != 0
            for n, gs, ls in zip(grad.shape, torch.Tensor.stride(grad), torch.Tensor.stride(leaf))
        )
    return torch.Tensor.is_contiguous(grad)


@torch.no_grad()
def as_accumulated(grad, leaf: torch.Tensor):
    """``grad`` laid out as AccumulateGrad stores the gradient of ``leaf`` in ``leaf.grad`` (torch's
    ``clone_obey_contract`` where :func:`obeys_layout` fails): ``grad`` itself when it obeys the
    contract, else a copy with ``leaf``'s strides (dense ``leaf``) or a contiguous one."""
    if (
        not torch.is_tensor(grad)
        or grad.layout != torch.strided
        or leaf.layout != torch.strided
        or obeys_layout(grad, leaf)
    ):
        return grad
    if _dense(leaf):
        return torch.empty_strided(leaf.shape, torch.Tensor.stride(leaf), dtype=grad.dtype, device=grad.device).copy_(
            grad
        )
    return torch.Tensor.clone(grad, memory_format=torch.contiguous_format)


def storages_of(tensors: Iterable) -> set[int]:
    """The storages (data pointers) of the non-empty tensors among ``tensors``."""
    return {torch.Tensor.untyped_storage(t).data_ptr() for t in tensors if torch.is_tensor(t) and torch.Tensor.numel(t)}


def copy_if_shared(t, storages: set[int]):
    """``t``, copied when it shares memory with one of ``storages`` (a buffer about to be reused)."""
    shared = torch.is_tensor(t) and torch.Tensor.numel(t) and torch.Tensor.untyped_storage(t).data_ptr() in storages
    return torch.Tensor.clone(t) if shared else t


def _own_gradients(groups: list[dict], inputs: list[torch.Tensor], given: list[torch.Tensor] | None) -> None:
    """Make what I leaves behind share no memory with the output gradients the caller gave.
    DeepSpeed receives every micro-batch's gradient into the same tensor (``grad_layer``), and
    autograd passes a gradient on without a copy through views and identities: where a view lies
    between a parameter op and the output (``nn.Linear`` on a 3-D input, ``x.view(...)``), the
    gradient kept for W is a view of the given one; where the input reaches the output through
    such ops alone, the input gradient (sent, without blocking, to the previous stage) is. The next
    receive would overwrite them: those are copied, the others (fresh results of autograd) kept."""
    storages = storages_of(given or ())
    if not storages:
        return

    def own(g):
        return copy_if_shared(g, storages)

    for group in groups:
        if group.get("grads") is not None:
            group["grads"] = [None if grads is None else tuple(map(own, grads)) for grads in group["grads"]]
    for t in inputs:
        if t.grad is not None:
            t.grad = own(t.grad)


def _input_pass(
    outs: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    needs: list[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
) -> list[dict]:
    """torch's ``stage_backward_input`` (torch.distributed.pipelining._backward, torch 2.13), but
    for an output that is a view: torch ends by detaching every output in place, to release the
    graph from it, and a view (``nn.Linear`` on a 3-D input, ``x.view(...)``) cannot be detached
    in place. Such an output is left as it is: it is the caller's last reference (the engine drops
    it after I, and its non-blocking sends keep a detached alias), so the graph is released from it
    all the same. Everything else is torch's: its graph helpers, its parameter groups (what W
    consumes), the same ``autograd.grad`` call, the input gradients set (added to a ``.grad``
    already there), laid out as AccumulateGrad would (:func:`as_accumulated`)."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        get_param_groups,
    )

    live = [
        (o, torch.ones_like(o) if grads is None else g)
        for o, g in zip(outs, grads or [None] * len(outs))
        if o.requires_grad or o.grad_fn is not None
    ]
    reverse = construct_reverse_graph([n for n in (_get_grad_fn_or_grad_acc(o) for o, _ in live) if n is not None])
    groups = get_param_groups(
        [_get_grad_fn_or_grad_acc(t) for t in needs],
        [n for n in map(_get_grad_fn_or_grad_acc, params) if n is not None],
        reverse,
    )
    handles = []

    def keep(group, i):  # the gradient flowing into the group's i-th intermediate node, for W
        def hook(grad_inputs):
            if group.get("grads") is None:
                group["grads"] = [None] * len(group["intermediates"])
            group["grads"][i] = grad_inputs

        return hook

    try:
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            handles += [node.register_prehook(keep(group, i)) for i, node in enumerate(group["intermediates"])]
        if live:
            dinputs = torch.autograd.grad(
                [o for o, _ in live], needs, [g for _, g in live], retain_graph=True, allow_unused=True
            )
            for t, d in zip(needs, dinputs):
                if d is not None:
                    t.grad = as_accumulated(d if t.grad is None else t.grad + d, t)
    finally:
        for handle in handles:
            handle.remove()
    for o in outs:  # drop the output side of the graph (W starts from the kept gradients)
        if not torch.Tensor._is_view(o):
            torch.Tensor.detach_(o)
    return groups


def backward_weight(pending: PendingWeightGrad, params: Sequence[torch.nn.Parameter]) -> None:
    """W: accumulate the micro-batch's parameter gradients into ``param.grad``. torch's
    ``stage_backward_weight`` sets a missing ``.grad`` to what ``autograd.grad`` returns (a
    parameter used transposed gets transposed strides) and adds into one already there: the
    gradients it sets are laid out as AccumulateGrad would (:func:`as_accumulated`)."""
    if pending.param_groups is None:
        torch.autograd.backward(pending.outputs, pending.output_grads)
        return
    from torch.distributed.pipelining._backward import stage_backward_weight

    params = list(params)
    fresh = [p.grad is None for p in params]
    stage_backward_weight(iter(params), pending.param_groups)
    for p, new in zip(params, fresh):
        if new and p.grad is not None:
            p.grad = as_accumulated(p.grad, p)


def check_coverage(outputs, inputs, params: Sequence[torch.nn.Parameter], names: Iterable[str]) -> None:
    """Raise when a parameter reaches the stage's output on a path that never meets the path from
    its inputs (e.g. a layer that ignores its input and adds its own output, or a second output
    made of parameters alone): I back-propagates from the output towards the inputs only, W from
    the points where a parameter's branch joins that path, so a gradient flowing through such a
    path would be silently lost. Parameters that take no part in the output (unused on this
    stage, e.g. a tied embedding's position table on the head's stage) are fine: no gradient
    reaches them, and they keep ``.grad`` None as autograd and stock DeepSpeed leave them. Run
    once, on the first micro-batch, before its I."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        reverse_closure,
    )

    needs = [t for t in _float_tensors(inputs) if t.requires_grad]
    if not needs:
        return  # W runs the whole backward
    roots = {n for n in map(_get_grad_fn_or_grad_acc, _float_tensors(outputs)) if n is not None}
    reverse = construct_reverse_graph(list(roots))
    # the nodes on a path from the inputs to the output (what I runs), as torch's get_param_groups
    inputs_closure, _ = reverse_closure([_get_grad_fn_or_grad_acc(t) for t in needs], set(), reverse)
    missing = []
    for name, param in zip(names, params):
        acc = _get_grad_fn_or_grad_acc(param)
        if not reverse.get(acc):
            continue  # takes no part in the output (reverse is a defaultdict: .get adds no key)
        # forward from the parameter, stopping where its branch joins the inputs' path: reaching
        # an output on the way is a path that neither I nor W runs
        branch, _ = reverse_closure([acc], inputs_closure, reverse)
        if branch & roots:
            missing.append(name)
    if missing:
        raise SplitBackwardError(
            f"parameter(s) {', '.join(missing)} reach the stage's output on a path that does not "
            "meet the path from its input: a split backward (backward_input / backward_weight) "
            "would lose that part of their gradients; use a schedule without a split backward "
            "(e.g. 1f1b)"
        )
