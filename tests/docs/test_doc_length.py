"""The pages a newcomer reads first are short enough to read to the end: README.md at most 200 rendered
lines, docs/results.md at most 300, counted by ``rendered_lines`` (HTML comments, the figure sources
among them, excluded). Pure: the markdown is read, nothing is run."""

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LINE_WIDTH = 120
MAX_RENDERED = {"README.md": 200, "docs/results.md": 300}


def rendered_lines(text: str) -> int:
    """How many lines a reader meets in a markdown page: the lines left once every HTML comment
    (``<!-- ... -->``, the figure sources among them) is deleted, a line that held only a comment
    leaving nothing; blank lines count. A prose line counts once per ``LINE_WIDTH`` characters
    begun, so that joining lines does not shorten a page; a table row and a line of a code block
    count once."""
    comment = r"<!--(?:(?!-->).)*-->"
    text = re.sub(r"^[ \t]*" + comment + r"[ \t]*\n", "", text, flags=re.S | re.M)
    text = re.sub(comment, "", text, flags=re.S)
    count, code = 0, False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        count += 1 if code or line.startswith("|") else max(1, math.ceil(len(line) / LINE_WIDTH))
    return count


def test_rendered_lines_counts_what_a_reader_meets():
    page = (
        "# t\n<!-- figures a.json\nx | y | {z}\n-->\n| a | b |\n|---|---|\n| " + "c" * 300 + " |\n"
        "word <!-- hidden --> word\n\n```\n" + "d" * 300 + "\n```\n" + "e" * 241 + "\n"
    )
    # the title, the table's 3 rows, the line around the inline comment, the blank line, the code block's 3
    # lines, and 3 for the prose line of 241 characters
    assert rendered_lines(page) == 1 + 3 + 1 + 1 + 3 + 3


@pytest.mark.parametrize("doc", sorted(MAX_RENDERED))
def test_first_pages_are_short_enough_to_read_to_the_end(doc):
    """README.md is at most 200 rendered lines and docs/results.md at most 300, counted by
    ``rendered_lines`` (HTML comments excluded): what does not fit goes to the pages they link."""
    n = rendered_lines((ROOT / doc).read_text())
    assert n <= MAX_RENDERED[doc], (
        f"{doc} is {n} rendered lines, over {MAX_RENDERED[doc]}: move detail to the pages it links"
    )
