"""The split backward as the engine runs it beside what a profile charges: per stage,
from the engine's timelines (``hippie.timeline_dir``) zb-h1's I (``BackwardInputPass``) and W
(``BackwardWeightPass``) and 1f1b's whole backward (``BackwardPass``), medians and lower quartiles
over the instructions of the recorded steps after ``--skip`` (warm-up and in-place profiling); from a
layer profile cut at the stages (``--boundaries``, default DeepSpeed's uniform), the backward B, W,
the old charge I = B - W and the engine's I = B - W + split_extra. Pure: reads the files.

    python -m tools.bench split-backward --zb OUT_ZB/timeline --whole OUT_1F1B/timeline \\
        --profile profile.yaml [--boundaries 0,5,10] [--skip 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def instruction_times(timeline_dir: str | Path, skip: int) -> dict[int, dict[str, list[float]]]:
    """{stage: {instruction kind: seconds of each instruction}} after each rank's first ``skip`` steps."""
    out: dict[int, dict[str, list[float]]] = {}
    for f in sorted(Path(timeline_dir).glob("rank*.json")):
        tl = json.loads(f.read_text())
        kept = set(sorted({e["step"] for e in tl["events"]})[skip:])
        per = out.setdefault(int(tl["stage"]), {})
        for e in tl["events"]:
            if e["step"] in kept:
                per.setdefault(e["kind"], []).append(e["end"] - e["start"])
    return out


def summary(values: list[float]) -> tuple[float, float]:
    """(median, lower quartile) in ms; (0, 0) when none."""
    if not values:
        return 0.0, 0.0
    low = statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]
    return statistics.median(values) * 1e3, low * 1e3


def profile_charges(profile, parts) -> list[dict[str, float]]:
    """Per stage in ms: B, W, the old I (B - W) and the engine's (B - W + split_extra); the first stage
    runs its whole backward as W when its data needs no gradient (no split_extra on its first layer)."""
    out = []
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        layers = profile.layers[a:b] + ([profile.loss] if b == profile.num_layers and profile.loss else [])
        bw = sum(x.backward for x in layers)
        whole = s == 0 and profile.layers[0].split_extra is None
        w = bw if whole else sum(x.weight_time for x in layers)
        extra = 0.0 if whole else sum(x.split_time for x in layers)
        out.append({"B": bw * 1e3, "W": w * 1e3, "I_old": (bw - w) * 1e3, "I": (bw - w + extra) * 1e3})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zb", required=True, help="zb-h1's timeline folder")
    p.add_argument("--whole", required=True, help="1f1b's timeline folder (the same model and partition)")
    p.add_argument("--profile", required=True)
    p.add_argument("--boundaries", default=None, help="DeepSpeed parts, e.g. 0,5,10 (default: uniform)")
    p.add_argument("--skip", type=int, default=4, help="recorded steps left out first (warm-up, profiling)")
    a = p.parse_args(argv)
    from hippie_ds.planner import load_profile
    from hippie_ds.planner.partition import uniform

    profile = load_profile(a.profile)
    zb, whole = instruction_times(a.zb, a.skip), instruction_times(a.whole, a.skip)
    parts = [int(x) for x in a.boundaries.split(",")] if a.boundaries else uniform(profile.num_layers, len(zb))
    print(f"boundaries {parts}; profile load {profile.load}")
    print(
        "stage | zb-h1 I | zb-h1 W | I + W | 1f1b whole B | (I + W) / B | profile B | W | I = B - W | "
        "I = B - W + split_extra  (ms: median / lower quartile of the timelines)"
    )
    for s, charge in enumerate(profile_charges(profile, parts)):
        i, w = summary(zb[s].get("BackwardInputPass", [])), summary(zb[s].get("BackwardWeightPass", []))
        b = summary(whole[s].get("BackwardPass", []))
        ratio = [(x + y) / z if z else float("nan") for x, y, z in zip(i, w, b)]
        print(
            f"{s} | {i[0]:.1f} / {i[1]:.1f} | {w[0]:.1f} / {w[1]:.1f} | {i[0] + w[0]:.1f} / {i[1] + w[1]:.1f} | "
            f"{b[0]:.1f} / {b[1]:.1f} | {ratio[0]:.2f} / {ratio[1]:.2f} | {charge['B']:.1f} | {charge['W']:.1f} | "
            f"{charge['I_old']:.1f} | {charge['I']:.1f}"
        )
