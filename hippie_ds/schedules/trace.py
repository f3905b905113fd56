"""Timelines as Chrome traces (chrome://tracing, Perfetto) and PNG Gantt charts.

An event is ``(stage, name, category, start, end, micro_batch)`` (the simulator's
``SimEvent``) or a mapping with those keys, where ``rank`` may stand for ``stage`` (timelines
measured per rank by the engine) and ``cat`` for ``category``. Category ``'comm'`` is drawn on
the communication track (all-reduces, non-blocking sends in flight); every other category is
the rank's stream (forward, backward, forward_backward, p2p, allreduce, optimizer, sync, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

from .ir import CATEGORY, COMPUTE_KINDS

COMM = "comm"


class _Ev(NamedTuple):
    pid: int
    name: str
    category: str
    start: float
    end: float
    micro_batch: int | None
    process: str  # default process name


def _normalise(events: Iterable[Any]) -> list[_Ev]:
    out = []
    for i, e in enumerate(events):
        if isinstance(e, Mapping):
            if "rank" in e:
                pid = int(e["rank"])
                process = f"rank {pid}" + (f" (stage {e['stage']})" if e.get("stage") is not None else "")
            elif "stage" in e:
                pid, process = int(e["stage"]), f"stage {e['stage']}"
            else:
                raise ValueError(f"event {i}: needs a 'stage' or 'rank' key: {dict(e)}")
            try:
                name, start, end = str(e["name"]), float(e["start"]), float(e["end"])
            except KeyError as exc:
                raise ValueError(f"event {i}: missing key {exc.args[0]!r}: {dict(e)}") from None
            category = str(e.get("category", e.get("cat", "")))
            mb = e.get("micro_batch")
        else:
            try:
                stage, name, category, start, end, mb = e
            except (TypeError, ValueError):
                raise ValueError(
                    f"event {i}: expected (stage, name, category, start, end, micro_batch), got {e!r}"
                ) from None
            pid, process = int(stage), f"stage {stage}"
            name, category, start, end = str(name), str(category), float(start), float(end)
        if end < start:
            raise ValueError(f"event {i} ({name}): ends at {end} before it starts at {start}")
        out.append(_Ev(pid, name, category, start, end, None if mb is None else int(mb), process))
    return out


def chrome_trace(
    events: Iterable[Any],
    path: str | Path | None = None,
    time_unit_s: float = 1.0,
    process_names: Mapping[int, str] | None = None,
) -> dict:
    """Write (when ``path`` is given) and return a Chrome trace: one complete ('X') event per
    input event, pid = stage or rank, tid 0 = stream, tid 1 = communication, times in
    microseconds (``time_unit_s`` = seconds per unit of the events' times)."""
    evs = _normalise(events)
    scale = time_unit_s * 1e6
    names: dict[int, str] = {}
    for e in evs:
        names.setdefault(e.pid, e.process)
    names.update(process_names or {})
    trace: list[dict] = []
    for pid in sorted(names):
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": names[pid]}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, label in ((0, "compute"), (1, "comm")):
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
    for e in evs:
        args: dict[str, Any] = {"category": e.category}
        if e.micro_batch is not None:
            args["micro_batch"] = e.micro_batch
        trace.append(
            {
                "ph": "X",
                "name": e.name,
                "cat": e.category or "op",
                "pid": e.pid,
                "tid": 1 if e.category == COMM else 0,
                "ts": e.start * scale,
                "dur": (e.end - e.start) * scale,
                "args": args,
            }
        )
    doc = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(doc))
    return doc


_ASYNC_SEND = "async_send"  # drawing key only: a non-blocking send in flight on the comm track
_COMPUTE = frozenset(CATEGORY[k] for k in COMPUTE_KINDS)  # the compute ops' categories: boxes with micro-batch numbers
_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "forward_backward": "#8172b2",
    COMM: "#dd8452",
    _ASYNC_SEND: "#f0b27a",
    "p2p": "#d9d9d9",
    "allreduce": "#c44e52",
    "optimizer": "#937860",
    "sync": "#bdbdbd",
    "buffer": "#da8bc3",
    "weights": "#8c8c8c",
    "backward_input": "#55a868",
    "backward_weight": "#2f6b3a",
}
_LEGEND = [
    ("forward", "forward"),
    ("backward", "backward"),
    ("forward_backward", "fused F+B"),
    ("backward_input", "backward_input (B)"),
    ("backward_weight", "backward_weight (W)"),
    (COMM, "all-reduce"),
    (_ASYNC_SEND, "async send in flight"),
    ("allreduce", "waiting for all-reduce"),
    ("optimizer", "update"),
    ("p2p", "blocked in send/recv"),
    ("sync", "pipeline sync"),
]


def timeline_png(events: Iterable[Any], path: str | Path, title: str = "", time_unit: str = "s") -> None:
    """Gantt chart: one row per stage/rank (its stream) with a thin communication row under
    it; micro-batch numbers in boxes wide enough to hold them. Zero-length events are skipped."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    every = _normalise(events)
    evs = [e for e in every if e.end > e.start]
    pids = sorted({e.pid for e in every}) or [0]
    names: dict[int, str] = {}
    for e in every:
        names.setdefault(e.pid, e.process)
    t0 = min((e.start for e in evs), default=0.0)
    t1 = max((e.end for e in evs), default=1.0)
    span = (t1 - t0) or 1.0

    fig, ax = plt.subplots(
        figsize=(max(8.0, min(24.0, 4 + 0.12 * len(evs) / max(len(pids), 1))), 1.0 + 0.75 * len(pids))
    )
    row = {pid: i for i, pid in enumerate(pids)}
    for e in evs:
        y = row[e.pid]
        comm = e.category == COMM
        bottom, height = (y + 0.32, 0.22) if comm else (y - 0.35, 0.6)
        # On the comm track, all-reduces and (overlapping, translucent) sends in flight differ.
        key = _ASYNC_SEND if comm and not e.name.startswith("allreduce") else e.category
        colour = _COLOURS.get(key, "#8c8c8c")
        ax.broken_barh(
            [(e.start, e.end - e.start)],
            (bottom, height),
            facecolors=colour,
            edgecolors="white" if not comm else "none",
            linewidth=0.4,
            alpha=0.5 if key == _ASYNC_SEND else 1.0,
        )
        wide = (e.end - e.start) / span > 0.012 * (1 + len(str(e.micro_batch)))
        if e.micro_batch is not None and e.category in _COMPUTE and wide:
            ax.text(
                (e.start + e.end) / 2,
                bottom + height / 2,
                str(e.micro_batch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(len(pids)))
    ax.set_yticklabels([names.get(p, str(p)) for p in pids])
    ax.set_ylim(len(pids) - 0.4, -0.6)  # stage 0 on top
    ax.set_xlim(t0, t1 + 0.01 * span)
    ax.set_xlabel(f"time ({time_unit})")
    if title:
        ax.set_title(title)
    used = {e.category for e in evs} | (
        {_ASYNC_SEND} if any(e.category == COMM and not e.name.startswith("allreduce") for e in evs) else set()
    )
    handles = [Patch(color=_COLOURS[c], label=label) for c, label in _LEGEND if c in used]
    if handles:
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.18 if len(pids) > 2 else -0.3),
            ncol=min(5, len(handles)),
            fontsize=7,
            frameon=False,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
