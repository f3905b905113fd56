"""Shared parts of the command line: option parsing, cost options, tables."""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from pathlib import Path
from typing import Any

from ..formatting import table as _table  # noqa: F401 (the command modules use it)

PROG = "hippie-ds"


def _version() -> str:
    try:
        from .. import __version__

        return __version__
    except ImportError:
        from importlib.metadata import version

        return version("hippie-ds")


class UsageError(Exception):
    """A command line that cannot be carried out; the message says which option and why."""


# ---------------------------------------------------------------------------------------------
class _Formatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description on its own; keeps indented lines (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if para.startswith("  ") or "\n  " in para:
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(
                    textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(out)


# ---------------------------------------------------------------------------------------------
# Option values


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum} (got {value})")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"


def _quantity(text: str, kind: str, option: str) -> float:
    """A non-negative number, with an optional unit: time (s, ms, us, ns), bytes (1e6, 64MB, 2GiB)
    or bytes per second (same, optionally ending in /s)."""
    text = text.strip()
    if kind == "rate" and text.lower() in ("inf", "infinity"):
        return math.inf
    if kind == "time":
        m = re.fullmatch(_NUMBER + r"\s*(s|ms|us|ns)?", text)
        value = float(m.group(1)) * _TIME_UNITS[m.group(2) or ""] if m else None
        unit_help = "seconds, or a number with s, ms, us or ns"
    else:
        tail = r"\s*([kKmMgGtT]i?)?B?" + (r"(?:/s)?" if kind == "rate" else "")
        m = re.fullmatch(_NUMBER + tail, text)
        value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()] if m else None
        unit_help = (
            "bytes" if kind == "bytes" else "bytes per second"
        ) + ", e.g. 1e6, 64MB or 2GiB (k/M/G/T powers of 1000, Ki/Mi/Gi/Ti powers of 1024)"
    if value is None or not math.isfinite(value):
        raise UsageError(f"{option} {text!r}: not a number; expected {unit_help}")
    if value < 0:
        raise UsageError(f"{option} {text!r}: must not be negative")
    return value


def _per_stage(text: str, kind: str, option: str, stages: int) -> list[float]:
    """One value for every stage, or a comma-separated list of one value per stage."""
    values = [_quantity(v, kind, option) for v in text.split(",")]
    if len(values) == 1:
        return values * stages
    if len(values) != stages:
        raise UsageError(
            f"{option} {text!r}: gave {len(values)} values for {stages} stages; give one value for "
            "all stages or one per stage"
        )
    return values


def _param_value(raw: str, kind: str | None, key: str) -> Any:
    """A --param value, converted according to the declared kind of the parameter (if declared)."""
    text = raw.strip()
    low = text.lower()
    if low == "auto":
        return "auto"
    if kind == "bool" or (kind is None and low in ("true", "false")):
        if low in ("true", "yes", "1", "on"):
            return True
        if low in ("false", "no", "0", "off"):
            return False
        raise UsageError(f"--param {key}={raw}: expected true or false")
    if kind == "stage_list" or (kind is None and "," in text):
        inner = text.strip("[]").strip()
        if low in ("none", "") or not inner:
            return []
        try:
            return [int(v) for v in inner.split(",") if v.strip()]
        except ValueError:
            raise UsageError(
                f"--param {key}={raw}: expected 'auto', 'none' or a comma-separated list of stage indices such as 0,1"
            ) from None
    try:
        return int(text)
    except ValueError:
        if kind == "int":
            raise UsageError(f"--param {key}={raw}: expected an integer") from None
        return text  # let the schedule's parameter check explain what it expected


def _parse_params(items: list[str] | None, spec) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--param {item!r}: expected key=value, e.g. --param deferred_stages=0,1")
        declared = spec.params.get(key) if spec is not None else None
        params[key] = _param_value(raw, declared.kind if declared else None, key)
    return params


# ---------------------------------------------------------------------------------------------
# Shared pieces


