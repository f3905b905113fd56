"""What the split backward's tests (test_split_backward.py, test_split_backward_clients.py) run: a
small transformer-like block, a pipeline stage of two of them (the first stage with a token
embedding) and its micro-batches' inputs, and the parameter and input gradients of several
micro-batches' backwards, full or split."""

import torch

from hippie_ds.adapter.gradients.split_backward import backward_input, backward_weight


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def make_stage(first: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(16, 8)] if first else []
    return torch.nn.Sequential(*layers, Block(), Block())


def make_inputs(first: bool, mb: int):
    g = torch.Generator().manual_seed(100 + mb)
    if first:
        return torch.randint(0, 16, (4, 5), generator=g)
    return torch.randn(4, 5, 8, generator=g).requires_grad_()


def run_backwards(first: bool, split: bool, micro_batches: int = 3, w_order=None, stage=None):
    """Parameter and input gradients of ``micro_batches`` backwards (split: every I, then the W's
    in ``w_order``) of ``stage()`` (default: the test stage)."""
    model = stage() if stage is not None else make_stage(first)
    params = list(model.parameters())
    pending, input_grads = {}, []
    for mb in range(micro_batches):
        x = make_inputs(first, mb)
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
    return [None if p.grad is None else p.grad.clone() for p in params], input_grads
