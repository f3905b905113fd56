"""The split backward (hippie_ds.adapter.gradients.split_backward) against torch's full backward, one process:
I then W bit-identical to the full backward (W in order; close out of order), what I leaves pending
for W, the coverage check and the torch version check, the activation meter and a plan's
re-computation inside a split stage, and the layout (strides) of the gradients I and W set. Real
clients' model shapes and failures in a handler (with the distributed launches) are
test_split_backward_clients.py's."""

import pytest
import torch

from hippie_ds.adapter.gradients.split_backward import (
    SplitBackwardError,
    backward_input,
    backward_weight,
    check_coverage,
    check_torch_version,
)

from split_backward_models import Block, make_inputs, make_stage, run_backwards


@pytest.mark.parametrize("first", [False, True], ids=["inner-stage", "first-stage-token-ids"])
def test_split_equals_full_backward_bitwise(first):
    full, full_in = run_backwards(first, split=False)
    split, split_in = run_backwards(first, split=True)
    for a, b in zip(full, split):
        assert torch.equal(a, b)
    for a, b in zip(full_in, split_in):
        assert (a is None and b is None) or torch.equal(a, b)


def test_weight_passes_out_of_order_are_close_not_identical_in_general():
    full, _ = run_backwards(False, split=False)
    split, _ = run_backwards(False, split=True, w_order=[2, 0, 1])
    for a, b in zip(full, split):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_input_grad_is_ready_before_weight_grads():
    model = make_stage(False)
    params = list(model.parameters())
    x = make_inputs(False, 0)
    out = model(x)
    pending = backward_input(out, torch.ones_like(out), x, params)
    assert x.grad is not None
    assert all(p.grad is None for p in params), "I must not compute parameter gradients"
    backward_weight(pending, params)
    assert all(p.grad is not None for p in params)


class IgnoresInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.ones(3))
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) + self.bias.exp()  # exp(bias) joins the main path at the add: covered


class ParallelBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * 2, self.w * 3  # the second output never meets the input


def test_coverage_accepts_params_joining_the_main_path_and_names_the_rest():
    m = IgnoresInput()
    x = torch.randn(2, 3, requires_grad=True)
    check_coverage(m(x), x, list(m.parameters()), [n for n, _ in m.named_parameters()])
    b = ParallelBranch()
    with pytest.raises(SplitBackwardError, match="parameter.s. w reach"):
        check_coverage(b(x), x, list(b.parameters()), ["w"])


def test_untested_torch_versions_are_refused_by_name():
    check_torch_version("2.13.0+cpu")
    with pytest.raises(ImportError, match=r"found torch 2\.12\.1.*torch>=2\.13,<2\.14"):
        check_torch_version("2.12.1")


def test_pending_state_lists_what_it_holds_beyond_saved_tensors():
    model = make_stage(False)
    params = list(model.parameters())
    x = make_inputs(False, 0)
    out = model(x)
    pending = backward_input(out, torch.ones_like(out), x, params)
    held = pending.tensors()
    assert held and all(torch.is_tensor(t) for t in held)
    first = backward_input(make_stage(True)(make_inputs(True, 0)), torch.ones(4, 5, 8), make_inputs(True, 0), params)
    assert len(first.tensors()) == 1  # no input gradient: the output gradient waits for W


def test_activation_meter_sees_the_split_free_everything():
    """The meter keeps detached aliases: a loss stage's graph kept by I (retain_graph) and
    released by W is freed (log_softmax saves its own output: an alias carrying that node as
    grad_fn would make a cycle through C++ and leak), and gradients under the meter are the same."""
    from hippie_ds.adapter.profiling.memory import ActivationMeter

    def loss_stage(meter=None):
        model = make_stage(False)
        params = list(model.parameters())
        for mb in range(3):
            x = make_inputs(False, mb)
            target = torch.randint(0, 8, (20,), generator=torch.Generator().manual_seed(mb))
            loss = torch.nn.functional.cross_entropy(model(x).view(-1, 8), target)
            backward_weight(backward_input(loss / 3, None, x, params), params)
        return [p.grad for p in params]

    plain = loss_stage()
    meter = ActivationMeter()
    with meter:
        measured = loss_stage()
    assert meter.peak > 0 and meter.current == 0
    for a, b in zip(plain, measured):
        assert torch.equal(a, b)


