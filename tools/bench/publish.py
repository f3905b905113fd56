"""``--publish DIR``, once for every study: copy a run's report files into DIR (docs/bench/...)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

from tools.bench.cluster import fix_owner


def publish(dest: str | Path | None, files: Iterable[str | Path], base: str | Path | None = None) -> Path | None:
    """Copy ``files`` (paths, or names under ``base``) into ``dest``, created; files written under
    sudo are given back to the invoking user. ``dest`` None: nothing (no ``--publish``)."""
    if not dest:
        return None
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        src = Path(base, f) if base is not None else Path(f)
        shutil.copy2(src, dest / src.name)
    fix_owner(dest)
    return dest
