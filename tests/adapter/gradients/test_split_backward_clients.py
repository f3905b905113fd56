"""The split backward (hippie_ds.adapter.gradients.split_backward) on what real clients' models do
(Megatron-DeepSpeed's GPTModelPipe): views as stage outputs, one gradient buffer reused for every
micro-batch, parameters unused on a stage or reaching the output around the input's path, fewer
micro-batches than stages; and what a rank failing in a handler must do (end with its peers, not
hang). Three tests are ``distributed`` (they launch real ranks): a rank failing in a handler on
two gloo processes, the Megatron-shaped model bit-identical to stock DeepSpeed, and a zb-h1 job
with a failing rank ending in seconds; the rest run in one process."""

import pytest
import torch

from hippie_ds.adapter.gradients.split_backward import (
    SplitBackwardError,
    backward_input,
    backward_weight,
    check_coverage,
)

from split_backward_models import Block, make_inputs, run_backwards


# ---------------------------------------------------------------------------------------------
# What real clients' models do (Megatron-DeepSpeed's GPTModelPipe): views as stage outputs,
# parameters unused on a stage, fewer micro-batches than stages; and what a failure must do.


class Linear3d(torch.nn.Module):
    """nn.Linear on a 3-D input: its output is a view (of the 2-D matmul)."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(torch.tanh(self.ln(x)))


class ViewOut(Linear3d):
    """A layer that returns ``x.view(...)``."""

    def forward(self, x):
        return super().forward(x).view(x.shape[0], -1)


class Linear2d(Linear3d):
    def forward(self, x):
        return super().forward(x.view(-1, 8))


@pytest.mark.parametrize("stage", [Linear3d, ViewOut, Linear2d], ids=["linear-on-3d", "x.view", "linear-on-2d"])
def test_view_outputs_and_a_reused_gradient_buffer_split_exactly(stage):
    """A stage output that is a view (torch's split detaches outputs in place: "Can't detach
    views in-place"), with every micro-batch's output gradient received into the same tensor, as
    DeepSpeed's ``grad_layer`` (through a view, the parameter op's kept gradient would alias it):
    input and parameter gradients bit-identical to the full backward, W after later I's."""

    def run(split):
        torch.manual_seed(0)
        model = stage()
        params = list(model.parameters())
        pending, input_grads, received = [], [], None
        for mb in range(3):
            x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(mb)).requires_grad_()
            out = model(x)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + mb))
            received = grad.clone() if received is None else received.copy_(grad)  # one buffer, reused
            if split:
                pending.append(backward_input(out, received, x, params))
            else:
                out.backward(received)
            input_grads.append(x.grad.clone())
        for p in pending:  # every W after the last I: the buffer holds micro-batch 2's gradient
            backward_weight(p, params)
        return [p.grad for p in params], input_grads

    (full, full_in), (split, split_in) = run(False), run(True)
    for a, b in zip(full + full_in, split + split_in):
        assert torch.equal(a, b)


def test_a_view_output_is_released_after_its_weight_pass():
    """The view output cannot be detached: once the caller drops it (the engine does after I; its
    pending sends keep a detached alias), W still frees everything the micro-batch held."""
    from hippie_ds.adapter.profiling.memory import ActivationMeter

    torch.manual_seed(0)
    model = ViewOut()
    params = list(model.parameters())
    meter = ActivationMeter(model)
    with meter:
        x = torch.randn(4, 5, 8).requires_grad_()
        out = model(x)
        alias = out.detach()  # what a pending non-blocking send keeps
        pending = backward_input(out, torch.ones_like(out), x, params)
        del out
        assert meter.current > 0
        backward_weight(pending, params)
        del pending
    assert meter.current == 0 and alias.shape == (4, 40)


class TiedEmbedding(torch.nn.Module):
    """Megatron's tied embedding on the head's stage: the word weight projects the output, the
    position table takes no part there."""

    def __init__(self):
        super().__init__()
        self.word = torch.nn.Embedding(16, 8)
        self.position = torch.nn.Embedding(5, 8)


class HeadStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block, self.embed = Block(), TiedEmbedding()

    def forward(self, x):
        return self.block(x) @ self.embed.word.weight.t()


