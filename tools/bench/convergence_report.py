"""The convergence comparison's results, for python -m tools.bench convergence: per example the final held-out
loss/accuracy of each schedule against data parallelism's (targets: within 1% loss, 0.5 points
accuracy), mean over seeds with the spread, time to accuracy (time_to_accuracy.py here), the
markdown table and the learning-curve pictures. Pure functions of the runs' metrics files
(matplotlib for the pictures)."""

from __future__ import annotations

from pathlib import Path

from tools.bench import time_to_accuracy as tta

BASELINE = "dp"
LOSS_TARGET_PCT, ACCURACY_TARGET_POINTS = 1.0, 0.5


def smooth(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _mean(values):
    return sum(values) / len(values)


def _mean_curves(runs: list[dict]) -> dict:
    """Train loss and evaluations averaged over the seeds' runs (same steps in all)."""
    train = [_mean(v) for v in zip(*(m["train_loss"] for m in runs))]
    evals = []
    for points in zip(*(m["eval"] for m in runs)):
        evals.append(
            {"step": points[0]["step"], **{k: _mean([p[k] for p in points]) for k in points[0] if k != "step"}}
        )
    return {"train_loss": train, "eval": evals}


def summarize(runs: dict[str, dict[str, list[dict]]], step_times: dict[str, list] | None = None) -> dict:
    """runs[example][name] = the metrics of that run, one per seed; step_times[example] = the
    bench's step times per link (time_to_accuracy.py's StepTimes)."""
    results = {}
    for example, by_name in runs.items():
        base = by_name.get(BASELINE)
        base_loss = None if base is None else _mean([m["final"]["loss"] for m in base])
        base_acc = (
            None
            if base is None or base[0]["final"].get("accuracy") is None
            else _mean([m["final"]["accuracy"] for m in base])
        )
        rows = {}
        for name, ms in by_name.items():
            m = ms[0]
            losses = [r["final"]["loss"] for r in ms]
            accs = None if m["final"].get("accuracy") is None else [r["final"]["accuracy"] for r in ms]
            speeds = [r.get("steady_samples_per_s") or r.get("samples_per_s") for r in ms]
            row = {
                "loss": _mean(losses),
                "accuracy": None if accs is None else _mean(accs),
                "steps": m["steps"],
                "seeds": [r["seed"] for r in ms],
                "loss_per_seed": losses,
                "accuracy_per_seed": accs,
                "samples_per_s": None if None in speeds else _mean(speeds),
                "job_seconds": [r.get("job_seconds") for r in ms],
                "schedule_params": m.get("schedule_params"),
                # per stage, the share of its gradient applied one step late (runs before it: absent)
                "delayed_fraction": m.get("delayed_fraction"),
                "layout": (
                    f"{m['replicas']} replicas"
                    if m["mode"] == "data-parallel"
                    else f"{m['stages']} stages x {m['replicas']} replicas"
                ),
            }
            if base_loss is not None:
                row["loss_diff_pct"] = 100.0 * (row["loss"] - base_loss) / base_loss
                row["loss_within_target"] = row["loss_diff_pct"] <= LOSS_TARGET_PCT  # lower than dp meets it
                if accs is not None and base_acc is not None:
                    row["accuracy_diff_points"] = 100.0 * (row["accuracy"] - base_acc)
                    row["accuracy_within_target"] = row["accuracy_diff_points"] >= -ACCURACY_TARGET_POINTS
            rows[name] = row
        first = next(iter(by_name.values()))[0]
        results[example] = {
            "global_batch": first["global_batch"],
            "steps": first["steps"],
            "lr": first.get("lr"),
            "seeds": [r["seed"] for r in next(iter(by_name.values()))],
            "runs": rows,
            "curves": {n: _mean_curves(ms) for n, ms in by_name.items()},
        }
        if base is not None:
            results[example]["time_to_accuracy"] = tta.summarize(by_name, BASELINE, (step_times or {}).get(example))
    return results


def markdown(results: dict, clipping: str | None = None) -> str:
    lines = [
        f"Targets: held-out loss within {LOSS_TARGET_PCT:g}% and accuracy within {ACCURACY_TARGET_POINTS:g} "
        f"points of `{BASELINE}` (data parallelism). Negative differences are lower than `{BASELINE}`."
        + (f" Gradient clipping: {clipping}." if clipping else ""),
        "",
    ]
    lines += [
        "| example | schedule | layout | steps | held-out loss | vs dp | accuracy | vs dp | samples/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for example, res in results.items():
        for name, r in res["runs"].items():
            acc = "" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%"
            dl = (
                ""
                if name == BASELINE or "loss_diff_pct" not in r
                else f"{r['loss_diff_pct']:+.2f}%{'' if r['loss_within_target'] else ' (!)'}"
            )
            da = (
                ""
                if name == BASELINE or "accuracy_diff_points" not in r
                else f"{r['accuracy_diff_points']:+.2f} pt{'' if r['accuracy_within_target'] else ' (!)'}"
            )
            sps = "" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}"
            loss = f"{r['loss']:.4f}"
            if len(r.get("loss_per_seed") or []) > 1:  # the spread over seeds
                loss += f" ({min(r['loss_per_seed']):.4f}-{max(r['loss_per_seed']):.4f})"
                if r["accuracy_per_seed"]:
                    acc += f" ({100 * min(r['accuracy_per_seed']):.2f}-{100 * max(r['accuracy_per_seed']):.2f})"
            lines.append(
                f"| {example} | `{name}` | {r['layout']} | {r['steps']} | {loss} | {dl} | {acc} | {da} | {sps} |"
            )
    lines += [""]
    for example, res in results.items():
        if "time_to_accuracy" in res:
            lines += tta.markdown(example, res["time_to_accuracy"], BASELINE)
    lines += [
        "(!) outside the target. samples/s: steady-state training throughput of the run on this "
        "machine (all ranks share its cores), not a speed comparison."
    ]
    if any("1f1b" in res["runs"] and BASELINE in res["runs"] for res in results.values()):
        lines += [
            "Without gradient clipping `1f1b` applies exactly `dp`'s update (same samples, initial weights "
            "and optimizer); its runs then differ only by floating-point summation order, and its "
            "difference to `dp` is the noise floor of the comparison."
        ]
    return "\n".join(lines) + "\n"


LINES, MARKERS = ["-", "--", "-.", ":"], ["o", "s", "^", "D", "v", "P", "X"]


def plot(example: str, res: dict, path: Path, step_times: list | None = None):
    """Loss (and accuracy) against steps, and held-out loss against emulated wall time, one panel
    per link speed of ``step_times``. Identical curves (hippie and hippie-1f1b apply the same
    updates) stay visible: each run has its own line style and marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = res["curves"]
    with_accuracy = any(e.get("accuracy") is not None for c in curves.values() for e in c["eval"])
    links = (step_times or []) if "time_to_accuracy" in res else []
    panels = 1 + with_accuracy + len(links)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    _loss_panel(axes[0][0], example, res)
    if with_accuracy:
        _accuracy_panel(axes[0][1], example, res)
    for ax, times in zip(axes[0][1 + with_accuracy :], links):
        tta.plot_wall(ax, curves, times, res["time_to_accuracy"]["target_loss"])
        ax.set_title(f"{example}: held-out loss against emulated wall time ({times.link})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _loss_panel(ax, example: str, res: dict):
    """Training loss (running mean) and held-out loss against steps, log scale."""
    for i, (name, c) in enumerate(res["curves"].items()):
        color = f"C{i}"
        steps = range(1, len(c["train_loss"]) + 1)
        window = max(1, len(c["train_loss"]) // 40)
        ax.plot(
            steps,
            smooth(c["train_loss"], window),
            color=color,
            lw=1.2,
            alpha=0.8,
            ls=LINES[i % 4],
            label=f"{name} train (mean of {window})",
        )
        ax.plot(
            [e["step"] for e in c["eval"]],
            [e["loss"] for e in c["eval"]],
            color=color,
            ms=4,
            lw=1,
            ls=LINES[i % 4],
            marker=MARKERS[i % 7],
            mfc="none",
            label=f"{name} held-out",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    seeds = res["seeds"]
    ax.set_title(
        f"{example}: loss (global batch {res['global_batch']}, "
        + (f"seed {seeds[0]})" if len(seeds) == 1 else f"mean of seeds {','.join(map(str, seeds))})")
    )


def _accuracy_panel(ax, example: str, res: dict):
    """Held-out accuracy against steps, with an inset on the second half of the run."""
    curves = res["curves"]
    for i, (name, c) in enumerate(curves.items()):
        ax.plot(
            [e["step"] for e in c["eval"]],
            [100 * e["accuracy"] for e in c["eval"]],
            color=f"C{i}",
            ls=LINES[i % 4],
            marker=MARKERS[i % 7],
            mfc="none",
            ms=4,
            lw=1.2,
            label=name,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 100)
    inset = ax.inset_axes([0.45, 0.12, 0.5, 0.45])
    for i, (name, c) in enumerate(curves.items()):
        late = [e for e in c["eval"] if e["step"] >= res["steps"] // 2]
        inset.plot(
            [e["step"] for e in late],
            [100 * e["accuracy"] for e in late],
            color=f"C{i}",
            ls=LINES[i % 4],
            marker=MARKERS[i % 7],
            mfc="none",
            ms=3.5,
            lw=1,
        )
    inset.grid(alpha=0.3)
    inset.set_title("second half", fontsize=8)
    inset.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"{example}: held-out accuracy")