def _add_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", "-K", type=_positive_int, required=True, metavar="K", help="number of pipeline stages")
    p.add_argument(
        "--micro-batches", "-M", type=_positive_int, required=True, metavar="M", help="micro-batches per training step"
    )
    p.add_argument(
        "--virtual-stages",
        "-v",
        type=_positive_int,
        default=None,
        metavar="V",
        help="model chunks per stage (pipeline.virtual_stages) for schedules with virtual stages; "
        "default: the schedule's",
    )


def _add_params(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--param",
        "-p",
        action="append",
        metavar="KEY=VALUE",
        help="set a schedule parameter (repeatable): integers, true/false, 'auto', or stage lists "
        "such as deferred_stages=0,1 (deferred_stages=none for no stage)",
    )


# Without --costs, a stage costs this unless told otherwise (the other fields default to 0 and the
# network to hippie_ds.schedules.costs.CommCost's defaults).
DEFAULT_STAGE_COST = {"forward": 1.0, "backward": 2.0}

_STAGE_COST_OPTIONS = [  # option, StageCost field, kind, help
    ("--forward", "forward", "time", "forward time of one micro-batch (s; default 1)"),
    ("--backward", "backward", "time", "backward time of one micro-batch (s; default 2)"),
    ("--recompute", "recompute", "time", "re-computation (activation checkpointing) time per micro-batch (s)"),
    (
        "--backward-weight",
        "backward_weight",
        "time",
        "the weight-gradient part of --backward (W of a split backward, zb-h1; s; default half of it)",
    ),
    ("--activation-bytes", "activation_bytes", "bytes", "bytes of activations sent to the next stage per micro-batch"),
    ("--saved-bytes", "saved_bytes", "bytes", "activation bytes a stage keeps per in-flight micro-batch"),
    ("--param-bytes", "param_bytes", "bytes", "bytes of the stage's parameters (= its gradients)"),
    ("--optimizer-time", "optimizer_time", "time", "time of the stage's optimizer step (s)"),
    ("--send-issue-time", "send_issue_time", "time", "time the stage spends in one non-blocking send call (s)"),
    (
        "--allreduce-issue-time",
        "allreduce_issue_time",
        "time",
        "time the stage spends starting one asynchronous all-reduce (s)",
    ),
    (
        "--allreduce-cpu-time",
        "allreduce_cpu_time",
        "time",
        "compute time an all-reduce of the stage's whole "
        "gradient takes from it while in flight (s; a CPU core "
        "shared with the communication)",
    ),
]
_COMM_COST_OPTIONS = [  # option, CommCost field, kind, help
    (
        "--p2p-bandwidth",
        "p2p_bandwidth",
        "rate",
        "bandwidth between neighbouring stages (bytes/s; inf = free; default 10e9)",
    ),
    ("--p2p-latency", "p2p_latency", "time", "latency of one point-to-point transfer (s)"),
    (
        "--allreduce-bandwidth",
        "allreduce_bandwidth",
        "rate",
        "bandwidth of the inter-node link the data-parallel all-reduce uses (bytes/s; default 1.25e8 = 1 Gbit/s)",
    ),
    ("--allreduce-latency", "allreduce_latency", "time", "latency of one all-reduce (s)"),
]

COSTS_HELP = """\
per-stage options take one value for every stage or a comma-separated list with one value
per stage (--forward 1,1,1,2). Times are seconds (or 2ms, 300us); sizes are bytes (or 64MB,
2GiB); bandwidths bytes per second (or 125MB/s). --costs FILE reads a YAML/JSON cost file first;
options given beside it override its values."""


def _add_costs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("costs", COSTS_HELP)
    g.add_argument("--costs", metavar="FILE", help="cost file (YAML or JSON), see hippie_ds.schedules.costs")
    for option, _, kind, text in _STAGE_COST_OPTIONS:
        g.add_argument(option, metavar="V[,V...]", help=text + "; one value or one per stage")
    for option, _, kind, text in _COMM_COST_OPTIONS:
        g.add_argument(option, metavar="V", help=text)
    g.add_argument(
        "--data-parallel",
        "-r",
        type=_positive_int,
        metavar="R",
        help="data-parallel replicas of every stage (the all-reduce group size; default 1: no all-reduce)",
    )
    g.add_argument(
        "--no-shared-link",
        action="store_true",
        help="stages' all-reduces do not share one inter-node link (default: they do)",
    )


