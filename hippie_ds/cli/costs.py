"""``hippie-ds costs``: a cost file (``hippie.costs``) from a run's timelines or from a layer profile."""

from __future__ import annotations

import json
from pathlib import Path

from ..data_files import write_data_file
from .base import UsageError, _COMM_COST_OPTIONS, _Formatter, _comm_options, _non_negative_int, _positive_int

COSTS_CMD_HELP = """\
Write a cost file, the "hippie.costs" that 'auto' schedule parameters (deferred_stages,
deferred_layers) and `hippie-ds schedule simulate --costs` read, from measurements:

  --timeline DIR   the rank*.json files a run wrote with "hippie": {"timeline_dir": DIR}: per
                   stage the median time of each instruction over the recorded train_batch
                   calls after the first --skip-steps (forward, backward, its weight part for a
                   split backward, the update, issuing sends and all-reduces) and the stage's
                   parameter bytes;
  --profile FILE   a layer profile ("hippie": {"profile": ...} in a running job, or `hippie-ds
                   profile`), cut at --boundaries (or DeepSpeed's uniform partition into
                   --stages): per stage the sums of its layers, the loss on the last stage.

The network (all-reduce bandwidth, replicas, p2p) comes from the options below: a timeline
measures compute, not the link a later job will have.

examples:
  hippie-ds costs --timeline out/timeline --allreduce-bandwidth 125MB/s --data-parallel 2 --out costs.yaml
  hippie-ds costs --profile profile.yaml --boundaries 0,10,12 --data-parallel 2 --out costs.yaml"""


def costs_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "costs",
        help="write a cost file from a run's timelines or a layer profile",
        description=COSTS_CMD_HELP,
        formatter_class=_Formatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--timeline", metavar="DIR", help="folder of rank*.json timelines (hippie.timeline_dir)")
    src.add_argument("--profile", metavar="FILE", help="layer profile (YAML/JSON)")
    p.add_argument(
        "--skip-steps",
        type=_non_negative_int,
        default=1,
        metavar="N",
        help="--timeline: recorded train_batch calls per rank left out first (warm-up; default 1)",
    )
    p.add_argument(
        "--boundaries",
        metavar="B0,B1,...",
        help="--profile: stage boundaries, DeepSpeed parts (0,10,12) or stage starts (0,10)",
    )
    p.add_argument(
        "--stages",
        "-K",
        type=_positive_int,
        metavar="K",
        help="--profile without --boundaries: DeepSpeed's uniform partition into K stages",
    )
    for option, _, _, text in _COMM_COST_OPTIONS:
        p.add_argument(option, metavar="V", help=text)
    p.add_argument(
        "--data-parallel",
        "-r",
        type=_positive_int,
        metavar="R",
        help="data-parallel replicas of every stage (default 1)",
    )
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="cost file to write (.json, or .yaml/.yml)")
    p.set_defaults(func=_cmd_costs)


def _cmd_costs(args) -> int:
    from ..schedules import measured_costs as mc

    comm = _comm_options(args)
    if args.timeline:
        if args.boundaries or args.stages:
            raise UsageError("--boundaries/--stages go with --profile; a timeline knows its stages")
        files = sorted(Path(args.timeline).glob("rank*.json"))
        if not files:
            raise UsageError(
                f"--timeline {args.timeline!r}: no rank*.json files (the folder hippie.timeline_dir "
                "names, after the run)"
            )
        costs = mc.costs_from_timelines([json.loads(f.read_text()) for f in files], comm, args.skip_steps)
        source = f"{len(files)} timeline(s) in {args.timeline}"
    else:
        from ..planner import load_profile

        if not Path(args.profile).is_file():
            raise UsageError(f"--profile {args.profile!r}: no such file")
        profile = load_profile(args.profile)
        if args.boundaries:
            try:
                bounds = [int(v) for v in args.boundaries.split(",")]
            except ValueError:
                raise UsageError(f"--boundaries {args.boundaries!r}: expected integers, e.g. 0,10,12") from None
        elif args.stages:
            bounds = mc.uniform_boundaries(profile.num_layers, args.stages)
        else:
            raise UsageError("--profile needs --boundaries or --stages")
        costs = mc.costs_from_profile(profile, bounds, comm)
        source = f"{args.profile} cut at {bounds}"
    out = write_data_file(args.out, costs.model_dump(mode="json", exclude_none=True), default="json")
    per_stage = ", ".join(f"{1e3 * s.forward:.2f}/{1e3 * s.backward:.2f} ms" for s in costs.stages)
    print(f"wrote {out}: {len(costs.stages)} stage(s) from {source}; forward/backward per micro-batch {per_stage}")
    return 0
