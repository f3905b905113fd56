"""Train the small GPT-style example with any hippie-ds schedule under the `deepspeed` launcher.

    deepspeed --num_gpus 4 tools/examples/train_gpt.py --deepspeed_config configs/hippie.json --stages 2

Switching schedules is a change of the config's "pipeline.schedule" (or --schedule here). Rank 0
prints a progress bar with loss and throughput; at the end every rank writes its executed
instruction timeline and rank 0 draws the last steps of all ranks (PNG + Chrome trace) under --out,
and writes --out/metrics.json (per-step training loss, held-out losses, samples/s).

    deepspeed --num_gpus 4 tools/examples/train_gpt.py --deepspeed_config configs/1f1b.json --data-parallel-only

trains the same model with plain DeepSpeed data parallelism on all ranks (the baseline), with the
same global batch, initial weights and data order. --plan FILE partitions the layers as a planner
plan file says (hippie_ds.PipelineModule).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run by path (deepspeed tools/examples/train_gpt.py): the examples import from the checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.examples import gpt
from tools.examples.harness import (
    Trainer,
    add_common_args,
    draw_timeline,
    load_config,
    progress_bar,  # noqa: F401
    step_done,
)

__all__ = ["main", "parse_args", "progress_bar", "step_done", "draw_timeline"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out global batches per evaluation")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="the model's vocabulary (embedding rows, output-head width), at least the corpus's "
        "characters (about 100; the rest are never drawn); e.g. 32000 for a Megatron-sized head, "
        "where default partitions go wrong (default: the corpus's)",
    )
    p.add_argument("--out", default="out/demo", help="timelines, trace, picture and metrics.json go here")
    add_common_args(p, steps=40)
    return p.parse_args(argv)


def lm_loss(outputs, targets):  # the metric named "loss" in the metrics file
    return gpt.lm_loss(outputs, targets)


def main(argv=None):
    args = parse_args(argv)
    config = load_config(args)
    out = Path(args.out)
    data = gpt.CharData(args.seq_len)
    vocab = len(data.vocab) if args.vocab is None else args.vocab
    if vocab < len(data.vocab):
        raise SystemExit(f"--vocab {args.vocab}: allowed >= {len(data.vocab)}, the corpus's characters")
    trainer = Trainer(
        args,
        config,
        lambda: gpt.layer_specs(vocab, dim=args.dim, layers=args.layers, seq_len=args.seq_len),
        gpt.lm_loss,
        "gpt",
        out,
    )
    trainer.metrics.update(model={"dim": args.dim, "layers": args.layers, "seq_len": args.seq_len, "vocab": vocab})
    rank = trainer.rank
    train = trainer.share(data.global_batches("train", trainer.global_batch, args.seed))

    def heldout():  # the same held-out windows at every evaluation and in every layout
        return data.global_batches("heldout", trainer.global_batch, 10_000 + args.seed)

    if rank == 0:
        print(trainer.describe(), flush=True)
    final, picture = trainer.run(train, lambda: trainer.evaluate(heldout, args.eval_batches, {"loss": lm_loss}))
    if rank == 0:
        print(
            f"held-out loss {final['loss']:.4f} (perplexity {gpt.perplexity(final['loss']):.2f}); "
            + (f"timeline picture: {picture}; " if picture else "")
            + f"metrics: {out / 'metrics.json'}"
        )


if __name__ == "__main__":
    main()
    import hippie_ds

    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
