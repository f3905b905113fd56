"""Per-layer re-computation for planned pipeline stages (what DeepSpeed and Megatron call activation
checkpointing; here "checkpoint" means saved training state only).

:func:`recompute_run` runs a run of consecutive layers without keeping their activations and
re-runs it in the backward. It is reentrant (an ``autograd.Function``, like DeepSpeed's and
Megatron's), with two differences that matter here:

* the run's inputs are kept with ``ctx.save_for_backward``, so they are visible to
  saved-tensor hooks (:class:`hippie_ds.adapter.profiling.memory.ActivationMeter` measures what a plan
  predicts); DeepSpeed's ``checkpointing.checkpoint`` keeps them on ``ctx`` where no hook sees
  them;
* a zero-size tensor that requires grad is passed along, so the output requires grad even
  when no input does (the first stage's data): the parameters inside still get gradients.

The RNG state (CPU and the current accelerator device) is restored for the re-run, so dropout
draws the same masks.
"""

from __future__ import annotations

import torch


def _device_rng_state():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state()
    return None


class _RecomputeRun(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, _requires_grad, *inputs):
        ctx.run = run
        ctx.cpu_rng = torch.get_rng_state()
        ctx.dev_rng = _device_rng_state()
        tensor_idx = [i for i, x in enumerate(inputs) if torch.is_tensor(x)]
        ctx.tensor_idx = tensor_idx
        ctx.others = [None if torch.is_tensor(x) else x for x in inputs]
        ctx.save_for_backward(*(inputs[i] for i in tensor_idx))
        with torch.no_grad():
            out = run(*inputs)
        ctx.single = torch.is_tensor(out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, saved):
            x = torch.Tensor.detach(t)
            torch.Tensor.requires_grad_(x, t.requires_grad)
            inputs[i] = x
        devices = [torch.cuda.current_device()] if ctx.dev_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.dev_rng is not None:
                torch.cuda.set_rng_state(ctx.dev_rng)
            with torch.enable_grad():
                out = ctx.run(*inputs)
        outs = (out,) if ctx.single else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs)
        return (None, None) + input_grads


def recompute_run(run, *inputs):
    """``run(*inputs)`` without keeping its activations; re-run in the backward."""
    anchor = torch.empty(0, requires_grad=True)
    return _RecomputeRun.apply(run, anchor, *inputs)
