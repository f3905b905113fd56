"""Train the VGG-style example on scikit-learn's digits with any hippie-ds schedule under the
`deepspeed` launcher.

    deepspeed --num_gpus 4 tools/examples/train_vgg.py --deepspeed_config configs/hippie.json --stages 2

Switching schedules is a change of the config's "pipeline.schedule" (or --schedule here). Rank 0
prints a progress bar with loss and throughput and, at the end, the test split's loss and
accuracy (and every --eval-every steps on the way); every rank writes its executed instruction
timeline and rank 0 draws the last steps of all ranks (PNG + Chrome trace) under --out, and
writes --out/metrics.json (per-step training loss, test loss/accuracy, samples/s).

    deepspeed --num_gpus 4 tools/examples/train_vgg.py --deepspeed_config configs/1f1b.json --data-parallel-only

trains the same network with plain DeepSpeed data parallelism on all ranks (the baseline), with the
same global batch, initial weights and data order. --plan FILE partitions the layers as a planner
plan file says (hippie_ds.PipelineModule).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run by path (deepspeed tools/examples/train_vgg.py): the examples import from the checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.examples import vgg
from tools.examples.harness import Trainer, add_common_args, load_config


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--width", type=int, default=32, help="channels of the first block (the second has twice)")
    p.add_argument("--hidden", type=int, default=128, help="width of the classifier's hidden layer")
    p.add_argument("--out", default="out/vgg", help="timelines, trace, picture and metrics.json go here")
    add_common_args(p, steps=200, eval_every=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = load_config(args)
    out = Path(args.out)
    data = vgg.Digits()
    trainer = Trainer(args, config, lambda: vgg.layer_specs(args.width, args.hidden), vgg.loss_fn, "vgg", out)
    trainer.metrics.update(
        model={"width": args.width, "hidden": args.hidden},
        data={"train": len(data.train[1]), "test": len(data.test[1])},
    )
    rank = trainer.rank
    batch = trainer.global_batch
    test_batches = data.num_test_batches(batch)
    if test_batches == 0:
        raise SystemExit(f"the global batch ({batch}) is larger than the test split ({len(data.test[1])})")
    train = trainer.share(data.global_batches(batch, args.seed))
    metrics = {"loss": vgg.loss_fn, "accuracy": vgg.accuracy}

    def test():
        return data.test_batches(batch)

    if rank == 0:
        print(
            f"{trainer.describe()}; digits: {len(data.train[1])} training images, {test_batches * batch} test images",
            flush=True,
        )
    final, picture = trainer.run(train, lambda: trainer.evaluate(test, test_batches, metrics))
    if rank == 0:
        print(
            f"test loss {final['loss']:.4f}, accuracy {100 * final['accuracy']:.2f}% "
            f"({test_batches * batch} images); "
            + (f"timeline picture: {picture}; " if picture else "")
            + f"metrics: {out / 'metrics.json'}"
        )


if __name__ == "__main__":
    main()
    import hippie_ds

    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
