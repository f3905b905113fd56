"""The cut sweep's figures (``python -m tools.bench cut-sweep``, :mod:`tools.bench.studies.cut_sweep`):
measured against predicted ranking, and the measured best. Pure Python: per candidate, one
measured step per round (the median of that run's timed steps); the plan is candidate 0.

* a candidate's measured step: the median over rounds; its ratio to the plan: per round (the
  runs of one round share the machine's state), median and range over rounds;
* the measured best: the least median step; it "holds" when it is at most the plan's in every round;
* the plan's miss: its median step over the best's, less 1 (the target: at most 5%);
* with every timed step given, a candidate's lower quartile over all its steps of all rounds too:
  on a busy machine the steps the job had the cores to itself, ranked beside the medians.
"""

from __future__ import annotations

import statistics
from typing import Sequence

TARGET = 0.05  # the plan's measured step within 5% of the best candidate's


def ranks(values: Sequence[float]) -> list[int]:
    """1-based rank of each value (1: the least)."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    out = [0] * len(values)
    for r, i in enumerate(order, 1):
        out[i] = r
    return out


def summarize(
    candidates: Sequence[dict], measured: Sequence[Sequence[float]], timed: Sequence[Sequence[float]] | None = None
) -> dict:
    """``candidates``: one dict per candidate (``label``, ``predicted_step`` in s; candidate 0 the
    plan); ``measured[c][r]``: candidate c's measured step in round r; ``timed[c]``: every timed
    step of candidate c (optional: the lower quartiles). The figures above."""
    if not candidates or len(measured) != len(candidates) or any(not m for m in measured):
        raise ValueError("every candidate needs a measured step in every round")
    rounds = min(len(m) for m in measured)
    medians = [statistics.median(m[:rounds]) for m in measured]
    rows = []
    for c, (cand, steps) in enumerate(zip(candidates, measured)):
        ratios = [steps[r] / measured[0][r] for r in range(rounds)]
        rows.append(
            dict(
                cand,
                measured_steps=list(steps[:rounds]),
                measured_step=medians[c],
                vs_plan=statistics.median(ratios),
                vs_plan_range=[min(ratios), max(ratios)],
            )
        )
    predicted = ranks([c["predicted_step"] for c in candidates])
    measured_ranks = ranks(medians)
    for row, p, m in zip(rows, predicted, measured_ranks):
        row.update(predicted_rank=p, measured_rank=m)
    if timed is not None:
        quiet = [statistics.quantiles(t, n=4, method="inclusive")[0] if len(t) > 1 else t[0] for t in timed]
        for row, q, r in zip(rows, quiet, ranks(quiet)):
            row.update(lower_quartile=q, lower_quartile_rank=r)
    best = measured_ranks.index(1)
    holds = all(measured[best][r] <= measured[0][r] for r in range(rounds))
    miss = medians[0] / medians[best] - 1
    return {
        "rounds": rounds,
        "candidates": rows,
        "best": best,
        "best_holds_every_round": holds and best != 0,
        "plan_over_best": miss,
        "target": TARGET,
        "target_met": miss <= TARGET,
        "same_ranking": predicted == measured_ranks,
    }


def report(summary: dict, header: Sequence[str] = ()) -> str:
    """A markdown report of :func:`summarize`'s figures."""
    lines = list(header) + [
        "",
        "| candidate | schedule | boundaries | predicted ms | predicted rank | measured ms, "
        "median (rounds) | measured / plan, median (range) | measured rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    quiet = "lower_quartile" in summary["candidates"][0]
    if quiet:
        lines[-2] += " lower quartile ms (rank) |"
        lines[-1] += "---|"
    for i, row in enumerate(summary["candidates"]):
        label = ("**" + row["label"] + "**") if i == summary["best"] else row["label"]
        lo, hi = row["vs_plan_range"]
        lines.append(
            f"| {label} | {row['schedule']} | `{row['boundaries']}` | {row['predicted_step'] * 1e3:.1f} | "
            f"{row['predicted_rank']} | {row['measured_step'] * 1e3:.1f} "
            f"({', '.join(f'{s * 1e3:.1f}' for s in row['measured_steps'])}) | {row['vs_plan']:.3f} "
            f"({lo:.3f}-{hi:.3f}) | {row['measured_rank']} |"
            + (f" {row['lower_quartile'] * 1e3:.1f} ({row['lower_quartile_rank']}) |" if quiet else "")
        )
    best = summary["candidates"][summary["best"]]
    verdict = "met" if summary["target_met"] else "missed"
    lines += [
        "",
        f"Measured best: {best['label']} (`{best['boundaries']}`, {best['schedule']})"
        + (
            ", faster than the plan in every round"
            if summary["best_holds_every_round"]
            else ""
            if summary["best"] == 0
            else ", not faster than the plan in every round"
        )
        + f". The plan's measured step is {summary['plan_over_best'] * 100:+.1f}% over the best's over "
        f"{summary['rounds']} round(s): the {summary['target'] * 100:.0f}% target is {verdict}. Predicted and "
        f"measured ranking {'agree' if summary['same_ranking'] else 'differ'}.",
    ]
    return "\n".join(lines) + "\n"
