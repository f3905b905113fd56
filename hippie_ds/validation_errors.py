"""One readable line per pydantic validation error: where, field, value, what is wrong."""
from __future__ import annotations

from pydantic import ValidationError


def describe(exc: ValidationError, where: str) -> list[str]:
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) else f" (value {value!r})"
        problems.append(f"{where}: field {field}{shown}: {err['msg']}")
    return problems
