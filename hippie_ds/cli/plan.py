"""``hippie-ds plan``: pipeline depth, partition, re-computation and schedule for a profile."""

from __future__ import annotations

import json
import math
import sys
from functools import partial

from ..planner.objectives import OBJECTIVES
from ..planner.plan_file import SCHEDULES
from .base import (
    UsageError,
    _Formatter,
    _add_profile_options,
    _int_list,
    _non_negative_int,
    _positive_int,
    _quantity,
    _read_profile,
)

# ---------------------------------------------------------------------------------------------
# hippie-ds plan / profile-import

PLAN_HELP = """\
Plan a data-parallel pipeline for a model profile on a cluster: pipeline depth and data-parallel
width, micro-batch size and count, stage boundaries, which layers to re-compute, the schedule
and Hippie's deferred stages. The default objective is memory efficiency, ME = scalability x
throughput / memory (Hippie's); --objective throughput maximizes throughput under the device
memory or --memory-cap. Both rank by the raw step, with deferred stages delaying no more than one
layer with parameters each (what the convergence studies measured free); --objective time-to-loss
ranks by throughput / the steps factor of staleness (the measured price, --staleness-price) and
may delay deeper. Every row of the summary shows the figure the objective ranks.

The job as it is (its stages and micro-batch size, with DeepSpeed's 'parameters' and 'uniform'
partitions, under its schedule and every schedule considered, with the default and the searched
deferral) is a candidate: the plan is never predicted worse than it, and where it wins the plan is
the job's own configuration and the summary says so. It comes from --job, else the profile's job
shape, else one --stages and one --micro-batch-size. Prints a summary with the job's rows and the
baselines (data parallelism as DeepSpeed's engine runs it, GPipe+DP, and the uniform, DeepSpeed
'parameters' and PipeDream partitions under the plan's schedule) and writes the plan file with
--out. Pure Python: no torch, DeepSpeed or GPU needed.

The cluster is NODESxDEVICES,MEMORY,INTER[,INTRA] (INTRA defaults to 100GB/s), e.g.
4x4,16GB,100Gbit, or a YAML/JSON file with nodes, devices_per_node, device_memory,
inter_node_bandwidth, intra_node_bandwidth, latency.

A profile measured in place (hippie.profile) records the job's shape: pipeline stages, data-parallel
replicas, micro-batch size, global batch. On a cluster of the job's device count the plan keeps that
shape (only the cuts, re-computation and schedule are searched) unless --stages (a list, or 'all'),
--micro-batch-size or --global-batch say otherwise, and says so; a plan of another shape prints the
changes the job needs (the model's pipeline size, the launcher's rank count, the batch keys).

Beside the plan it prints its runner-ups (other cuts of its configuration, other configurations)
with their predicted steps, and which of them are within the profile's spread of the plan: the
profile cannot tell those apart (python -m tools.bench cut-sweep measures them). A profile whose
identical layers disagree by more than 25% is named noisy (on stderr).

examples:
  hippie-ds plan --profile vgg16.txt --cluster 4x4,16GB,100Gbit --global-batch 2048 --out plan.json
  hippie-ds plan --profile model.yaml --cluster cluster.yaml --global-batch 512 --objective throughput \\
      --memory-cap 12GB --schedules 1f1b,hippie"""