def test_parameters_unused_on_a_stage_are_accepted_and_get_no_gradient():
    """A parameter that takes no part in the stage's output is no reason to refuse the split
    (check_coverage used to name it): it gets no gradient (None), as from autograd and stock
    DeepSpeed, and the others are bit-identical to the full backward."""
    model = HeadStage()
    x = make_inputs(False, 0)
    check_coverage(model(x), x, list(model.parameters()), [n for n, _ in model.named_parameters()])
    full, _ = run_backwards(False, split=False, stage=HeadStage)
    split, _ = run_backwards(False, split=True, stage=HeadStage)
    names = [n for n, _ in HeadStage().named_parameters()]
    assert full[names.index("embed.position.weight")] is None
    for name, a, b in zip(names, full, split):
        assert (a is None and b is None) or torch.equal(a, b), name


class BranchAroundInput(torch.nn.Module):
    """A parameter on the input's path that also reaches an output on its own (a second output
    made of it alone): I back-propagates only towards the input, W only from where the parameter
    joins that path, so the second part of its gradient would be lost."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x), self.fc.weight.sum() * torch.ones(2, 3)


def test_coverage_refuses_what_the_split_would_get_wrong():
    """What check_coverage protects against: a parameter that reaches the output on a path that
    does not meet the input's, alone (ParallelBranch) or besides the input's path (where the split
    silently computes a wrong gradient, shown here). Parameters joining the main path (a bias
    added to it, IgnoresInput) and unused ones pass."""
    torch.manual_seed(0)
    m = BranchAroundInput()
    x = torch.randn(2, 3, requires_grad=True)
    grads = [torch.ones(2, 3), torch.ones(2, 3)]
    torch.autograd.backward(m(x), grads)
    full = m.fc.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    x = torch.randn(2, 3, requires_grad=True)
    params = list(m.parameters())
    backward_weight(backward_input(m(x), grads, x, params), params)
    assert not torch.allclose(m.fc.weight.grad, full)  # what an unchecked split would train on
    with pytest.raises(SplitBackwardError, match=r"parameter\(s\) fc\.weight reach the stage's output on a path"):
        check_coverage(m(x), x, params, ["fc.weight", "fc.bias"])


_FAILING_RANK = """
import sys, torch, torch.distributed as dist
from hippie_ds.adapter.process.failure import end_job_on_failure
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.all_reduce(torch.zeros(1), async_op=True)  # in flight, never joined: teardown would wait for it
    try:
        try:
            raise RuntimeError("a handler fails")
        except RuntimeError as exc:
            end_job_on_failure(exc, 0, "stage 0's TestInstruction")
            raise
    except RuntimeError:
        if sys.argv[1] == "uncaught":
            raise
        try:
            dist.barrier()  # a script's clean-up collective: the others never join it
        except Exception:
            pass
        if sys.argv[1] == "stuck":
            import time
            time.sleep(600)  # a clean-up that never ends
else:
    dist.recv(torch.zeros(1), 0)  # waits for rank 0, as a pipeline neighbour does
