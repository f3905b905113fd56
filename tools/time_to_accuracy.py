"""Time to accuracy, the convergence study's headline: how many steps, and how much wall time on
the emulated two-node cluster, each schedule needs to reach the target held-out loss.

The target is the data-parallel baseline's final held-out loss plus 1%, per seed: a run is
compared with the baseline run of the same data-order seed (a paired comparison: some orders are
harder for every schedule), and the table shows the mean target. A run reaches it at its first evaluation whose held-out loss is at or below the target (so the step
count is a multiple of the evaluation cadence); a run that never does is "not reached". The wall
time is those steps times the schedule's median step time measured by tools/bench.py on the
emulated cluster (two nodes, shaped link) at the example's shape: the bench's results.json, run
with that shape, is given to tools/convergence.py as --step-times EXAMPLE=FILE (or FILE1+FILE2+...
for several bench rounds: the median over them).

Pure functions over the runs' metrics; tools/convergence.py calls them.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

TARGET_MARGIN_PCT = 1.0


def target_loss(baseline_final_losses: list[float]) -> float:
    return statistics.fmean(baseline_final_losses) * (1 + TARGET_MARGIN_PCT / 100)


def steps_to_target(evals: list[dict], target: float) -> int | None:
    """First evaluated step whose held-out loss is <= target, or None."""
    for e in evals:
        if e["loss"] <= target:
            return int(e["step"])
    return None


def load_step_times(paths: str | Path, config: str = "two_nodes") -> dict[str, float]:
    """{schedule: median step seconds} of tools/bench.py results.json files' two-node runs;
    several files joined by '+' (rounds of the bench, schedule order rotated) give the median
    over the files."""
    per_schedule: dict[str, list[float]] = {}
    for path in str(paths).split("+"):
        runs = json.loads(Path(path).read_text())["runs"].get(config, {})
        if not runs:
            raise SystemExit(f"--step-times {path}: no {config!r} runs in it (a tools/bench.py results.json)")
        for name, r in runs.items():
            if r.get("median_step_s"):
                per_schedule.setdefault(name, []).append(r["median_step_s"])
    return {name: statistics.median(xs) for name, xs in per_schedule.items()}


def bench_name(schedule: str) -> str:
    """The bench run that times a convergence run: a staleness variant (hippie:none) times as its
    schedule (the correction's extra time is in the engine's step either way)."""
    return schedule.split(":")[0]


def summarize(metrics_by_name: dict[str, list[dict]], baseline: str, step_times: dict[str, float] | None) -> dict:
    """Per schedule: steps to the target of each seed, mean and spread where every seed reached
    it, and the emulated wall time (steps x median step time) when the bench measured the
    schedule. Runs carry their data-order ``seed``; a run whose seed the baseline lacks is skipped."""
    targets = {m.get("seed"): target_loss([m["final"]["loss"]]) for m in metrics_by_name[baseline]}
    rows = {}
    for name, runs in metrics_by_name.items():
        runs = [m for m in runs if m.get("seed") in targets]
        steps = [steps_to_target(m["eval"], targets[m.get("seed")]) for m in runs]
        reached = [s for s in steps if s is not None]
        row = {"steps_per_seed": steps, "reached": len(reached), "seeds": len(steps),
               "steps_mean": statistics.fmean(reached) if len(reached) == len(steps) else None,
               "steps_range": [min(reached), max(reached)] if reached else None}
        step_s = None if step_times is None else step_times.get(bench_name(name))
        row["median_step_s"] = step_s
        if step_s is not None and row["steps_mean"] is not None:
            row["wall_s_mean"] = row["steps_mean"] * step_s
            row["wall_s_range"] = [row["steps_range"][0] * step_s, row["steps_range"][1] * step_s]
        rows[name] = row
    base = rows[baseline]
    for row in rows.values():
        if row.get("wall_s_mean") is not None and base.get("wall_s_mean"):
            row["wall_vs_baseline"] = row["wall_s_mean"] / base["wall_s_mean"]
    return {"target_loss": statistics.fmean(targets.values()), "targets_per_seed": targets,
            "margin_pct": TARGET_MARGIN_PCT, "rows": rows}


def markdown(example: str, tta: dict, baseline: str) -> list[str]:
    lines = [f"**{example}**: target held-out loss: `{baseline}`'s final + {tta['margin_pct']:g}% of the same "
             f"seed (mean {tta['target_loss']:.4f})", "",
             "| schedule | reached | steps to target (mean, range) | median step (s, emulated 2 nodes) | "
             "wall time to target (s) | vs dp |", "|---|---|---|---|---|---|"]
    for name, r in tta["rows"].items():
        if r["steps_mean"] is not None:
            lo, hi = r["steps_range"]
            steps = f"{r['steps_mean']:.0f} ({lo}-{hi})"
        else:
            steps = "not reached" + (f" by {r['seeds'] - r['reached']} of {r['seeds']} seeds" if r["reached"] else "")
        step_s = "" if r["median_step_s"] is None else f"{r['median_step_s']:.3f}"
        wall = "" if r.get("wall_s_mean") is None else \
            f"{r['wall_s_mean']:.1f} ({r['wall_s_range'][0]:.1f}-{r['wall_s_range'][1]:.1f})"
        ratio = "" if r.get("wall_vs_baseline") is None or name == baseline else f"{r['wall_vs_baseline']:.2f}x"
        lines.append(f"| `{name}` | {r['reached']}/{r['seeds']} | {steps} | {step_s} | {wall} | {ratio} |")
    return lines + [""]


def plot_wall(ax, curves: dict, step_times: dict[str, float], target: float):
    """Held-out loss against emulated wall time (steps x median step time)."""
    for i, (name, c) in enumerate(curves.items()):
        step_s = step_times.get(bench_name(name))
        if step_s is None:
            continue
        ax.plot([e["step"] * step_s for e in c["eval"]], [e["loss"] for e in c["eval"]], color=f"C{i}", lw=1.2,
                marker="o", ms=3, mfc="none", label=name)
    ax.axhline(target, color="k", lw=0.8, ls=":", label="target")
    ax.set_xlabel("emulated wall time on two nodes (s) = steps x bench median step time")
    ax.set_ylabel("held-out loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
