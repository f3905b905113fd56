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
    return [None if p.grad is None else p.grad.clone() for p in params], input_grads


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
    from hippie_ds.adapter.memory import ActivationMeter
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
    x = _inputs(False, 0)
    check_coverage(model(x), x, list(model.parameters()), [n for n, _ in model.named_parameters()])
    full, _ = _run(False, split=False, stage=HeadStage)
    split, _ = _run(False, split=True, stage=HeadStage)
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
from hippie_ds.adapter.failure import end_job_on_failure
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
    """hippie_ds.adapter.failure on two gloo processes: rank 0 fails in a handler with an
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
    procs = [subprocess.Popen([sys.executable, "-c", _FAILING_RANK, mode], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
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
    rc, log, _ = launch(4, tmp_path, "--stages", 4, "--micro-batches", 2, "--steps", 3, "--megatron",
                        "--optimizer", "AdamW", "--lr", 0.01, "--clip", 0.5, "--engines", ",".join(engines),
                        timeout=420)
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
    timeout (tests/test_engine_distributed.py's test_failed_rank_ends_the_job crashes outside a
    handler, in a script that lets the exception out, so the launcher saw the rank exit). Now the
    failing rank aborts its process groups: the job ends in seconds, the log names the rank and
    the instruction."""
    from launch import launch
    rc, log, secs = launch(4, tmp_path, "--stages", 2, "--steps", 50, "--engines", "zb-h1", "--crash-rank", 1,
                           "--crash-in-handler", timeout=150)
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
    from hippie_ds.adapter.split_backward import as_accumulated, obeys_layout
    leaf = torch.zeros(3, 5, 8).transpose(0, 1)
    grad = torch.randn(5, 3, 8)  # contiguous: not the leaf's strides
    laid = as_accumulated(grad, leaf)
    assert laid.stride() == leaf.stride() and torch.equal(laid, grad) and obeys_layout(laid, leaf)
    assert as_accumulated(laid, leaf) is laid  # already obeying: kept, no copy
    strided = torch.zeros(5, 16)[:, ::2]
    assert as_accumulated(grad[0].t().t(), strided).is_contiguous()
    assert as_accumulated(torch.randn(8, 5).t(), strided).is_contiguous()
