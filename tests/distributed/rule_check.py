"""What the tests of a staleness correction against its single-process rule share
(tests/adapter/staleness/test_error_feedback.py, tests/adapter/staleness/test_delay_compensation.py): each precision's
tolerance, the reference's precision for an engine, and the assertions of one engine against its rule."""

import torch

import reference
import reference_fp16

BF16_TOLERANCE = 2**-8  # test_precision.py: the order of a few fp32 sums can flip one bf16 rounding
ZERO_SCALE_GROWS = 2**-20  # test_fp16_async.py: fp16 + ZeRO-1's gradient made at half its step's scale


def max_diff(a, b):
    """The largest elementwise distance between two {layer: {name: tensor}} states."""
    return max((a[i][k].float() - b[i][k].float()).abs().max().item() for i in b for k in b[i])


def tolerance(kind: str) -> float:
    """How far an engine of ``kind`` ('fp32', 'bf16', 'bf16+zero1', 'fp16', 'fp16+fused', 'fp16+zero1')
    may lie from its reference."""
    return BF16_TOLERANCE if kind.startswith("bf16") else ZERO_SCALE_GROWS if "zero1" in kind else 0.0


def reference_precision(kind: str, name: str, micro_batches: int, overflows=()):
    """The reference's precision for the engine ``name`` of ``kind`` (None: fp32): fp16's loss scale
    from 2**12 with the worker's ``+p12``, else 2**20, window 2; ``overflows``: {(call, stage)} injected."""
    if kind == "fp32":
        return None
    if kind.startswith("bf16"):
        return reference.Precision(bf16=True, accumulate=torch.float32 if "zero1" in kind else torch.bfloat16)
    cls = (
        reference_fp16.Fp16AsyncZero
        if "zero1" in kind
        else reference_fp16.Fp16AsyncFused
        if "fused" in kind
        else reference_fp16.Fp16Async
    )
    return cls(reference_fp16.LossScale(12 if "+p12" in name else 20, 2), 2, micro_batches, overflow_at=overflows)


def assert_matches_rule(what: str, name: str, kind: str, ours, ref, without) -> None:
    """The engine ``name`` (its state ``ours``) lies within its kind's tolerance of its rule ``ref``,
    and the rule without the correction ``what`` (``without``) lies visibly further."""
    tol = tolerance(kind)
    diff, off = max_diff(ours, ref), max_diff(without, ref)
    print(f"{name}: |ours - reference| = {diff:.3g}; the rule without {what} is {off:.3g} away")
    assert diff <= tol, f"{name}: differs from its reference by {diff}"
    assert off > 2 * max(tol, 2**-10), f"{what} changed nothing the test can see"


def assert_replicas_equal(replicas, name: str) -> None:
    """Every data-parallel replica holds the first one's parameters."""
    for i in replicas[0]:
        for k, v in replicas[0][i].items():
            assert torch.equal(replicas[1][i][k], v), (name, i, k)
