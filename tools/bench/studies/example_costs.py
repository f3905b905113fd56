"""A cost file ("hippie.costs") for a training example on the emulated two-node cluster, from a
profile of its layers: what `hippie.deferred_layers: "auto"` (and `deferred_stages: auto`) choose
from when python -m tools.bench convergence runs the example (`--costs EXAMPLE=FILE`).

    python -m tools.bench example-costs --example vgg --rate 1gbit --out out/costs/vgg-1gbit.json
    python -m tools.bench example-costs --example gpt --rate 250mbit --out out/costs/gpt-250mbit.json

It profiles the example's default model layer by layer (``hippie_ds.profiler``, one micro-batch
of its data, one thread, as a rank runs), splits the layers into --stages as the example's
pipeline does (DeepSpeed's uniform partition), and writes per stage the summed forward, backward
and parameter bytes with the per-layer breakdown (``StageCost.layers``), and the link: an
all-reduce over --replicas across the shaped rate x --link-efficiency. --compute-scale multiplies
the times: on the emulated cluster two ranks share a node's one core, so a stage computes up to
twice as slowly as the profile, which measures a rank alone. Prints what "auto" chooses per
deferred stage of `hippie` at that cost (the rule the engine runs, schedules.deferral.auto_layers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.bench.cluster import parse_rate

EXAMPLES = ("gpt", "vgg")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench example-costs",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--example", choices=EXAMPLES, required=True)
    p.add_argument("--rate", default="1gbit", help="shaped link rate between the nodes (tc syntax: 1gbit, 250mbit)")
    p.add_argument(
        "--link-efficiency",
        type=float,
        default=0.97,
        help="all-reduce bandwidth / shaped rate (python -m tools.bench allreduce measured 0.96-0.97)",
    )
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2, help="data-parallel replicas, one per node")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch (the shipped configs' 4)")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches per step and replica, for the printed choice (configs/hippie.json's "
        "32 samples / (4 per micro-batch x 2 replicas) = 4)",
    )
    p.add_argument("--compute-scale", type=float, default=1.0, help="multiply the profiled times by this")
    p.add_argument("--repeats", type=int, default=10, help="timed repetitions per layer")
    p.add_argument("--out", required=True, help="the cost file to write (JSON)")
    return p.parse_args(argv)


def example_costs(example: str, rate_bytes: float, a) -> dict:
    """The cost file's contents (a ``Costs`` as a dict) for ``example`` at ``rate_bytes``/s."""
    import torch

    from hippie_ds.adapter.ds.module import partition_uniform
    from hippie_ds.profiler import profile_layers
    from hippie_ds.schedules.costs import CommCost, Costs
    from tools.examples import gpt, vgg

    target = (gpt if example == "gpt" else vgg).profile_target(micro_batch=a.micro_batch)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    profile = profile_layers(
        target["layers"], target["sample"], model=target["name"], repeats=a.repeats, warmup=3, progress=sys.stderr
    )
    k = a.compute_scale
    layers = [
        {
            "forward": k * x.forward,
            "backward": k * x.backward,
            "param_bytes": x.param_bytes,
            "output_bytes": x.output_bytes,
        }
        for x in profile.layers
    ]
    parts = partition_uniform(num_items=len(layers), num_parts=a.stages)
    comm = CommCost(allreduce_bandwidth=rate_bytes * a.link_efficiency, data_parallel=a.replicas, shared_link=True)
    return Costs.from_layers(layers, parts, comm).model_dump(mode="json")


def auto_choice(costs: dict, stages: int, micro_batches: int) -> list[str]:
    """What hippie's "auto" keys choose under ``costs``: one line per deferred stage."""
    from hippie_ds.schedules.costs import Costs
    from hippie_ds.schedules.resolve import Shape, resolve

    resolved = resolve(
        "hippie", Shape(stages, micro_batches), {"deferred_stages": "auto"}, "auto", Costs.from_dict(costs)
    )
    return [f"deferred_stages {sorted(resolved.choices)}"] + [ch.describe() for ch in resolved.choices.values()]


def main(argv=None) -> int:
    a = parse_args(argv)
    costs = example_costs(a.example, parse_rate(a.rate), a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(costs, indent=1))
    print(f"{a.example} at {a.rate}: {out}")
    for line in auto_choice(costs, a.stages, a.micro_batches):
        print(f"  auto: {line}")
    return 0
