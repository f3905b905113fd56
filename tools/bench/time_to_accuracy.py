"""Time to accuracy, the convergence study's headline: how many steps, and how much wall time on
the emulated two-node cluster, each schedule needs to reach the target held-out loss.

The target is the data-parallel baseline's final held-out loss plus 1%, per seed: a run is
compared with the baseline run of the same data-order seed (a paired comparison: some orders are
harder for every schedule), and the table shows the mean target. A run reaches it at its first
evaluation whose held-out loss is at or below the target (so the step count is a multiple of the
evaluation cadence); a run that never does is "not reached".

The wall time is those steps times the schedule's median step time measured by python -m tools.bench on
the emulated cluster (two nodes, shaped link) at the example's shape. python -m tools.bench convergence takes
the bench's results.json files as --step-times EXAMPLE=FILE1+FILE2+...: files are grouped by
their link (the bench config's ``link``, e.g. "tbf 250mbit"), one table column group per link,
and a file's rounds (``round_median_step_s``; a single-round file is one round) are that link's
rounds. A run is timed by the bench run of its own label where there is one (e.g.
2bw:extrapolate-made+ef=0.5), else by its schedule's (hippie:none by hippie). Ratios to stock
1F1B are taken per round (the bench rotates the schedule order, so a
round's schedules ran side by side) and reported as the median with the min-max spread; a
difference is **real** when the spread excludes 1.0, the benchmark's rule.

Pure functions over the runs' metrics; python -m tools.bench convergence calls them. :func:`price`
re-prices a committed comparison (a results.json's steps to target) with other step times.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

TARGET_MARGIN_PCT = 1.0
REFERENCE = "1f1b"  # what the time to target is compared with: stock DeepSpeed's 1F1B (the bench's "1f1b")


@dataclass
class StepTimes:
    """Step times of one link speed: ``rounds[r][schedule]`` = the median step (s) of that
    schedule's two-node run in round r."""

    link: str
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        xs = [r[name] for r in self.rounds if r.get(name)]
        return statistics.median(xs) if xs else None

    def round_ratios(self, name: str, reference: str) -> list[float]:
        """name's step over reference's, per round where both ran."""
        return [r[name] / r[reference] for r in self.rounds if r.get(name) and r.get(reference)]

    def timed_as(self, name: str) -> str:
        """The bench run that times a convergence run: its own label where the bench measured it
        (2bw:extrapolate-made+ef=0.5: error feedback's extra work), else :func:`bench_name`'s."""
        return name if any(r.get(name) for r in self.rounds) else bench_name(name)


def target_loss(baseline_final_losses: list[float]) -> float:
    return statistics.fmean(baseline_final_losses) * (1 + TARGET_MARGIN_PCT / 100)


def steps_to_target(evals: list[dict], target: float) -> int | None:
    """First evaluated step whose held-out loss is <= target, or None."""
    for e in evals:
        if e["loss"] <= target:
            return int(e["step"])
    return None


def load_step_times(paths: str | Path, config: str = "two_nodes") -> list[StepTimes]:
    """The two-node step times of python -m tools.bench results.json files joined by '+', one
    :class:`StepTimes` per link in the order the files name them."""
    by_link: dict[str, StepTimes] = {}
    for path in str(paths).split("+"):
        results = json.loads(Path(path).read_text())
        runs = results["runs"].get(config, {})
        if not runs:
            raise SystemExit(f"--step-times {path}: no {config!r} runs in it (a python -m tools.bench results.json)")
        link = results.get("config", {}).get("link", "link").replace("tbf ", "")
        n = max(len(r.get("round_median_step_s") or [None]) for r in runs.values())
        rounds = [{} for _ in range(n)]
        for name, r in runs.items():
            for i, step in enumerate(r.get("round_median_step_s") or [r.get("median_step_s")]):
                if step:
                    rounds[i][name] = step
        by_link.setdefault(link, StepTimes(link)).rounds.extend(rounds)
    return list(by_link.values())


def bench_name(schedule: str) -> str:
    """The bench run that times a convergence run the bench did not measure under its own label: a
    staleness variant (hippie:none) times as its schedule (the correction's extra time is in the
    engine's step either way)."""
    return schedule.split(":")[0]


def _steps_row(runs: list[dict], targets: dict) -> dict:
    steps = [steps_to_target(m["eval"], targets[m.get("seed")]) for m in runs]
    reached = [s for s in steps if s is not None]
    return {
        "steps_per_seed": steps,
        "reached": len(reached),
        "seeds": len(steps),
        "steps_mean": statistics.fmean(reached) if len(reached) == len(steps) else None,
        "steps_range": [min(reached), max(reached)] if reached else None,
    }


