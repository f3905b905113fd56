"""The ``hippie-ds`` command line.

``hippie-ds schedule list|show|validate|simulate|trace`` works on schedule files (built-in names or
paths) without torch or DeepSpeed. :data:`COMMANDS` names each top-level command's parser
(``schedule``, ``plan``, ``profile``, ``profile-import``, ``costs``). ``main(argv)`` returns the exit code:
0 success, 1 a schedule that ``validate`` found invalid, 2 a usage error (bad option, unknown
schedule or parameter, a schedule that cannot be compiled), reported in one message on stderr (set HIPPIE_DS_DEBUG=1
for the traceback instead). A ``profile`` target whose own code raises is exit code 2 too: one line
naming the target and the exception, then the traceback's frames of the target's code only
(HIPPIE_DS_DEBUG=1: the whole traceback).

One module per command: :mod:`.schedule`, :mod:`.plan`, :mod:`.profile` (``profile`` and
``profile-import``), :mod:`.costs`; :mod:`.base` holds option parsing and output formatting.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from . import schedule, plan, profile, costs
from .base import PROG, UsageError, _Formatter, _version

# name -> function(subparsers) that adds the command's parser, in --help's order. Each parser sets
# ``func`` (args -> exit code) through set_defaults.
COMMANDS: dict[str, Callable[[Any], None]] = {
    "schedule": schedule.schedule_parser,
    "plan": plan.plan_parser,
    "profile": profile.profile_parser,
    "profile-import": profile.profile_import_parser,
    "costs": costs.costs_parser,
}

# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_Formatter,
        description="hippie-ds: declarative pipeline-parallel schedules (Hippie, 1F1B, GPipe) for DeepSpeed.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(subparsers)
    return parser


def _user_error_types() -> tuple:
    from pydantic import ValidationError
    from ..schedules.simulator import SimulationError
    from ..schedules.spec import ScheduleError

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
