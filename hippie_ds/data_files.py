"""Reading the project's data files (costs, clusters, profiles, plans) and reporting their
validation errors: one place, so every file error names the path, the format and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


def read_data_file(path: str | Path, what: str, error: type[Exception]) -> Any:
    """Parse a JSON (``.json``) or YAML (anything else) file; ``error`` names the problem."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} file {str(path)!r} does not exist")
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        text = path.read_text()
        return json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise error(f"{path}: not valid {kind}: {exc}") from None


def write_data_file(path: str | Path, data: Any, default: str = "json") -> Path:
    """Write ``data`` as YAML (.yaml/.yml) or JSON (.json); another suffix gets ``default``; the
    folder is created. The one writer of costs, profiles and plans."""
    path = Path(path)
    suffix = path.suffix.lower()
    fmt = "yaml" if suffix in (".yaml", ".yml") else "json" if suffix == ".json" else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False) if fmt == "yaml" else json.dumps(data, indent=1) + "\n")
    return path


def describe(exc: ValidationError, where: str) -> list[str]:
    """One line per pydantic error: where, field, value, what is wrong."""
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) else f" (value {value!r})"
        problems.append(f"{where}: field {field}{shown}: {err['msg']}")
    return problems
