"""``hippie-ds schedule list|show|validate|simulate|trace``: schedule files, without torch or DeepSpeed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import AUTO_LAYERS, DEFAULT_DEFERRED_LAYERS, UNTIED_LAYERS, WHOLE_STAGE
from .base import (
    PROG,
    UsageError,
    _Formatter,
    _add_costs,
    _add_params,
    _add_shape,
    _build_costs,
    _compile,
    _fmt_bytes,
    _fmt_seconds,
    _fmt_time,
    _load,
    _non_negative_int,
    _parse_params,
    _positive_int,
    _summary,
    _table,
)

# ---------------------------------------------------------------------------------------------
# hippie-ds schedule ...

SCHEDULE_HELP = """\
Pipeline schedules are YAML files: a built-in name (see `hippie-ds schedule list`) or a path to
a .yaml file. These commands compile a schedule for K stages and M micro-batches and show,
check, simulate or trace it; none of them needs torch, DeepSpeed or a GPU."""


def schedule_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "schedule",
        help="list, show, validate, simulate and trace pipeline schedules",
        description=SCHEDULE_HELP,
        formatter_class=_Formatter,
    )
    sub = p.add_subparsers(dest="schedule_command", metavar="SUBCOMMAND", required=True)
    _add_list_command(sub)
    _add_show_command(sub)
    _add_validate_command(sub)
    _add_simulate_command(sub)
    _add_trace_command(sub)


def _add_list_command(sub) -> None:
    q = sub.add_parser(
        "list",
        help="list the built-in schedules",
        formatter_class=_Formatter,
        description="List the built-in schedules: name, parameters and the first sentence of "
        "the description.\n\nexample:\n  hippie-ds schedule list --long",
    )
    q.add_argument("--long", "-l", action="store_true", help="print each full description and parameter help")
    q.set_defaults(func=_cmd_list)


def _add_show_command(sub) -> None:
    q = sub.add_parser(
        "show",
        help="print a compiled schedule, step by step",
        formatter_class=_Formatter,
        description="Compile a schedule and print every stage's stream: one line per step with "
        "its operations (micro-batch, pipeline buffer, send mode, all-reduce "
        "target). The schedule is not validated first, so a broken one can be "
        "inspected; problems are summarised on stderr.\n\nexample:\n"
        "  hippie-ds schedule show hippie --stages 4 --micro-batches 8 --stage 0",
    )
    q.add_argument("schedule", metavar="NAME|PATH", help="built-in schedule name or path to a schedule file")
    _add_shape(q)
    q.add_argument("--stage", "-s", type=_non_negative_int, metavar="S", help="only this stage (default: all)")
    _add_params(q)
    q.set_defaults(func=_cmd_show)


def _add_validate_command(sub) -> None:
    q = sub.add_parser(
        "validate",
        help="check a schedule for deadlocks and data-flow errors",
        formatter_class=_Formatter,
        description="Load, compile and check a schedule for K stages and M micro-batches: "
        "matching sends and receives, no deadlock under blocking point-to-point "
        "communication, every micro-batch's forward before its backward, buffers, "
        "gradient reduction and updates. Prints OK and a summary (exit 0), or every "
        "problem found (exit 1).\n\nexample:\n"
        "  hippie-ds schedule validate my-schedule.yaml -K 4 -M 8 --param deferred_stages=0",
    )
    q.add_argument("schedule", metavar="NAME|PATH", help="built-in schedule name or path to a schedule file")
    _add_shape(q)
    _add_params(q)
    q.set_defaults(func=_cmd_validate)


def _add_simulate_command(sub) -> None:
    q = sub.add_parser(
        "simulate",
        help="simulate schedules with a cost model: step time, bubble, memory",
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
        "  hippie-ds schedule simulate hippie -K 4 -M 8 --costs costs.yaml --json\n"
        "  hippie-ds schedule simulate hippie -K 4 -M 8 --costs costs.yaml "
        "--deferred-layers auto",
    )
    q.add_argument("schedule", nargs="+", metavar="NAME|PATH", help="built-in schedule names or schedule files")
    _add_shape(q)
    _add_params(q)
    _add_costs(q)
    _add_deferred_layers(q)
    q.add_argument(
        "--iterations",
        "-n",
        type=_positive_int,
        default=3,
        metavar="N",
        help="training steps to simulate (the last gives the steady state; default 3)",
    )
    q.add_argument("--json", action="store_true", help="print the results as JSON (without the event list)")
    q.set_defaults(func=_cmd_simulate)


def _add_trace_command(sub) -> None:
    q = sub.add_parser(
        "trace",
        help="simulate a schedule and write a Chrome trace and a PNG timeline",
        formatter_class=_Formatter,
        description="Simulate a schedule with a cost model (as `simulate` does) and write its "
        "events as a Chrome trace (open in chrome://tracing or ui.perfetto.dev) and "
        "as a PNG timeline.\n\nexample:\n"
        "  hippie-ds schedule trace hippie -K 4 -M 8 --forward 1 --backward 2 "
        "--out out/hippie.json",
    )
    q.add_argument("schedule", metavar="NAME|PATH", help="built-in schedule name or path to a schedule file")
    _add_shape(q)
    _add_params(q)
    _add_costs(q)
    _add_deferred_layers(q)
    q.add_argument(
        "--iterations", "-n", type=_positive_int, default=3, metavar="N", help="training steps to simulate (default 3)"
    )
    q.add_argument("--out", "-o", required=True, metavar="FILE.json", help="Chrome trace to write")
    q.add_argument("--png", metavar="FILE.png", help="timeline picture to write (default: FILE.png beside --out)")
    q.set_defaults(func=_cmd_trace)


def _add_deferred_layers(q) -> None:
    q.add_argument(
        "--deferred-layers",
        metavar="untied|auto|N|all",
        type=_deferred_layers_value,
        default=DEFAULT_DEFERRED_LAYERS,
        help="partial deferral (hippie.deferred_layers, the same default) of the deferred stages: "
        "'untied' (default) delays each one's first layer with parameters (param_bytes > 0; a stage "
        "without per-layer costs counts as one layer, so it is delayed whole), N their first N "
        "layers with parameters (0: the stage is not deferred), 'all' their whole gradient, 'auto' "
        "the count with the least predicted time to a loss (the engine's rule; prints each stage's "
        "choice). N and auto need per-layer costs: a --costs file whose stages list 'layers'",
    )
    q.add_argument(
        "--staleness-price",
        type=float,
        default=None,
        metavar="P",
        help="with --deferred-layers auto: the extra steps (a share) a fully stale gradient costs "
        "(hippie.staleness_price; default 0.5, measured on the GPT example; 0: the step time alone)",
    )


def _deferred_layers_value(text: str):
    if text in (UNTIED_LAYERS, AUTO_LAYERS, WHOLE_STAGE):
        return text
    if text.isdigit():
        return int(text)
    import argparse

    raise argparse.ArgumentTypeError(f"{text!r}: allowed untied, auto, all or a layer count >= 0")


def _cmd_list(args) -> int:
    from ..schedules import available

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
        print(
            _table(["schedule", "params", "description"], [[n, p or "-", _summary(d)] for n, p, d, _ in rows], left=3)
        )
    return 0


def _show_value(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _check(compiled) -> list:
    from ..schedules import validator

    return list(validator.check(compiled))


def _cmd_show(args) -> int:
    if args.stage is not None and args.stage >= args.stages:
        raise UsageError(f"--stage {args.stage}: allowed 0..{args.stages - 1} for {args.stages} stages")
    compiled = _compile(args.schedule, args, validate=False)
    print(compiled.describe(args.stage))
    problems = _check(compiled)
    if problems:
        print(
            f"warning: schedule {compiled.name!r} has {len(problems)} problem(s); see `{PROG} schedule validate`",
            file=sys.stderr,
        )
    return 0


def _cmd_validate(args) -> int:
    from ..schedules import compile_schedule, resolve_params
    from ..schedules.spec import ScheduleError, resolve_path

    resolve_path(args.schedule)  # an unknown name or missing file is a usage error (exit 2)
    try:
        spec = _load(args.schedule)
    except ScheduleError as exc:
        print(f"INVALID: {exc}")
        return 1
    params = _parse_params(args.param, spec)
    resolve_params(spec, args.stages, args.micro_batches, params)  # unknown / bad parameter: usage error
    try:
        compiled = compile_schedule(
            spec, args.stages, args.micro_batches, params, source=str(args.schedule), virtual_stages=args.virtual_stages
        )
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
    print(
        f"OK: schedule {compiled.name!r} ({shape}): {compiled.num_steps} steps, {ops} ops, "
        f"pipeline buffers per stage {compiled.num_buffers}, params {params_text}"
    )
    return 0


def _simulate_one(name: str, args, costs, only_declared: bool):
    """Resolve ``name`` with the --param values (only those it declares when ``only_declared``:
    several schedules compared) and the costs ('auto' parameters, --deferred-layers; the engine's
    one pass, schedules.resolve), validated, and simulate it."""
    from ..schedules import simulator
    from ..schedules.costs import CostsError
    from ..schedules.resolve import Shape, resolve

    spec = _load(name)
    given = _parse_params(args.param, spec)
    if only_declared:
        given = {k: v for k, v in given.items() if k in spec.params}
    if args.staleness_price is not None and args.deferred_layers != AUTO_LAYERS:
        raise UsageError(f"--staleness-price {args.staleness_price}: it prices only --deferred-layers auto")
    try:
        resolved = resolve(
            spec,
            Shape(args.stages, args.micro_batches, getattr(args, "virtual_stages", None)),
            given,
            args.deferred_layers,
            costs,
            staleness_price=args.staleness_price,
            iterations=args.iterations,
            source=str(name),
        )
    except CostsError as exc:
        raise UsageError(f"--deferred-layers {args.deferred_layers}: {exc}") from None
    missing = [s for s in resolved.deferral.stages if not costs.stages[s].layers]
    if missing and args.deferred_layers not in (UNTIED_LAYERS, WHOLE_STAGE, AUTO_LAYERS):
        raise UsageError(
            f"--deferred-layers {args.deferred_layers}: stage(s) {missing} have no per-layer costs; give "
            "a --costs file whose stages list 'layers' (param_bytes, optionally backward, per layer)"
        )
    result = simulator.simulate(
        resolved.compiled, costs, iterations=args.iterations, deferred_layers=resolved.simulator_layers()
    )
    return resolved.compiled, result, list(resolved.choices.values())


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
        data = [
            {**result.to_dict(events=False), **({"deferred_layers": [vars(c) for c in choices]} if choices else {})}
            for _, _, result, choices in results
        ]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2, default=_json_default))
        return 0
    for i, (name, compiled, result, choices) in enumerate(results):
        if i:
            print()
        print(_report(name, compiled, result, costs))
        for choice in choices:
            print(f"deferred_layers auto, {choice.describe()}")
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
    lines = [
        f"{head}: {compiled.stages} stages x {compiled.micro_batches} micro-batches, "
        f"{comm.data_parallel} data-parallel replica(s)" + (f", {params}" if params else "")
    ]
    rows = [[str(row["stage"])] + [fmt(row[key]) for _, key, fmt in _STAGE_COLUMNS] for row in result.per_stage]
    lines.append(_table(["stage"] + [h for h, _, _ in _STAGE_COLUMNS], rows))
    lines.append(
        f"step time {_fmt_time(result.step_time)}, bubble {result.bubble_fraction:.1%}, "
        f"throughput {result.throughput:.4g} micro-batches/s, all-reduce on the critical path "
        f"{_fmt_time(result.allreduce_on_critical_path)}"
    )
    return "\n".join(lines)


def _comparison(results) -> str:
    base = results[0][2].step_time
    rows = []
    for name, _, result, _ in results:
        rel = f"{result.step_time / base:.3f}x" if base > 0 else "-"
        rows.append(
            [
                name,
                _fmt_time(result.step_time),
                rel,
                f"{result.bubble_fraction:.1%}",
                f"{result.throughput:.4g}",
                _fmt_time(result.allreduce_on_critical_path),
            ]
        )
    return _table(
        ["schedule", "step time", f"vs {results[0][0]}", "bubble", "micro-batches/s", "all-reduce on critical path"],
        rows,
    )


def _cmd_trace(args) -> int:
    from ..schedules import trace

    out = Path(args.out)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    costs = _build_costs(args, args.stages)
    compiled, result, _ = _simulate_one(args.schedule, args, costs, only_declared=False)
    for path in (out, png):
        path.parent.mkdir(parents=True, exist_ok=True)
    trace.chrome_trace(result.events, out)
    title = (
        f"{compiled.name}: {compiled.stages} stages x {compiled.micro_batches} micro-batches, "
        f"step {_fmt_time(result.step_time)}"
    )
    trace.timeline_png(result.events, png, title)
    print(f"wrote {out} (Chrome trace) and {png} (timeline)")
    return 0