"""


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["uncaught", "caught", "stuck"])
def test_a_rank_failing_in_a_handler_ends_with_its_peers(tmp_path, mode):
    """hippie_ds.adapter.process.failure on two gloo processes: rank 0 fails in a handler with an
    all-reduce of its own in flight (its interpreter's teardown would wait for it for ever), rank
    1 waits for a message from it. Both end within seconds: rank 0 with status 1 whether its
    script lets the exception out, catches it and calls a collective (then exits normally), or
    never ends its clean-up (failure.EXIT_GRACE_S); rank 1 with the closed connection its process
    group sees."""
    import os
    import subprocess
    import sys
    import time
    from launch import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FAILING_RANK, mode],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    start, outputs = time.monotonic(), []
    try:
        for r, p in enumerate(procs):
            try:
                outputs.append(p.communicate(timeout=max(1.0, 60 - (time.monotonic() - start)))[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running 60 s after rank 0 failed; output so far: {outputs}")
    finally:
        for p in procs:
            p.kill()
    assert time.monotonic() - start < 45, outputs
    assert [p.returncode for p in procs][0] == 1 and procs[1].returncode != 0, outputs
    assert "hippie-ds: rank 0 failed in stage 0's TestInstruction: RuntimeError: a handler fails" in outputs[0]


@pytest.mark.distributed
def test_megatron_shapes_run_bit_identical_to_stock(tmp_path):
    """One launch, 4 stages x 2 micro-batches (fewer micro-batches than stages) of the
    Megatron-shaped model (tests/distributed/model.py: 3-D activations, so the middle stages'
    outputs are views, one of them ``x.view(...)``; an embedding tied to the head, whose copy on
    the last stage leaves its position table unused), AdamW with clipping, in fp32, bf16 and bf16 +
    ZeRO-1: zb-h1's parameters and losses bit-identical to stock DeepSpeed's, the tied copies
    equal; hippie-zb runs the same shapes (its first loss is stock's: same weights; its tied copies
    are equal in every precision)."""
    from launch import collect, launch

    precisions = ("", "+bf16", "+bf16+zero1")
    engines = [s + p for p in precisions for s in ("stock", "zb-h1", "hippie-zb")]
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        4,
        "--micro-batches",
        2,
        "--steps",
        3,
        "--megatron",
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--clip",
        0.5,
        "--engines",
        ",".join(engines),
        timeout=420,
    )
    assert rc == 0, log[-4000:]
    for p in precisions:
        stock, stock_losses, *_ = collect(tmp_path, "stock" + p)
        ours, losses, *_ = collect(tmp_path, "zb-h1" + p)
        for i in stock:
            for k in stock[i]:
                assert torch.equal(stock[i][k], ours[i][k]), f"zb-h1{p}: layer {i} {k} differs from stock"
        assert losses == stock_losses and len(losses["rank3"]) == 3
        # hippie-zb's copies too, in every precision: stage 0 (the embedding alone) is deferred whole,
        # the last stage delays only its tied copy, so in bf16 both take their first step (zero
        # gradients: AdamW's decay, Adam's step count) or the copies drift apart (engine_gradients)
        for name in ("zb-h1" + p, "hippie-zb" + p):
            files = [torch.load(f) for f in sorted((tmp_path / name).glob("rank*.pt"))]
            words = [f["tied"]["embed"]["word.weight"] for f in files if "embed" in f["tied"]]
            assert len(words) == 2 and torch.equal(words[0], words[1]), f"{name}: the tied copies differ"
        _, hippie_losses, *_ = collect(tmp_path, "hippie-zb" + p)
        assert hippie_losses["rank3"][0] == stock_losses["rank3"][0]
        assert all(torch.isfinite(torch.tensor(hippie_losses["rank3"])))


@pytest.mark.distributed
def test_a_rank_failing_inside_a_handler_ends_the_job(tmp_path):
    """zb-h1, 2 stages x 2 replicas: rank 1's backward_input raises at step 1 (as a view output
    used to), and every rank's script catches what train_batch raises and calls a barrier (a
    clean-up collective) before re-raising. Rank 1 never reached its exit before: it waited in
    that barrier while the others waited for it in the pipeline, all until the process group's
    timeout (tests/adapter/engine/test_engine_distributed.py's test_failed_rank_ends_the_job crashes outside a
    handler, in a script that lets the exception out, so the launcher saw the rank exit). Now the
    failing rank aborts its process groups: the job ends in seconds, the log names the rank and
    the instruction."""
    from launch import launch

    rc, log, secs = launch(
        4,
        tmp_path,
        "--stages",
        2,
        "--steps",
        50,
        "--engines",
        "zb-h1",
        "--crash-rank",
        1,
        "--crash-in-handler",
        timeout=150,
    )
    assert rc != 0
    assert secs < 90, f"job took {secs:.0f}s to exit after a rank failed in a handler"
    assert "hippie-ds: rank 1 failed in stage 1's BackwardInputPass" in log, log[-3000:]


class BiasOnly(torch.nn.Module):
    """A stage whose input reaches its output through a view and an addition alone."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(40))

    def forward(self, x):
        return x.view(x.shape[0], -1) + self.bias


def test_nothing_left_by_i_shares_the_reused_gradient_buffer():
    """The input gradient (sent to the previous stage without blocking) and every gradient kept
    for W are the caller's own: receiving the next micro-batch's gradient into the same buffer
    changes neither."""
    model = BiasOnly()
    x = torch.randn(4, 5, 8).requires_grad_()
    received = torch.randn(4, 40)
    pending = backward_input(model(x), received, x, list(model.parameters()))
    sent, kept = x.grad.clone(), [t.clone() for t in pending.tensors()]
    received.fill_(7.0)  # the next receive
    assert torch.equal(x.grad, sent) and all(torch.equal(a, b) for a, b in zip(pending.tensors(), kept))
    backward_weight(pending, list(model.parameters()))
    assert torch.equal(model.bias.grad, sent.view(4, 40).sum(0))