def test_plan_recomputation_inside_a_split_stage_is_exact():
    """hippie_ds.adapter.module.recompute (a plan's per-layer re-computation) accepts autograd.grad: its
    layers' parameter gradients come during I, the rest during W, the sum is bit-identical."""
    from hippie_ds.adapter.module.recompute import recompute_run

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = Block(), Block()

        def forward(self, x):
            return self.b(recompute_run(self.a, x))

    for a, b in zip(
        run_backwards(False, split=False, stage=Stage)[0], run_backwards(False, split=True, stage=Stage)[0]
    ):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Layouts: what I and W set as ``.grad`` is laid out as a full backward's AccumulateGrad lays it out


class SeqFirst(torch.nn.Module):
    """A Megatron-style stage on sequence-first activations: its input (SEQ, B, H) transposed back
    first (autograd.grad's input gradient is then a transposed view), a parameter used transposed
    (its weight gradient likewise), the output handed on as ``transpose(0, 1).contiguous()``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.randn(8, 5))

    def forward(self, x):
        h = torch.tanh(self.fc(x.transpose(0, 1))) * self.scale.t()
        return h.transpose(0, 1).contiguous()


def _leaf(kind: str, mb: int):
    g = torch.Generator().manual_seed(mb)
    if kind == "contiguous":  # as DeepSpeed receives an activation
        return torch.randn(5, 3, 8, generator=g).requires_grad_()
    if kind == "permuted":  # dense, not contiguous: AccumulateGrad keeps its strides
        return torch.randn(3, 5, 8, generator=g).transpose(0, 1).detach().requires_grad_()
    return torch.randn(5, 3, 16, generator=g)[..., ::2].detach().requires_grad_()  # not dense: contiguous


@pytest.mark.parametrize("kind", ["contiguous", "permuted", "strided"])
def test_gradients_are_laid_out_as_a_full_backward_lays_them_out(kind):
    """Input and parameter gradients of I and W (two micro-batches: the second adds into the
    first's parameter gradients) have the values and the strides of a full backward's: a
    contiguous stage input (every input DeepSpeed receives) gets a contiguous gradient, which a
    send accepts (it had the transposed strides autograd.grad returns: "input tensor has to be
    contiguous" at zb-h1's first ISendGrad)."""

    def run(split):
        model = SeqFirst()
        params = list(model.parameters())
        inputs = []
        for mb in range(2):
            x = _leaf(kind, mb)
            out = model(x)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + mb))
            if split:
                backward_weight(backward_input(out, grad, x, params), params)
            else:
                out.backward(grad)
            inputs.append(x.grad)
        return inputs + [p.grad for p in params]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b) and a.stride() == b.stride(), (a.stride(), b.stride())
    if kind == "contiguous":
        assert all(t.is_contiguous() for t in run(True))


def test_as_accumulated_follows_torch_layout_contract():
    from hippie_ds.adapter.gradients.split_backward import as_accumulated, obeys_layout

    leaf = torch.zeros(3, 5, 8).transpose(0, 1)
    grad = torch.randn(5, 3, 8)  # contiguous: not the leaf's strides
    laid = as_accumulated(grad, leaf)
    assert laid.stride() == leaf.stride() and torch.equal(laid, grad) and obeys_layout(laid, leaf)
    assert as_accumulated(laid, leaf) is laid  # already obeying: kept, no copy
    strided = torch.zeros(5, 16)[:, ::2]
    assert as_accumulated(grad[0].t().t(), strided).is_contiguous()
    assert as_accumulated(torch.randn(8, 5).t(), strided).is_contiguous()
