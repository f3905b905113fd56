"""The ``hippie-ds`` command line.

``hippie-ds schedule list|show|validate|simulate|trace`` works on schedule files (built-in names or
paths) without torch or DeepSpeed. Each top-level command registers itself in :data:`COMMANDS`
(``schedule``, ``plan``, ``profile-import``). ``main(argv)`` returns the exit code:
0 success, 1 a schedule that ``validate`` found invalid, 2 a usage error (bad option, unknown
schedule or parameter, a schedule that cannot be compiled), reported in one message on stderr (set HIPPIE_DS_DEBUG=1
for the traceback instead). A ``profile`` target whose own code raises is exit code 2 too: one line
naming the target and the exception, then the traceback's frames of the target's code only
(HIPPIE_DS_DEBUG=1: the whole traceback).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

PROG = "hippie-ds"


def _version() -> str:
    try:
        from . import __version__
        return __version__
    except ImportError:
        from importlib.metadata import version
        return version("hippie-ds")


class UsageError(Exception):
    """A command line that cannot be carried out; the message says which option and why."""


# ---------------------------------------------------------------------------------------------
# Command registry: name -> function(subparsers) that adds the command's parser. Each parser sets
# ``func`` (args -> exit code) through set_defaults.

COMMANDS: dict[str, Callable[[Any], None]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn
    return register


class _Formatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description on its own; keeps indented lines (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if para.startswith("  ") or "\n  " in para:
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
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
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
               "ti": 2 ** 40}
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
        unit_help = ("bytes" if kind == "bytes" else "bytes per second") + \
            ", e.g. 1e6, 64MB or 2GiB (k/M/G/T powers of 1000, Ki/Mi/Gi/Ti powers of 1024)"
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
        raise UsageError(f"{option} {text!r}: gave {len(values)} values for {stages} stages; give one value for "
                         "all stages or one per stage")
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
            raise UsageError(f"--param {key}={raw}: expected 'auto', 'none' or a comma-separated list of stage "
                             "indices such as 0,1") from None
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
    p.add_argument("--stages", "-K", type=_positive_int, required=True, metavar="K",
                   help="number of pipeline stages")
    p.add_argument("--micro-batches", "-M", type=_positive_int, required=True, metavar="M",
                   help="micro-batches per training step")


def _add_params(p: argparse.ArgumentParser) -> None:
    p.add_argument("--param", "-p", action="append", metavar="KEY=VALUE",
                   help="set a schedule parameter (repeatable): integers, true/false, 'auto', or stage lists "
                        "such as deferred_stages=0,1 (deferred_stages=none for no stage)")


# Without --costs, a stage costs this unless told otherwise (the other fields default to 0 and the
# network to hippie_ds.schedules.costs.CommCost's defaults).
DEFAULT_STAGE_COST = {"forward": 1.0, "backward": 2.0}

_STAGE_COST_OPTIONS = [  # option, StageCost field, kind, help
    ("--forward", "forward", "time", "forward time of one micro-batch (s; default 1)"),
    ("--backward", "backward", "time", "backward time of one micro-batch (s; default 2)"),
    ("--recompute", "recompute", "time", "re-computation (activation checkpointing) time per micro-batch (s)"),
    ("--activation-bytes", "activation_bytes", "bytes", "bytes of activations sent to the next stage per micro-batch"),
    ("--saved-bytes", "saved_bytes", "bytes", "activation bytes a stage keeps per in-flight micro-batch"),
    ("--param-bytes", "param_bytes", "bytes", "bytes of the stage's parameters (= its gradients)"),
    ("--optimizer-time", "optimizer_time", "time", "time of the stage's optimizer step (s)"),
]
_COMM_COST_OPTIONS = [  # option, CommCost field, kind, help
    ("--p2p-bandwidth", "p2p_bandwidth", "rate", "bandwidth between neighbouring stages (bytes/s; inf = free; "
                                                 "default 10e9)"),
    ("--p2p-latency", "p2p_latency", "time", "latency of one point-to-point transfer (s)"),
    ("--allreduce-bandwidth", "allreduce_bandwidth", "rate", "bandwidth of the inter-node link the data-parallel "
                                                             "all-reduce uses (bytes/s; default 1.25e8 = 1 Gbit/s)"),
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
    g.add_argument("--data-parallel", "-r", type=_positive_int, metavar="R",
                   help="data-parallel replicas of every stage (the all-reduce group size; default 1: no "
                        "all-reduce)")
    g.add_argument("--no-shared-link", action="store_true",
                   help="stages' all-reduces do not share one inter-node link (default: they do)")


def _build_costs(args, stages: int):
    """Costs from --costs FILE and/or the cost options."""
    from .schedules import costs as costs_mod

    stage_given = {field: _per_stage(getattr(args, field), kind, option, stages)
                   for option, field, kind, _ in _STAGE_COST_OPTIONS if getattr(args, field) is not None}
    comm_given = {field: _quantity(getattr(args, field), kind, option)
                  for option, field, kind, _ in _COMM_COST_OPTIONS if getattr(args, field) is not None}
    if args.data_parallel is not None:
        comm_given["data_parallel"] = args.data_parallel
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
    stage_list = [costs_mod.StageCost(**{**defaults, **{k: v[s] for k, v in stage_given.items()}})
                  for s in range(stages)]
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
    from .schedules import load_spec
    return load_spec(name_or_path)


def _compile(name_or_path: str, args, validate: bool, params: dict | None = None):
    from .schedules import compile as compile_schedule
    if params is None:
        params = _parse_params(args.param, _load(name_or_path))
    return compile_schedule(name_or_path, args.stages, args.micro_batches, validate=validate, **params)


def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Aligned columns: the first ``left`` columns left-aligned, the rest (numbers) right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers)] + [line(row) for row in rows])


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
    return text[:width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


# ---------------------------------------------------------------------------------------------
# hippie-ds schedule ...

SCHEDULE_HELP = """\
Pipeline schedules are YAML files: a built-in name (see `hippie-ds schedule list`) or a path to
a .yaml file. These commands compile a schedule for K stages and M micro-batches and show,
check, simulate or trace it; none of them needs torch, DeepSpeed or a GPU."""


@command("schedule")
def _schedule_parser(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="list, show, validate, simulate and trace pipeline schedules",
                              description=SCHEDULE_HELP, formatter_class=_Formatter)
    sub = p.add_subparsers(dest="schedule_command", metavar="SUBCOMMAND", required=True)

    q = sub.add_parser("list", help="list the built-in schedules", formatter_class=_Formatter,
                       description="List the built-in schedules: name, parameters and the first sentence of "
                                   "the description.\n\nexample:\n  hippie-ds schedule list --long")
    q.add_argument("--long", "-l", action="store_true", help="print each full description and parameter help")
    q.set_defaults(func=_cmd_list)

    q = sub.add_parser("show", help="print a compiled schedule, step by step", formatter_class=_Formatter,
                       description="Compile a schedule and print every stage's stream: one line per step with "
                                   "its operations (micro-batch, pipeline buffer, send mode, all-reduce "
                                   "target). The schedule is not validated first, so a broken one can be "
                                   "inspected; problems are summarised on stderr.\n\nexample:\n"
                                   "  hippie-ds schedule show hippie --stages 4 --micro-batches 8 --stage 0")
    q.add_argument("schedule", metavar="NAME|PATH", help="built-in schedule name or path to a schedule file")
    _add_shape(q)
    q.add_argument("--stage", "-s", type=_non_negative_int, metavar="S", help="only this stage (default: all)")
    _add_params(q)
    q.set_defaults(func=_cmd_show)

    q = sub.add_parser("validate", help="check a schedule for deadlocks and data-flow errors",
                       formatter_class=_Formatter,
                       description="Load, compile and check a schedule for K stages and M micro-batches: "
                                   "matching sends and receives, no deadlock under blocking point-to-point "
                                   "communication, every micro-batch's forward before its backward, buffers, "
                                   "gradient reduction and updates. Prints OK and a summary (exit 0), or every "
                                   "problem found (exit 1).\n\nexample:\n"
                                   "  hippie-ds schedule validate my-schedule.yaml -K 4 -M 8 --param deferred_stages=0")
    q.add_argument("schedule", metavar="NAME|PATH", help="built-in schedule name or path to a schedule file")
    _add_shape(q)
    _add_params(q)
    q.set_defaults(func=_cmd_validate)

    q = sub.add_parser("simulate", help="simulate schedules with a cost model: step time, bubble, memory",
                       formatter_class=_Formatter,
                       description="Simulate one or more schedules with a cost model (per-stage compute times "
                                   "and sizes, point-to-point and all-reduce links) over several steps and "
                                   "report the steady-state step time, bubble fraction, throughput and, per "
                                   "stage, busy / idle / exposed communication time, peak activations and "
                                   "gradient-buffer memory. With several schedules the step times are compared "
                                   "to the first's. Parameters set to 'auto' are chosen from the costs; a "
                                   "--param is given to every schedule that declares it.\n\nexamples:\n"
                                   "  hippie-ds schedule simulate 1f1b gpipe hippie -K 4 -M 8 --forward 1 "
                                   "--backward 2\n"
                                   "  hippie-ds schedule simulate hippie -K 4 -M 8 --costs costs.yaml --json")
    q.add_argument("schedule", nargs="+", metavar="NAME|PATH", help="built-in schedule names or schedule files")
    _add_shape(q)
    _add_params(q)
    _add_costs(q)
    q.add_argument("--iterations", "-n", type=_positive_int, default=3, metavar="N",
                   help="training steps to simulate (the last gives the steady state; default 3)")
    q.add_argument("--json", action="store_true", help="print the results as JSON (without the event list)")
    q.set_defaults(func=_cmd_simulate)

    q = sub.add_parser("trace", help="simulate a schedule and write a Chrome trace and a PNG timeline",
                       formatter_class=_Formatter,
                       description="Simulate a schedule with a cost model (as `simulate` does) and write its "
                                   "events as a Chrome trace (open in chrome://tracing or ui.perfetto.dev) and "
                                   "as a PNG timeline.\n\nexample:\n"
                                   "  hippie-ds schedule trace hippie -K 4 -M 8 --forward 1 --backward 2 "
                                   "--out out/hippie.json")
    q.add_argument("schedule", metavar="NAME|PATH", help="built-in schedule name or path to a schedule file")
    _add_shape(q)
    _add_params(q)
    _add_costs(q)
    q.add_argument("--iterations", "-n", type=_positive_int, default=3, metavar="N",
                   help="training steps to simulate (default 3)")
    q.add_argument("--out", "-o", required=True, metavar="FILE.json", help="Chrome trace to write")
    q.add_argument("--png", metavar="FILE.png", help="timeline picture to write (default: FILE.png beside --out)")
    q.set_defaults(func=_cmd_trace)


def _cmd_list(args) -> int:
    from .schedules import available
    names = available()
    if not names:
        raise UsageError("no built-in schedules found (is the package installed with its schedule files?)")
    rows = []
    for name in names:
        try:
            spec = _load(name)
        except Exception as exc:  # a broken built-in should not hide the others
            rows.append((name, "", f"(cannot be loaded: {str(exc).splitlines()[0]})", ""))
            continue
        params = ", ".join(f"{k}={_show_value(p.default)}" for k, p in spec.params.items())
        rows.append((name, params, spec.description, spec))
    if args.long:
        for name, params, description, spec in rows:
            print(name)
            print("  " + " ".join(description.split()))
            if spec:
                for key, p in spec.params.items():
                    print(f"  param {key} ({p.kind}, default {_show_value(p.default)}): {p.help}")
            print()
    else:
        print(_table(["schedule", "params", "description"], [[n, p or "-", _summary(d)] for n, p, d, _ in rows], left=3))
    return 0


def _show_value(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _check(compiled) -> list:
    from .schedules import validator
    return list(validator.check(compiled))


def _cmd_show(args) -> int:
    if args.stage is not None and args.stage >= args.stages:
        raise UsageError(f"--stage {args.stage}: allowed 0..{args.stages - 1} for {args.stages} stages")
    compiled = _compile(args.schedule, args, validate=False)
    print(compiled.describe(args.stage))
    problems = _check(compiled)
    if problems:
        print(f"warning: schedule {compiled.name!r} has {len(problems)} problem(s); see `{PROG} schedule validate`",
              file=sys.stderr)
    return 0


def _cmd_validate(args) -> int:
    from .schedules import compile_schedule, resolve_params
    from .schedules.spec import ScheduleError, resolve_path
    resolve_path(args.schedule)  # an unknown name or missing file is a usage error (exit 2)
    try:
        spec = _load(args.schedule)
    except ScheduleError as exc:
        print(f"INVALID: {exc}")
        return 1
    params = _parse_params(args.param, spec)
    resolve_params(spec, args.stages, args.micro_batches, params)  # unknown / bad parameter: usage error
    try:
        compiled = compile_schedule(spec, args.stages, args.micro_batches, params, source=str(args.schedule))
    except ScheduleError as exc:
        print(f"INVALID: {exc}")
        return 1
    problems = _check(compiled)
    shape = f"{compiled.stages} stages x {compiled.micro_batches} micro-batches"
    if problems:
        print(f"INVALID: schedule {compiled.name!r} ({shape}): {len(problems)} problem(s):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    ops = sum(1 for s in range(compiled.stages) for _ in compiled.ops(s))
    params_text = ", ".join(f"{k}={_show_value(v)}" for k, v in compiled.params.items()) or "none"
    print(f"OK: schedule {compiled.name!r} ({shape}): {compiled.num_steps} steps, {ops} ops, "
          f"pipeline buffers per stage {compiled.num_buffers}, params {params_text}")
    return 0


def _simulate_one(name: str, args, costs, only_declared: bool):
    """Compile ``name`` with the --param values (only those it declares when ``only_declared``:
    several schedules compared), validate it, resolve its 'auto' parameters from the costs, and
    simulate it."""
    from .schedules import simulator
    spec = _load(name)
    given = _parse_params(args.param, spec)
    if only_declared:
        given = {k: v for k, v in given.items() if k in spec.params}
    # Compile and validate first: a broken schedule is reported as such, not as a failed simulation.
    compiled = _compile(name, args, validate=True, params=given)
    params = simulator.resolve_auto_params(spec, args.stages, args.micro_batches, costs, params=given,
                                           iterations=args.iterations)
    if params != compiled.params:
        compiled = _compile(name, args, validate=True, params=params)
    return compiled, simulator.simulate(compiled, costs, iterations=args.iterations)


def _cmd_simulate(args) -> int:
    costs = _build_costs(args, args.stages)
    names = args.schedule
    if len(names) > 1 and args.param:  # every --param must belong to at least one schedule
        specs = [_load(n) for n in names]
        for key in _parse_params(args.param, None):
            if not any(key in s.params for s in specs):
                raise UsageError(f"--param {key}: none of the schedules {', '.join(names)} has this parameter")
    results = [(name, *_simulate_one(name, args, costs, only_declared=len(names) > 1)) for name in names]
    if args.json:
        data = [result.to_dict(events=False) for _, _, result in results]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2, default=_json_default))
        return 0
    for i, (name, compiled, result) in enumerate(results):
        if i:
            print()
        print(_report(name, compiled, result, costs))
    if len(results) > 1:
        print()
        print(_comparison(results))
    return 0


def _json_default(obj):
    if hasattr(obj, "value"):  # enums
        return obj.value
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


_STAGE_COLUMNS = [  # header, per-stage key, formatter
    ("busy (s)", "busy", _fmt_seconds),
    ("idle (s)", "idle", _fmt_seconds),
    ("exposed comm (s)", "exposed_comm", _fmt_seconds),
    ("exposed all-reduce (s)", "exposed_allreduce", _fmt_seconds),
    ("all-reduce (s)", "allreduce_time", _fmt_seconds),
    ("peak act (mb)", "peak_activation_microbatches", str),
    ("peak act bytes", "peak_activation_bytes", _fmt_bytes),
    ("grad buffer", "gradient_buffer_bytes", _fmt_bytes),
]


def _report(name: str, compiled, result, costs) -> str:
    params = ", ".join(f"{k}={_show_value(v)}" for k, v in compiled.params.items())
    head = compiled.name if name == compiled.name else f"{compiled.name} ({name})"
    comm = costs.comm
    lines = [f"{head}: {compiled.stages} stages x {compiled.micro_batches} micro-batches, "
             f"{comm.data_parallel} data-parallel replica(s)" + (f", {params}" if params else "")]
    rows = [[str(row["stage"])] + [fmt(row[key]) for _, key, fmt in _STAGE_COLUMNS] for row in result.per_stage]
    lines.append(_table(["stage"] + [h for h, _, _ in _STAGE_COLUMNS], rows))
    lines.append(f"step time {_fmt_time(result.step_time)}, bubble {result.bubble_fraction:.1%}, "
                 f"throughput {result.throughput:.4g} micro-batches/s, all-reduce on the critical path "
                 f"{_fmt_time(result.allreduce_on_critical_path)}")
    return "\n".join(lines)


def _comparison(results) -> str:
    base = results[0][2].step_time
    rows = []
    for name, _, result in results:
        rel = f"{result.step_time / base:.3f}x" if base > 0 else "-"
        rows.append([name, _fmt_time(result.step_time), rel, f"{result.bubble_fraction:.1%}",
                     f"{result.throughput:.4g}", _fmt_time(result.allreduce_on_critical_path)])
    return _table(["schedule", "step time", f"vs {results[0][0]}", "bubble", "micro-batches/s",
                   "all-reduce on critical path"], rows)


def _cmd_trace(args) -> int:
    from .schedules import trace
    out = Path(args.out)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    costs = _build_costs(args, args.stages)
    compiled, result = _simulate_one(args.schedule, args, costs, only_declared=False)
    for path in (out, png):
        path.parent.mkdir(parents=True, exist_ok=True)
    trace.chrome_trace(result.events, out)
    title = (f"{compiled.name}: {compiled.stages} stages x {compiled.micro_batches} micro-batches, "
             f"step {_fmt_time(result.step_time)}")
    trace.timeline_png(result.events, png, title)
    print(f"wrote {out} (Chrome trace) and {png} (timeline)")
    return 0


# ---------------------------------------------------------------------------------------------
# hippie-ds plan / profile-import

PLAN_HELP = """\
Plan a data-parallel pipeline for a model profile on a cluster: pipeline depth and data-parallel
width, micro-batch size and count, stage boundaries, which layers to re-compute, the schedule
and Hippie's deferred stages. The default objective is memory efficiency, ME = scalability x
throughput / memory (Hippie's); --objective throughput maximizes throughput under the device
memory or --memory-cap. Prints a summary with the baselines (data parallelism, GPipe+DP, and the
uniform, DeepSpeed 'parameters' and PipeDream partitions) and writes the plan file with --out.
Pure Python: no torch, DeepSpeed or GPU needed.

The cluster is NODESxDEVICES,MEMORY,INTER[,INTRA] (INTRA defaults to 100GB/s), e.g.
4x4,16GB,100Gbit, or a YAML/JSON file with nodes, devices_per_node, device_memory,
inter_node_bandwidth, intra_node_bandwidth, latency.

examples:
  hippie-ds plan --profile vgg16.txt --cluster 4x4,16GB,100Gbit --global-batch 2048 --out plan.json
  hippie-ds plan --profile model.yaml --cluster cluster.yaml --global-batch 512 --objective throughput \\
      --memory-cap 12GB --schedules 1f1b,hippie"""


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{option} {text!r}: expected integers >= 1")
    return values


def _add_profile_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, metavar="FILE",
                   help="per-layer profile: a PipeDream graph.txt (.txt) or a hippie-ds profile (YAML/JSON)")
    p.add_argument("--profile-format", choices=["pipedream", "hippie"],
                   help="profile format (default: pipedream for .txt, hippie otherwise)")
    p.add_argument("--profile-batch", type=_positive_int, metavar="N",
                   help="minibatch size the profile was measured at (PipeDream's vgg16, gnmt and gnmt_large are "
                        "known: 128, 32, 128)")


def _read_profile(args):
    from .planner import load_profile
    if not Path(args.profile).is_file():
        raise UsageError(f"--profile {args.profile!r}: no such file")
    return load_profile(args.profile, args.profile_format, args.profile_batch)


@command("plan")
def _plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan pipeline depth, partition, re-computation and schedule",
                              description=PLAN_HELP, formatter_class=_Formatter)
    _add_profile_options(p)
    p.add_argument("--cluster", required=True, metavar="SPEC|FILE",
                   help="cluster, e.g. 4x4,16GB,100Gbit (nodes x devices, device memory, inter-node bandwidth"
                        "[, intra-node bandwidth]) or a YAML/JSON file")
    p.add_argument("--global-batch", "-G", type=_positive_int, required=True, metavar="N",
                   help="samples per training step over all replicas")
    p.add_argument("--objective", choices=["me", "throughput"], default="me",
                   help="maximize memory efficiency (default) or throughput")
    p.add_argument("--memory-cap", metavar="BYTES", help="memory a device may use, e.g. 12GB (default: all of it)")
    p.add_argument("--memory-metric", choices=["mean", "max"], default="mean",
                   help="memory in ME: the mean per-device peak (default; = total / devices) or the largest")
    p.add_argument("--schedules", metavar="LIST", default="1f1b,gpipe,hippie,hippie-1f1b",
                   help="schedules to consider, comma-separated (default: all four)")
    p.add_argument("--stages", metavar="K[,K...]", help="only these pipeline depths (each must divide the devices)")
    p.add_argument("--micro-batch-size", metavar="B[,B...]", help="only these micro-batch sizes")
    p.add_argument("--min-micro-batch", type=_positive_int, metavar="B",
                   help="smallest micro-batch size to consider (default: profile batch / 16, at least 1: the "
                        "linear time scaling is not trusted further down)")
    p.add_argument("--state-factor", type=float, default=4.0, metavar="F",
                   help="training-state bytes per profiled parameter byte (default 4: fp32 weights, gradients and "
                        "two Adam moments for an fp32 profile)")
    p.add_argument("--simulate-top", type=_non_negative_int, default=4, metavar="N",
                   help="simulate the N best analytic candidates (default 4; 0: analytic only)")
    p.add_argument("--no-baselines", action="store_true", help="do not evaluate the baselines")
    p.add_argument("--out", "-o", metavar="FILE", help="write the plan (.json, or .yaml/.yml)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the summary")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    from .planner import make_plan, parse_cluster, save_plan
    from .planner.plan import SCHEDULES

    profile = _read_profile(args)
    cluster = parse_cluster(args.cluster)
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise UsageError(f"--schedules {args.schedules!r}: the planner knows {', '.join(SCHEDULES)}")
    if args.state_factor <= 0 or not math.isfinite(args.state_factor):
        raise UsageError(f"--state-factor {args.state_factor}: must be a positive number")
    cap = _quantity(args.memory_cap, "bytes", "--memory-cap") if args.memory_cap else None
    if cap is not None and cap <= 0:
        raise UsageError(f"--memory-cap {args.memory_cap!r}: must be positive")
    depths = _int_list(args.stages, "--stages") if args.stages else None
    if depths:
        bad = [k for k in depths if cluster.devices % k]
        if bad:
            raise UsageError(f"--stages {args.stages}: {bad} do(es) not divide the {cluster.devices} devices")
    sizes = _int_list(args.micro_batch_size, "--micro-batch-size") if args.micro_batch_size else None
    plan = make_plan(profile, cluster, args.global_batch, objective=args.objective, memory_cap=cap,
                     schedules=schedules, depths=depths, micro_batch_sizes=sizes,
                     min_micro_batch=args.min_micro_batch, state_factor=args.state_factor,
                     memory_metric=args.memory_metric, simulate_top=args.simulate_top,
                     baselines=not args.no_baselines)
    if args.out:
        save_plan(plan, args.out)
    if args.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=1))
    else:
        print(plan.summary())
        if args.out:
            print(f"wrote {args.out}")
    return 0


@command("profile")
def _profile_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile", help="measure a PipelineModule layer list, layer by layer, into a profile",
        formatter_class=_Formatter,
        description="Import TARGET (module:function or path/to/file.py:function; the function returns "
                    "(layers, sample): the PipelineModule layer list and one micro-batch of input), run every layer "
                    "on the previous layer's output on this machine and write a profile (YAML or JSON): per layer "
                    "the median forward and backward time over --repeats runs after --warmup runs, the re-compute "
                    "time, output bytes, bytes saved for backward (saved-tensor hooks, attributed to the layer that "
                    "produced them) and parameter bytes. Needs torch and DeepSpeed.\n\nexample:\n"
                    "  hippie-ds profile tools/examples/gpt.py:profile_target --out gpt-profile.yaml\n"
                    "  hippie-ds plan --profile gpt-profile.yaml --cluster 1x4,8GB,10Gbit --global-batch 32 "
                    "--out plan.json")
    p.add_argument("target", metavar="TARGET", help="module:function or path/to/file.py:function")
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="profile to write (.json, or .yaml/.yml)")
    p.add_argument("--repeats", type=_positive_int, default=10, metavar="N", help="timed runs per layer (default 10)")
    p.add_argument("--warmup", type=_non_negative_int, default=3, metavar="N",
                   help="untimed runs per layer first (default 3)")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--name", metavar="NAME", help="model name in the profile (default: what TARGET says, or TARGET)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)


def _cmd_profile(args) -> int:
    import torch

    from .planner import save_profile
    from .profiler import TargetError, load_target, profile_layers

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        layers, sample, name = load_target(args.target)
        profile = profile_layers(layers, sample, model=args.name or name, repeats=args.repeats,
                                 warmup=args.warmup, progress=not args.no_progress)
    except TargetError as exc:
        if os.environ.get("HIPPIE_DS_DEBUG"):
            raise
        sys.stderr.write(_target_error_report(args.target, exc))
        return 2
    save_profile(profile, args.out)
    saved = sum(x.saved for x in profile.layers)
    print(f"wrote {args.out}: {profile.model}, {profile.num_layers} layers at micro-batch {profile.batch_size}, "
          f"forward+backward {profile.total_time() * 1e3:.4g} ms, saved for backward {_fmt_bytes(saved)}, "
          f"parameters {_fmt_bytes(profile.total_param_bytes())}")
    return 0


def _target_error_report(target: str, error) -> str:
    """What ``hippie-ds profile`` prints when the target's own code raised (a ``TargetError``): one
    line naming the target and the exception, then the traceback without hippie-ds's frames, the
    import machinery's, and the library frames (torch, DeepSpeed) that lead into the target's code."""
    import traceback

    exc = error.__cause__
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    try:
        message = str(exc)
    except Exception:
        message = ""
    where = f": {error.where}" if error.where else ""
    head = f"{PROG} profile: target {target!r}{where} raised {name}" + (f": {message}" if message else "")
    report = traceback.TracebackException.from_exception(exc)
    _drop_foreign_frames(report, set())
    return head + "\n" + "".join(report.format())


def _drop_foreign_frames(report, seen: set) -> None:
    """Keep the frames of the user's code in a ``TracebackException`` (and the exceptions chained
    to it): no frame of hippie-ds or of importlib/runpy, and none of the installed libraries before
    the first frame of the user's code (all of them when there is none)."""
    import importlib
    import runpy
    import sysconfig
    import traceback

    if report is None or id(report) in seen:
        return
    seen.add(id(report))

    def inside(filename: str, dirs) -> bool:
        path = os.path.realpath(filename)
        return any(path == d or path.startswith(d + os.sep) for d in dirs)

    ours = [os.path.realpath(Path(__file__).parent), os.path.realpath(Path(importlib.__file__).parent)]
    libraries = {os.path.realpath(p) for key, p in sysconfig.get_paths().items()
                 if key in ("stdlib", "platstdlib", "purelib", "platlib")}
    frames = [f for f in report.stack
              if not (f.filename.startswith(("<frozen importlib", "<frozen runpy"))
                      or f.filename == runpy.__file__ or inside(f.filename, ours))]
    first_user = next((i for i, f in enumerate(frames) if not inside(f.filename, libraries)), 0)
    report.stack = traceback.StackSummary.from_list(frames[first_user:])
    for other in (report.__cause__, report.__context__, *(getattr(report, "exceptions", None) or ())):
        _drop_foreign_frames(other, seen)


