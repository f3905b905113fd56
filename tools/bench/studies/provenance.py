"""Where a bench's figures come from: the commit and uncommitted files of the code that ran, and the machine."""

from __future__ import annotations

from pathlib import Path


def source_state() -> dict:
    """The commit the run measured and the files of the code it ran that differ from it (a tree
    shared with other work: the planner's uncommitted changes plan too)."""
    import subprocess

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    dirty = git("status", "--porcelain", "--", "hippie_ds", "tools/bench", "schedules")
    return {
        "commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "uncommitted": [line[3:] for line in (dirty or "").splitlines() if line.strip()],
    }


def machine() -> dict:
    """The machine that gave the figures: host, CPU model, cores, load when the run ended."""
    import os
    import platform

    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else None
    )
    return {
        "host": platform.node(),
        "cpu": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "load_average": list(os.getloadavg()),
    }