def _comm_options(args) -> dict:
    """The ``CommCost`` fields given as options (_COMM_COST_OPTIONS and --data-parallel)."""
    given = {
        field: _quantity(getattr(args, field), kind, option)
        for option, field, kind, _ in _COMM_COST_OPTIONS
        if getattr(args, field) is not None
    }
    if args.data_parallel is not None:
        given["data_parallel"] = args.data_parallel
    return given


def _build_costs(args, stages: int):
    """Costs from --costs FILE and/or the cost options."""
    from ..schedules import costs as costs_mod

    stage_given = {
        field: _per_stage(getattr(args, field), kind, option, stages)
        for option, field, kind, _ in _STAGE_COST_OPTIONS
        if getattr(args, field) is not None
    }
    comm_given = _comm_options(args)
    if args.no_shared_link:
        comm_given["shared_link"] = False

    if args.costs:
        if not Path(args.costs).is_file():
            raise UsageError(f"--costs {args.costs!r}: no such file")
        base = costs_mod.Costs.from_file(args.costs, num_stages=stages)
        if len(base.stages) != stages:
            raise UsageError(f"--costs {args.costs}: describes {len(base.stages)} stages, but --stages is {stages}")
        if not stage_given and not comm_given:
            return base
        stage_list = [_replace(base.stages[s], **{k: v[s] for k, v in stage_given.items()}) for s in range(stages)]
        return costs_mod.Costs(stages=stage_list, comm=_replace(base.comm, **comm_given))
    defaults = dict(DEFAULT_STAGE_COST)
    stage_list = [
        costs_mod.StageCost(**{**defaults, **{k: v[s] for k, v in stage_given.items()}}) for s in range(stages)
    ]
    return costs_mod.Costs(stages=stage_list, comm=costs_mod.CommCost(**comm_given))


def _replace(obj, **changes):
    """A copy of a dataclass or pydantic model with some fields changed (and re-validated)."""
    if not changes:
        return obj
    if hasattr(obj, "model_dump"):  # pydantic: rebuild so the new values are validated
        return type(obj)(**{**obj.model_dump(), **changes})
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _load(name_or_path: str):
    from ..schedules import load_spec

    return load_spec(name_or_path)


def _compile(name_or_path: str, args, validate: bool, params: dict | None = None):
    from ..schedules import compile as compile_schedule

    if params is None:
        params = _parse_params(args.param, _load(name_or_path))
    return compile_schedule(
        name_or_path,
        args.stages,
        args.micro_batches,
        validate=validate,
        virtual_stages=getattr(args, "virtual_stages", None),
        **params,
    )


def _fmt_time(seconds: float) -> str:
    return f"{seconds:.4g}s" if seconds else "0"


def _fmt_seconds(seconds: float) -> str:
    """For table columns whose header says (s)."""
    return f"{seconds:.4g}"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n:.0f}B" if n else "0"


def _summary(description: str, width: int = 90) -> str:
    """A description on one line (schedule descriptions are folded), cut at a word to ``width``."""
    text = " ".join(description.split())
    if len(text) <= width:
        return text
    return text[: width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{option} {text!r}: expected integers >= 1")
    return values


def _add_profile_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        required=True,
        metavar="FILE",
        help="per-layer profile: a PipeDream graph.txt (.txt) or a hippie-ds profile (YAML/JSON)",
    )
    p.add_argument(
        "--profile-format",
        choices=["pipedream", "hippie"],
        help="profile format (default: pipedream for .txt, hippie otherwise)",
    )
    p.add_argument(
        "--profile-batch",
        type=_positive_int,
        metavar="N",
        help="minibatch size the profile was measured at (PipeDream's vgg16, gnmt and gnmt_large are "
        "known: 128, 32, 128)",
    )


def _read_profile(args):
    from ..planner import load_profile

    if not Path(args.profile).is_file():
        raise UsageError(f"--profile {args.profile!r}: no such file")
    return load_profile(args.profile, args.profile_format, args.profile_batch)