@command("profile-import")
def _profile_import_parser(subparsers) -> None:
    p = subparsers.add_parser("profile-import", help="convert a PipeDream graph.txt profile to a hippie-ds profile",
                              formatter_class=_Formatter,
                              description="Read a per-layer profile (PipeDream graph.txt, or a hippie-ds profile) "
                                          "and write it as a hippie-ds profile (YAML or JSON): layers in a stable "
                                          "topological order, times in seconds per micro-batch, the bytes crossing "
                                          "every cut. Prints a one-line summary.\n\nexample:\n"
                                          "  hippie-ds profile-import --profile gnmt.txt --out gnmt.yaml")
    _add_profile_options(p)
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="profile to write (.json, or .yaml/.yml)")
    p.set_defaults(func=_cmd_profile_import)


def _cmd_profile_import(args) -> int:
    from .planner import save_profile
    profile = _read_profile(args)
    save_profile(profile, args.out)
    print(f"wrote {args.out}: {profile.model}, {profile.num_layers} layers at batch {profile.batch_size}, "
          f"forward+backward {profile.total_time() * 1e3:.4g} ms, parameters {_fmt_bytes(profile.total_param_bytes())}")
    return 0


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=_Formatter,
        description="hippie-ds: declarative pipeline-parallel schedules (Hippie, 1F1B, GPipe) for DeepSpeed.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(subparsers)
    return parser


def _user_error_types() -> tuple:
    from pydantic import ValidationError
    from .schedules.simulator import SimulationError
    from .schedules.spec import ScheduleError
    return (UsageError, ScheduleError, SimulationError, ValidationError, ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an argparse usage error (already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return args.func(args)
    except _user_error_types() as exc:
        if os.environ.get("HIPPIE_DS_DEBUG"):
            raise
        print(f"{PROG}: error: {_error_text(exc)}", file=sys.stderr)
        return 2


def _error_text(exc: BaseException) -> str:
    from pydantic import ValidationError
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or exc.title
            parts.append(f"{field}: {err['msg']}")
        return f"invalid {exc.title}: " + "; ".join(parts)
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
