"""The end of a study that runs jobs into ``--out`` and summarises them: one place for the
``--report-only`` switch and the ``results.json`` / ``results.md`` pair (``tools/bench.py tied-deferral``,
``zero-memory``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def run_and_report(args, run: Callable, summarize: Callable[[Path], dict], markdown: Callable[[dict], str]) -> int:
    """``run(args)`` unless ``args.report_only``; then ``summarize(out)`` into OUT/results.json and
    ``markdown`` of it into OUT/results.md, printed."""
    out = Path(args.out)
    if not args.report_only:
        run(args)
    table = summarize(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(table, indent=1, default=str))
    text = markdown(table)
    (out / "results.md").write_text(text)
    print(text)
    return 0
