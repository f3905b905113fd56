"""What a client reads from the engine after each ``train_batch``, on real ranks (gloo): the gradient
norm (``get_global_grad_norm()``, Megatron's "grad norm" column)."""

import math

import pytest
import torch
from launch import launch

MICRO_BATCHES = 4


@pytest.mark.distributed
def test_a_tied_2bw_reports_its_gradient_norm_before_clipping(tmp_path):
    """Megatron logs ``engine.get_global_grad_norm()`` as its "grad norm". 2bw clips a lagged tie sum
    and the stage's other gradients apart before its optimizer steps (adapter/gradients/tied.py), so the
    optimizer measures clipped gradients: the engine reports the stage's norm before clipping instead,
    as DeepSpeed reports the norm its optimizer clipped by (found on Megatron-DeepSpeed: 2bw logged
    1.000, the clip, where stock logged 4.7 to 2.0). bf16 (BF16_Optimizer) and bf16 + ZeRO-1."""
    clip = 1e-3  # far below every gradient norm here: each update clips
    engines = ["stock+tied+bf16+zero1", "2bw+tied+bf16", "2bw+tied+bf16+zero1"]
    rc, log, _ = launch(
        2,
        tmp_path,
        "--stages",
        2,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        4,
        "--optimizer",
        "AdamW",
        "--lr",
        0.01,
        "--clip",
        clip,
        "--engines",
        ",".join(engines),
        timeout=300,
    )
    assert rc == 0, log[-4000:]
    norms = {
        name: [torch.load(f)["grad_norms"] for f in sorted((tmp_path / name).glob("rank*.pt"))] for name in engines
    }
    for name, ranks in norms.items():
        reported = [n for rank in ranks for n in rank if n is not None]
        assert len(reported) >= 2 * len(ranks), (name, ranks)
        assert all(math.isfinite(n) and n > 10 * clip for n in reported), (name, ranks)
    stock = [n for n in norms["stock+tied+bf16+zero1"][0] if n is not None]
    for name in engines[1:]:  # each stage's norm is a part of the pipeline's: the same order as stock's
        assert all(n < 2 * max(stock) for rank in norms[name] for n in rank if n is not None), (name, norms)
