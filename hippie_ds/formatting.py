"""Plain-text output shared by the CLI and the planner's summaries. Pure Python."""

from __future__ import annotations


def table(headers: list, rows: list[list], left: int = 1) -> str:
    """Aligned columns separated by two spaces: the first ``left`` columns left-aligned, the rest
    (numbers) right-aligned; short rows are padded with empty cells."""
    width = max(len(r) for r in [headers, *rows])
    cells = [[str(c) for c in r] + [""] * (width - len(r)) for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(width)]
    return "\n".join(
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in cells
    )
