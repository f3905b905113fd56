"""The split backward (hippie_ds.adapter.split_backward) against torch's full backward, one process."""
import pytest
import torch

from hippie_ds.adapter.split_backward import (SplitBackwardError, backward_input, backward_weight, check_coverage,
                                      check_torch_version)


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def _stage(first: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(16, 8)] if first else []
    return torch.nn.Sequential(*layers, Block(), Block())


def _inputs(first: bool, mb: int):
    g = torch.Generator().manual_seed(100 + mb)
    if first:
        return torch.randint(0, 16, (4, 5), generator=g)
    return torch.randn(4, 5, 8, generator=g).requires_grad_()


def _run(first: bool, split: bool, micro_batches: int = 3, w_order=None, stage=None):
    """Parameter and input gradients of ``micro_batches`` backwards (split: every I, then the W's
    in ``w_order``) of ``stage()`` (default: the test stage)."""
    model = stage() if stage is not None else _stage(first)
    params = list(model.parameters())
    pending, input_grads = {}, []
    for mb in range(micro_batches):
        x = _inputs(first, mb)
        out = model(x)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(mb))
        if split:
            pending[mb] = backward_input(out, grad, x, params)
        else:
            out.backward(grad)
        input_grads.append(None if first else x.grad.clone())
    for mb in w_order or range(micro_batches):
        if split:
            backward_weight(pending.pop(mb), params)
    return [p.grad.clone() for p in params], input_grads


@pytest.mark.parametrize("first", [False, True], ids=["inner-stage", "first-stage-token-ids"])
def test_split_equals_full_backward_bitwise(first):
    full, full_in = _run(first, split=False)
    split, split_in = _run(first, split=True)
    for a, b in zip(full, split):
        assert torch.equal(a, b)
    for a, b in zip(full_in, split_in):
        assert (a is None and b is None) or torch.equal(a, b)


def test_weight_passes_out_of_order_are_close_not_identical_in_general():
    full, _ = _run(False, split=False)
    split, _ = _run(False, split=True, w_order=[2, 0, 1])
    for a, b in zip(full, split):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_input_grad_is_ready_before_weight_grads():
    model = _stage(False)
    params = list(model.parameters())
    x = _inputs(False, 0)
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
    model = _stage(False)
    params = list(model.parameters())
    x = _inputs(False, 0)
    out = model(x)
    pending = backward_input(out, torch.ones_like(out), x, params)
    held = pending.tensors()
    assert held and all(torch.is_tensor(t) for t in held)
    first = backward_input(_stage(True)(_inputs(True, 0)), torch.ones(4, 5, 8), _inputs(True, 0), params)
    assert len(first.tensors()) == 1  # no input gradient: the output gradient waits for W


def test_activation_meter_sees_the_split_free_everything():
    """The meter keeps detached aliases: a loss stage's graph kept by I (retain_graph) and
    released by W is freed (log_softmax saves its own output: an alias carrying that node as
    grad_fn would make a cycle through C++ and leak), and gradients under the meter are the same."""
    from hippie_ds.adapter.memory import ActivationMeter

    def loss_stage(meter=None):
        model = _stage(False)
        params = list(model.parameters())
        for mb in range(3):
            x = _inputs(False, mb)
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
    """hippie_ds.adapter.checkpointing (a plan's per-layer re-computation) accepts autograd.grad: its
    layers' parameter gradients come during I, the rest during W, the sum is bit-identical."""
    from hippie_ds.adapter.checkpointing import checkpoint_run

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = Block(), Block()

        def forward(self, x):
            return self.b(checkpoint_run(self.a, x))

    for a, b in zip(_run(False, split=False, stage=Stage)[0], _run(False, split=True, stage=Stage)[0]):
        assert torch.equal(a, b)
