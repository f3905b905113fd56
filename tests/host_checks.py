"""What the distributed tests need of the host, checked once before the first launch, so that a
missing piece fails the run at once with its reason instead of hanging or crashing ranks later
(docs/training.md, "What the suite needs of the machine").

- /dev/shm room for DeepSpeed's CPU all-reduce: one 66 MiB segment per local rank (the tests launch
  4 at most at once); with too little the second rank segfaults at start-up.
- DeepSpeed's CPU ops, JIT-built on first use with ninja and g++ (the shm all-reduce; FusedAdam for
  ``"type": "Adam"``): built here, once, before any rank is timed, into the folder the ranks use. A
  build lock left by a build that was killed would make every later rank wait for ever: removed
  when it is older than any build takes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_NEEDED = 4 * 66 * 2**20 + 64 * 2**20  # 4 ranks' segments and some slack
STALE_LOCK_S = 15 * 60  # a build takes 40-100 s on 2 cores
OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")


def shm_problem(path: str = "/dev/shm", needed: int = SHM_NEEDED) -> str | None:
    """Why /dev/shm cannot hold the tests' all-reduce segments, or None."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"{path} is not there ({e}); DeepSpeed's CPU all-reduce maps its buffers from it"
    free = st.f_bavail * st.f_frsize
    if free < needed:
        return (
            f"{path} has {free / 2**20:.0f} MiB free; the distributed tests need {needed / 2**20:.0f} MiB "
            f"(DeepSpeed's CPU all-reduce: 66 MiB a local rank, 4 ranks at once)"
        )
    return None


def environment():
    """The build folder and PATH the ranks get (tools.bench.cluster.local_env), here too: the pytest
    process builds into the same folder, with the venv's ninja."""
    from tools.bench.cluster.processes import local_env

    ranks = local_env()
    os.environ.update({key: ranks[key] for key in ("PATH", "TORCH_EXTENSIONS_DIR")})


def remove_stale_locks(root: str | None = None, now: float | None = None, stale_s: float = STALE_LOCK_S) -> list[str]:
    """torch's build lock files (``<op>/lock``) older than ``stale_s``: a build killed mid-way left them."""
    root = Path(root or os.environ["TORCH_EXTENSIONS_DIR"])
    now = time.time() if now is None else now
    removed = []
    for lock in root.glob("*/lock"):
        try:
            if now - lock.stat().st_mtime > stale_s:
                lock.unlink()
                removed.append(str(lock))
        except OSError:
            pass
    return removed


def build_ops() -> list[str]:
    """JIT-build (or load) DeepSpeed's CPU ops the tests use; one line per op with its seconds."""
    from deepspeed.accelerator import get_accelerator

    lines = []
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible():
            lines.append(f"{name}: not built for this accelerator")
            continue
        start = time.monotonic()
        builder.load(verbose=False)
        lines.append(f"{name}: ready in {time.monotonic() - start:.1f} s")
    return lines