def plan_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan pipeline depth, partition, re-computation and schedule",
        description=PLAN_HELP,
        formatter_class=_Formatter,
    )
    _add_profile_options(p)
    p.add_argument(
        "--cluster",
        required=True,
        metavar="SPEC|FILE",
        help="cluster, e.g. 4x4,16GB,100Gbit (nodes x devices, device memory, inter-node bandwidth"
        "[, intra-node bandwidth]) or a YAML/JSON file",
    )
    p.add_argument(
        "--global-batch",
        "-G",
        type=_positive_int,
        metavar="N",
        help="samples per training step over all replicas (default: the profiled job's train_batch_size; "
        "required for a profile without a job shape)",
    )
    p.add_argument(
        "--objective",
        choices=sorted(OBJECTIVES),
        default="me",
        help="maximize memory efficiency (default), throughput, or time-to-loss (throughput / the "
        "steps factor of staleness)",
    )
    p.add_argument(
        "--job",
        metavar="K,B[,SCHEDULE]",
        help="the job as it is: K stages, micro-batch size B, its schedule (default: the profile's job "
        "shape; else one --stages and one --micro-batch-size); a candidate of the plan",
    )
    p.add_argument("--memory-cap", metavar="BYTES", help="memory a device may use, e.g. 12GB (default: all of it)")
    p.add_argument(
        "--memory-metric",
        choices=["mean", "max"],
        default="mean",
        help="memory in ME: the mean per-device peak (default; = total / devices) or the largest",
    )
    p.add_argument(
        "--schedules",
        metavar="LIST",
        default=",".join(SCHEDULES),
        help="schedules to consider, comma-separated: built-in names or schedule files "
        "(default: the flush schedules, %(default)s; ones with virtual stages, e.g. "
        "interleaved-1f1b, zb-v, plan stages x chunks model parts)",
    )
    p.add_argument(
        "--stages",
        metavar="K[,K...]|all",
        help="only these pipeline depths (each must divide the devices); 'all': every depth. Default: the "
        "profiled job's stage count (and micro-batch size) on a cluster of its device count, else all",
    )
    p.add_argument("--micro-batch-size", metavar="B[,B...]", help="only these micro-batch sizes")
    p.add_argument(
        "--min-micro-batch",
        type=_positive_int,
        metavar="B",
        help="smallest micro-batch size to consider (default: profile batch / 16, at least 1: the "
        "linear time scaling is not trusted further down)",
    )
    p.add_argument(
        "--state-factor",
        type=float,
        default=None,
        metavar="F",
        help="training-state bytes per profiled parameter byte; given, it wins. Default: from the "
        "profile's precision (param_dtype): 4 for fp32 (fp32 weights, gradients and two Adam moments, "
        "16 bytes a parameter) and for a profile that does not say; 4.5 for bf16/fp16 over fp32-sized "
        "param_bytes (DeepSpeed's BF16_Optimizer: bf16 weights, fp32 master weights, fp32 gradient "
        "accumulator, two fp32 Adam moments, 18 bytes a parameter), 9 over 2-byte param_bytes",
    )
    p.add_argument(
        "--simulate-top",
        type=_non_negative_int,
        default=4,
        metavar="N",
        help="simulate the N best analytic candidates (default 4; 0: analytic only)",
    )
    p.add_argument("--no-baselines", action="store_true", help="do not evaluate the baselines")
    p.add_argument(
        "--staleness-price",
        type=float,
        default=None,
        metavar="P",
        help="price of a stale gradient (hippie.staleness_price: extra steps, as a share, when the "
        "whole gradient is one step stale; default 0.5, measured on the GPT example, "
        "docs/results/deferred_layers_auto.md): time-to-loss chooses deferred layers and ranks by "
        "it; every plan records the steps factor it gives",
    )
    p.add_argument("--out", "-o", metavar="FILE", help="write the plan (.json, or .yaml/.yml)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the summary")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    from ..planner import make_plan, parse_cluster, save_plan
    from ..planner.job_shape import changes_from_job, format_changes, job_as_it_is, keep_shape
    from ..planner.plan import _check_schedules
    from ..planner.profile import PlannerError

    profile = _read_profile(args)
    cluster = parse_cluster(args.cluster)
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    try:
        _check_schedules(schedules)
    except PlannerError as exc:
        raise UsageError(f"--schedules {args.schedules!r}: {exc}") from None
    if args.state_factor is not None and (args.state_factor <= 0 or not math.isfinite(args.state_factor)):
        raise UsageError(f"--state-factor {args.state_factor}: must be a positive number")
    cap = _quantity(args.memory_cap, "bytes", "--memory-cap") if args.memory_cap else None
    if cap is not None and cap <= 0:
        raise UsageError(f"--memory-cap {args.memory_cap!r}: must be positive")
    search_all = (args.stages or "").strip().lower() == "all"
    try:
        depths = _int_list(args.stages, "--stages") if args.stages and not search_all else None
    except UsageError as exc:
        raise UsageError(f"{exc}, or 'all'") from None
    if depths:
        bad = [k for k in depths if cluster.devices % k]
        if bad:
            raise UsageError(f"--stages {args.stages}: {bad} do(es) not divide the {cluster.devices} devices")
    sizes = _int_list(args.micro_batch_size, "--micro-batch-size") if args.micro_batch_size else None
    if args.staleness_price is not None and not (args.staleness_price >= 0 and math.isfinite(args.staleness_price)):
        raise UsageError(f"--staleness-price {args.staleness_price}: must be a number >= 0")
    try:
        kept = keep_shape(
            profile.job,
            cluster.devices,
            depths=depths,
            search_all=search_all,
            micro_batch_sizes=sizes,
            global_batch=args.global_batch,
        )
        job, job_note = job_as_it_is(
            profile.job,
            cluster.devices,
            kept.global_batch,
            given=args.job,
            depths=kept.depths,
            micro_batch_sizes=kept.micro_batch_sizes,
            schedules=schedules,
        )
    except PlannerError as exc:
        raise UsageError(str(exc)) from None
    say = partial(print, file=sys.stderr if args.json else sys.stdout)
    from ..planner.noise import noise_warning

    warning = noise_warning(profile)
    if warning:
        print(warning, file=sys.stderr)
    if kept.message:
        say(kept.message)
    plan = make_plan(
        profile,
        cluster,
        kept.global_batch,
        objective=args.objective,
        memory_cap=cap,
        schedules=schedules,
        depths=kept.depths,
        micro_batch_sizes=kept.micro_batch_sizes,
        min_micro_batch=args.min_micro_batch,
        state_factor=args.state_factor,
        memory_metric=args.memory_metric,
        simulate_top=args.simulate_top,
        baselines=not args.no_baselines,
        staleness_price=args.staleness_price,
        job=job,
        job_note=job_note,
    )
    if args.out:
        save_plan(plan, args.out)
    if args.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=1))
    else:
        print(plan.summary())
    changes = changes_from_job(profile.job, plan) if profile.job is not None else []
    if changes:
        say(
            format_changes(
                changes, f"the plan's shape is not the profiled job's ({profile.job.describe()}); to run it, change:"
            )
        )
    if args.out and not args.json:
        print(f"wrote {args.out}")
    return 0
