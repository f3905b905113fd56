"""pipedream in fp16 under a torch Adam with L2 weight decay, real ranks on gloo: the
Megatron-style GPT of tests/adapter/precision/test_fp16_gpt.py (2 stages x 2 replicas, the word embedding tied across
the stages, Megatron's two parameter groups and its warm-up/cosine LR scheduler, clipping 1.0, the
loss scale from 2**12) with ``torch.optim.Adam``, weight decay 0.01 added to the gradient: the
optimizer Megatron-DeepSpeed passes on CPU (no apex), which DeepSpeed wraps in FP16_UnfusedOptimizer.

Why it rose: DeepSpeed 0.19's backward does not scale the loss for that wrapper, whose step still
divides the gradient by the scale. pipedream's micro-batch update applies grad(loss / M), so it
applied grad(loss / M) / 2**12 + 0.01 W, M times a batch: the weight decay term was about 230 times
the gradient on Megatron-DeepSpeed's GPT, the weights shrank and the loss rose towards ln V (5.50 at
iteration 20, fp32 3.46). Its micro-batch updates now unscale by 1 (fp16_async.py): the fp32 rule's
gradient in fp16.
"""

from pathlib import Path

import pytest
import torch

from launch import launch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parents[2] / "distributed" / "gpt_fp16_worker.py"
STEPS, MICRO_BATCHES, LR = 12, 4, 2e-2
ENGINES = ["pipedream+adam", "pipedream+fp16+adam", "stock+fp16+adam"]


def _losses(out, name):
    ranks = [torch.load(f) for f in sorted(Path(out, name).glob("rank*.pt"))]
    return next(r["losses"] for r in ranks if r["losses"]), ranks


def test_pipedream_fp16_under_torch_adam_falls_as_fp32_does(tmp_path):
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        2,
        "--steps",
        STEPS,
        "--micro-batches",
        MICRO_BATCHES,
        "--lr",
        LR,
        "--window",
        1000,
        "--engines",
        ",".join(ENGINES),
        worker=WORKER,
        timeout=300,
    )
    assert rc == 0, log[-5000:]
    pipe32, _ = _losses(tmp_path, "pipedream+adam")
    pipe16, ranks = _losses(tmp_path, "pipedream+fp16+adam")
    stock16, _ = _losses(tmp_path, "stock+fp16+adam")
    print(
        {
            "pipedream fp32": [round(x, 3) for x in pipe32],
            "pipedream fp16": [round(x, 3) for x in pipe16],
            "stock fp16": [round(x, 3) for x in stock16],
        }
    )
    assert pipe32[-1] < pipe32[0] - 0.5  # the premise: fp32 learns
    assert pipe16[-1] < pipe16[0] - 0.5, "pipedream fp16 does not fall"
    assert abs(pipe16[-1] - pipe32[-1]) < 0.1 * (pipe32[0] - pipe32[-1]), "pipedream fp16 does not follow fp32"
    copies = [w for r in ranks for w in r["tied"].values()]
    assert copies and all(torch.equal(c, copies[0]) for c in copies)