def _wall(row: dict, times: StepTimes, name: str, ref: dict | None) -> dict:
    """One link's wall time to target for a row, and its ratio to the reference per round."""
    timed_as = times.timed_as(name)
    step_s = times.median(timed_as)
    wall = {"median_step_s": step_s, "timed_as": timed_as}
    if step_s is None or row["steps_mean"] is None:
        return wall
    wall["wall_s_mean"] = row["steps_mean"] * step_s
    wall["wall_s_range"] = [row["steps_range"][0] * step_s, row["steps_range"][1] * step_s]
    if ref is not None and ref["steps_mean"] is not None:
        steps_ratio = row["steps_mean"] / ref["steps_mean"]
        ratios = [steps_ratio * x for x in times.round_ratios(timed_as, REFERENCE)]
        if ratios:
            wall["vs_reference"] = statistics.median(ratios)
            wall["vs_reference_range"] = [min(ratios), max(ratios)]
            wall["vs_reference_real"] = len(ratios) > 1 and (max(ratios) < 1 or min(ratios) > 1)
    return wall


def summarize(metrics_by_name: dict[str, list[dict]], baseline: str, step_times: list[StepTimes] | None) -> dict:
    """Per schedule: steps to the target of each seed, mean and spread where every seed reached
    it and, per link the bench measured, the emulated wall time (steps x median step time), its
    ratio to the baseline's and, when the reference (stock 1F1B) ran, to the reference's per
    round. Runs carry their data-order ``seed``; a run whose seed the baseline lacks is skipped."""
    targets = {m.get("seed"): target_loss([m["final"]["loss"]]) for m in metrics_by_name[baseline]}
    rows = {
        name: _steps_row([m for m in runs if m.get("seed") in targets], targets)
        for name, runs in metrics_by_name.items()
    }
    return price(
        {
            "target_loss": statistics.fmean(targets.values()),
            "targets_per_seed": targets,
            "margin_pct": TARGET_MARGIN_PCT,
            "reference": REFERENCE,
            "rows": rows,
        },
        baseline,
        step_times,
    )


def price(summary: dict, baseline: str, step_times: list[StepTimes] | None) -> dict:
    """``summary`` (:func:`summarize`'s, or a results.json's ``time_to_accuracy``) with its rows'
    wall-time columns made anew from their steps to target for the links of ``step_times``: how a
    committed comparison gets step times measured after it, without its runs. A copy."""
    rows = {name: {k: v for k, v in row.items() if k != "links"} for name, row in summary["rows"].items()}
    ref = rows.get(REFERENCE)
    for name, row in rows.items():
        row["links"] = {t.link: _wall(row, t, name, ref) for t in step_times or []}
    for link in (t.link for t in step_times or []):
        base = rows[baseline]["links"][link].get("wall_s_mean")
        for row in rows.values():
            if row["links"][link].get("wall_s_mean") is not None and base:
                row["links"][link]["wall_vs_baseline"] = row["links"][link]["wall_s_mean"] / base
    return {**summary, "links": [t.link for t in step_times or []], "rows": rows}


def _ratio_cell(w: dict, is_reference: bool) -> str:
    if is_reference or w.get("vs_reference") is None:
        return ""
    lo, hi = w["vs_reference_range"]
    return f"{w['vs_reference']:.2f}x [{lo:.2f}, {hi:.2f}]" + (" **real**" if w["vs_reference_real"] else "")


def markdown(example: str, tta: dict, baseline: str) -> list[str]:
    links, ref = tta.get("links", []), tta.get("reference", REFERENCE)
    lines = [
        f"**{example}**: target held-out loss: `{baseline}`'s final + {tta['margin_pct']:g}% of the same "
        f"seed (mean {tta['target_loss']:.4f})",
        "",
    ]
    head = "| schedule | reached | steps to target (mean, range) |"
    for link in links:
        head += f" {link}: median step (s) | {link}: wall time to target (s) | {link}: vs {ref} [rounds] |"
    lines += [head, "|" + "---|" * (3 + 3 * len(links))]
    for name, r in tta["rows"].items():
        if r["steps_mean"] is not None:
            lo, hi = r["steps_range"]
            steps = f"{r['steps_mean']:.0f} ({lo}-{hi})"
        else:
            steps = "not reached" + (f" by {r['seeds'] - r['reached']} of {r['seeds']} seeds" if r["reached"] else "")
        line = f"| `{name}` | {r['reached']}/{r['seeds']} | {steps} |"
        for link in links:
            w = r["links"][link]
            step_s = "" if w["median_step_s"] is None else f"{w['median_step_s']:.3f}"
            wall = (
                ""
                if w.get("wall_s_mean") is None
                else f"{w['wall_s_mean']:.1f} ({w['wall_s_range'][0]:.1f}-{w['wall_s_range'][1]:.1f})"
            )
            line += f" {step_s} | {wall} | {_ratio_cell(w, name == ref)} |"
        lines.append(line)
    return lines + [""]


def plot_wall(ax, curves: dict, times: StepTimes, target: float):
    """Held-out loss against emulated wall time (steps x median step time) at one link speed."""
    for i, (name, c) in enumerate(curves.items()):
        step_s = times.median(times.timed_as(name))
        if step_s is None:
            continue
        ax.plot(
            [e["step"] * step_s for e in c["eval"]],
            [e["loss"] for e in c["eval"]],
            color=f"C{i}",
            lw=1.2,
            marker="o",
            ms=3,
            mfc="none",
            label=name,
        )
    ax.axhline(target, color="k", lw=0.8, ls=":", label="target")
    ax.set_xlabel(f"emulated wall time, 2 nodes at {times.link} (s): steps x median step")
    ax.set_ylabel("held-out loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
