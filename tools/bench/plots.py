"""The benchmark report's plots (PNG, matplotlib): throughput with scaling efficiency, memory
per rank, ME relative to DP, measured vs predicted step time (two-node runs), and the
projection's scaling efficiency per model. No matplotlib: no plots."""

from __future__ import annotations

from pathlib import Path

from tools.bench.report import DISPLAY


def plots(results: dict, out: Path) -> list[str]:
    """Draw what the results hold into ``out``; returns the file names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    two = results.get("runs", {}).get("two_nodes", {})
    summ = results.get("summary", {}).get("schedules", {})
    names = list(two)
    if names:
        labels = [DISPLAY.get(n, n).replace(" (stock DeepSpeed)", "\n(stock DS)") for n in names]
        for draw, name in (
            (_throughput, "throughput.png"),
            (_memory, "memory.png"),
            (_me, "me.png"),
            (_prediction, "prediction.png"),
        ):
            fig = draw(plt, two, summ, names, labels)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            made.append(name)
    proj = results.get("projection")
    if proj:
        fig = _projection(plt, proj)
        fig.tight_layout()
        fig.savefig(out / "projection.png", dpi=110)
        plt.close(fig)
        made.append("projection.png")
    return made


def _throughput(plt, two, summ, names, labels):
    """Two-node and one-node throughput per schedule (min-max over rounds as error bars), the
    scaling efficiency 1 -> 2 nodes written on the bars."""
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    two_thr = [two[n]["throughput_samples_s"] or 0 for n in names]
    one_thr = [summ.get(n, {}).get("one_node_throughput_samples_s") or 0 for n in names]
    lo = [max(0.0, t - (two[n].get("throughput_samples_s_min") or t)) for n, t in zip(names, two_thr)]
    hi = [max(0.0, (two[n].get("throughput_samples_s_max") or t) - t) for n, t in zip(names, two_thr)]
    ax.bar(
        [x - 0.2 for x in xs], two_thr, 0.4, label="2 nodes", yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=3
    )
    ax.bar([x + 0.2 for x in xs], one_thr, 0.4, label="1 node")
    for x, n in zip(xs, names):
        se = summ.get(n, {}).get("scaling_efficiency")
        if se:
            ax.text(x - 0.2, two_thr[x], f"{se:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("samples/s")
    ax.set_title(
        "Throughput (numbers: scaling efficiency 1 -> 2 nodes"
        + ("; bars: min-max over rounds)" if any(lo) or any(hi) else ")")
    )
    ax.legend()
    return fig


def _memory(plt, two, summ, names, labels):
    """Per rank: peak bytes saved for backward and peak training RSS."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(names))
    ranks = sorted({r for n in names for r in two[n]["memory_per_rank"]}, key=int)
    w = 0.8 / max(1, len(ranks))
    for i, r in enumerate(ranks):
        saved = [(two[n]["memory_per_rank"].get(r) or {}).get("peak_saved_bytes") or 0 for n in names]
        rss = [(two[n]["memory_per_rank"].get(r) or {}).get("peak_training_rss_bytes") or 0 for n in names]
        axes[0].bar([x - 0.4 + w * (i + 0.5) for x in xs], [v / 1e6 for v in saved], w, label=f"rank {r}")
        axes[1].bar([x - 0.4 + w * (i + 0.5) for x in xs], [v / 1e6 for v in rss], w, label=f"rank {r}")
    axes[0].set_title("peak bytes saved for backward (MB)")
    axes[1].set_title("peak training RSS (MB, above pre-model RSS)")
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.legend(fontsize=7)
    return fig


def _me(plt, two, summ, names, labels):
    """ME relative to DP, with either memory figure."""
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    me = [summ.get(n, {}).get("me_vs_dp") or 0 for n in names]
    me_t = [summ.get(n, {}).get("me_tensors_vs_dp") or 0 for n in names]
    ax.bar([x - 0.2 for x in xs], me, 0.4, label="memory = training RSS")
    ax.bar([x + 0.2 for x in xs], me_t, 0.4, label="memory = state + saved for backward")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("ME / ME of DP")
    ax.set_title("Memory efficiency relative to data parallelism")
    ax.legend(fontsize=8)
    return fig


def _prediction(plt, two, summ, names, labels):
    """Measured vs simulated step time."""
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    meas = [two[n]["median_step_s"] or 0 for n in names]
    pred = [(two[n].get("prediction") or {}).get("step_time") or 0 for n in names]
    ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], pred, 0.4, label="simulator")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("step time (s)")
    ax.set_title("Step time: measured vs predicted (two nodes)")
    ax.legend()
    return fig


def _projection(plt, proj):
    """Scaling efficiency against cluster size, one panel per model, one line per schedule."""
    models = list(dict.fromkeys(r["model"] for r in proj["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = [r for r in proj["rows"] if r["model"] == m and "error" not in r]
        for s in dict.fromkeys(r["schedule"] for r in rows):
            pts = sorted((r["devices"], r["scaling_efficiency"]) for r in rows if r["schedule"] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_xticks(proj["sizes"], [str(x) for x in proj["sizes"]])
        ax.axhline(0.9, color="grey", lw=0.8, ls="--")
        ax.set_title(m)
        ax.set_xlabel("V100 GPUs")
    axes[0][0].set_ylabel("scaling efficiency")
    axes[0][-1].legend(fontsize=7)
    return fig
