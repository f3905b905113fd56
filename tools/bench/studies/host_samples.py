"""The host's CPU per instruction kind, from a study's runs: every rank records, per timed step, the
CPU its main thread spent in each instruction class (tools/bench/workers/instruction_cpu.py); here
each (rank, kind) becomes one :class:`hippie_ds.planner.host.Sample` with the layers its stage runs
and re-computes (the steps file's ``parts`` and ``checkpointed_layers``), and
:func:`hippie_ds.planner.host.fit_host_cost` fits the kinds' fixed and per-layer terms over them."""

from __future__ import annotations

import json
from pathlib import Path

from hippie_ds.planner.host import HostCost, Sample, fit_host_cost, host_kind


def rank_samples(record: dict) -> list[Sample]:
    """One rank's steps file -> its samples (timed steps only; DP and one-device runs have no stage
    layout and give none). Pure."""
    parts, stage = record.get("parts"), record.get("stage")
    if not parts or stage is None or record.get("schedule") == "dp" or len(parts) < 2:
        return []
    first, end = parts[stage], parts[stage + 1]
    recomputed = sum(first <= i < end for i in record.get("checkpointed_layers") or [])
    totals: dict[str, list] = {}
    for step in record.get("steps", []):
        if step.get("warmup"):
            continue
        for cls, (count, cpu) in (step.get("cpu_by_instruction") or {}).items():
            t = totals.setdefault(host_kind(cls), [0, 0.0])
            t[0] += count
            t[1] += cpu
    # a forward or the optimizer step re-computes nothing; only a backward carries the re-computed layers
    return [
        Sample(kind, end - first, recomputed if kind == "backward" else 0, n, cpu)
        for kind, (n, cpu) in sorted(totals.items())
        if kind != "other" and n
    ]


def fit_runs(runs_dir: Path, source: str = "") -> HostCost | None:
    """The host cost fitted over every rank of every pipeline run under ``runs_dir``
    (RUN/raw/LABEL/rank*.steps.json); None when no run recorded its instructions' CPU."""
    samples = []
    for f in sorted(Path(runs_dir).glob("*/raw/*/rank*.steps.json")):
        samples += rank_samples(json.loads(f.read_text()))
    return fit_host_cost(samples, source=source) if samples else None
