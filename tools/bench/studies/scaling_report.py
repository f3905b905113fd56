"""report.md of ``python -m tools.bench scaling`` (tools/bench/studies/scaling.py): per node count the schedules
side by side, the scaling pivot, the paper's figures beside ours, the simulator's error on every
row. Pure functions of results.json's content."""

from __future__ import annotations

from tools.bench.report import _f, spread_cell, table
from tools.bench.studies.scaling_summary import DILATION_RULE
from tools.bench.studies.scaling_plan_report import (
    baselines_section,
    cpu_section,
    machine_line,
    name_of,
    planned_section,
    targets_section,
)

# What the papers report (seeds 000 and 003 in ../shared/seeds), quoted, not measured here.
PAPER = [
    ("Hippie: scaling efficiency on 16 GPUs (4 nodes x 4, GNMT-8/16, 64-128 samples per GPU)", "> 90%"),
    ("Hippie: memory efficiency over DP (GNMT-8/16, VGG-16, 16 GPUs)", "up to 4.18x"),
    ("Hippie: memory saved (last-stage schedule + planner)", "30-60%"),
    ("PipeDream: VGG-16 speed-up over one machine, 4 machines (cluster A): BSP (DP) / PipeDream", "1.47x / 3.14x"),
    ("PipeDream: VGG-16 speed-up over one machine, 16 machines (cluster A): BSP (DP) / PipeDream", "3.28x / 9.86x"),
]


def _spread(row: dict, key: str, fmt="{:.2f}", suffix="x", real=None) -> str:
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    several = lo is not None and hi is not None and lo != hi
    return spread_cell(row.get(key), lo if several else None, hi if several else None, fmt, suffix, real)


def _exposed(row: dict) -> str:
    e = row.get("exposed_allreduce_s") or {}
    return ", ".join(f"s{s} {v * 1e3:.0f}" for s, v in sorted(e.items())) or "-"


def nodes_table(rows: dict, n: int) -> list[str]:
    head = [
        "schedule",
        "layout",
        "D",
        "step (s)",
        "vs 1F1B",
        "vs DP",
        f"scaling 1->{n} nodes",
        "memory/device (GB)",
        "ME vs DP",
        "exposed all-reduce per stage (ms/step)",
        "predicted (s)",
        "error",
    ]
    body = []
    for name, r in rows.items():
        layout = r["layout"] + (f", deferred {r['deferred_stages']}" if r.get("deferred_stages") is not None else "")
        if r.get("plan"):
            layout += f", {r['micro_batches']} x {r['micro_batch_size']}, {r['plan']['schedule']}"
        body.append(
            [
                name_of(name),
                layout,
                dilation_cell(r),
                spread_cell(r["step_s"], r.get("step_min"), r.get("step_max"), "{:.3f}", ""),
                _spread(r, "vs_1f1b", real=r.get("real_vs_1f1b")),
                _spread(r, "vs_dp"),
                "-" if n == 1 else _spread(r, "scaling", suffix=""),
                _f(r["memory_bytes"] / 1e9 if r.get("memory_bytes") else None, "{:.2f}"),
                _f(r.get("me_vs_dp"), "{:.2f}x"),
                _exposed(r),
                _f(r.get("predicted_step_s")),
                _f(r.get("prediction_error"), "{:+.1%}"),
            ]
        )
    return table(head, body)


def dilation_cell(row: dict) -> str:
    """The row's D, and the D it waited for a core at before it (row_dilation.py): '32 (16: 9.7%)'. Pure."""
    d = row.get("dilation")
    if d is None:
        return "-"
    waited = [t for t in row.get("dilation_tried") or [] if t["dilation"] != d and t.get("wait") is not None]
    return f"{d:g}" + (" (" + ", ".join(f"{t['dilation']:g}: {t['wait']:.1%}" for t in waited) + ")" if waited else "")


def scaling_pivot(summary: dict) -> list[str]:
    counts = [n for n in summary["by_nodes"] if n != "1"]
    names = list(summary["by_nodes"].get("1", {}))
    body = [
        [name_of(s)] + [_spread(summary["by_nodes"][n].get(s, {}), "scaling", suffix="") for n in counts] for s in names
    ]
    return table(["schedule"] + [f"1 -> {n} nodes ({n} x stages devices)" for n in counts], body)


def paper_table(summary: dict) -> list[str]:
    """The papers' figures beside the nearest emulated ones (the most nodes run)."""
    top = max(summary["by_nodes"], key=int)
    rows = summary["by_nodes"][top]
    hip = [s for s in ("hippie", "hippie-1f1b", "planned", "planned-throughput") if s in rows]

    def each(fmt, value):
        return ", ".join(f"{s} {fmt.format(v)}" for s in hip if (v := value(rows[s])) is not None) or "-"

    gp = (rows.get("gpipe") or {}).get("memory_bytes")
    speedup = {s: rows[s]["scaling"] * int(top) for s in ("dp", *hip) if (rows.get(s) or {}).get("scaling")}
    ours = [
        f"1 -> {top} nodes: " + each("{:.0%}", lambda r: r.get("scaling")),
        f"{top} nodes: " + each("{:.2f}x", lambda r: r.get("me_vs_dp")),
        "memory per device against GPipe+DP: "
        + each("{:.0%}", lambda r: 1 - r["memory_bytes"] / gp if r.get("memory_bytes") and gp else None),
        f"speed-up 1 -> {top} nodes: " + (", ".join(f"{name_of(s)} {v:.2f}x" for s, v in speedup.items()) or "-"),
        "-",
    ]
    return table(
        ["the papers report (quoted from the seeds; their hardware)", "paper", "emulated here"],
        [[claim, value, mine] for (claim, value), mine in zip(PAPER, ours)],
    )


def link_table(link: dict) -> list[str]:
    """What gloo's all-reduces alone on the link got of the shaped rate
    (tools/bench/studies/link_calibration.py)."""
    concurrent = any("stages" in e for e in link["by_nodes"].values())
    lines = [
        f"gloo all-reduces alone on the same network ({link['rate']}, burst {link['burst']}), median of "
        f"{link['repeats']}"
        + (f", measured by `{link['measured_by']}`" if link.get("measured_by") else "")
        + "; efficiency = the fluid ring time 2(r-1)/r x bytes / rate over the median (every stage's "
        "at once: their rings share each node's link, so the bytes are their sum). The simulator takes "
        + (
            "the pipelines' efficiency from every stage's at once, DP's from all ranks."
            if concurrent
            else "the pipelines' efficiency from their largest stage's group, DP's from all ranks."
        ),
        "",
        "| nodes | collective | ranks | bytes | median (s) (min-max) | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for n, entry in link["by_nodes"].items():
        for shape, what in (
            ("stage", f"stage {entry.get('stage_index')}'s gradient, its data-parallel group"),
            ("stages", "every stage's gradient at once, each over its data-parallel group"),
            ("all", "DP's gradient, every rank"),
        ):
            m = entry.get(shape)
            if m:
                lines.append(
                    f"| {n} | {what} | {m['ranks']} | {m['bytes']} | {m['median_s']:.3f} "
                    f"({min(m['repeats_s']):.3f}-{max(m['repeats_s']):.3f}) | {m['efficiency']:.2f} |"
                )
    return lines


def dilation_line(cfg: dict) -> str:
    """What the time dilation was and what host it emulates (empty for reports before --dilate)."""
    d = cfg.get("dilation")
    if not d:
        return ""
    cores = cfg.get("host_per_rank_cores") or {}
    host = ", ".join(f"{n} node{'s' if n != '1' else ''}: {c:.3g}" for n, c in cores.items())
    rerun = (
        f" A row whose rank waited for a core more than {cfg.get('waited_for_core_share', 0.05):.0%} of a step "
        f"at D was rerun alone (same nodes, rounds and steps; a planned column with the plan made at the first D) at "
        f"2D, 4D, ... up to {cfg['max_dilation']:g} until host-free; its figure is the first D's at which it "
        "was (column D; in brackets the D it waited at before, and its wait), else the last D's, flagged. "
        "Each row's times are divided by its own D (ratios and scaling between rows at different D are of "
        "those undilated figures): stock 1F1B's step is flat in D (the dilation study), so rows at "
        "different D compare."
        if cfg.get("max_dilation") and cfg["max_dilation"] > d
        else ""
    )
    return (
        f"**Time dilation D = {d:g}**: the ranks ran every device time x D and every transfer D x longer "
        + (
            "(the link shaped at the rate / D, the tensors at their size); "
            if cfg.get("dilation_rule") == DILATION_RULE
            else "(the tensors' bytes x D at the shaped rate); "
        )
        + f"every time below is divided by its row's D (throughput "
        f"x D), so the figures are those of the undilated cluster whose ranks each have D x cores / "
        f"ranks-on-a-core cores of host (at D = {d:g}: {host}).{rerun} "
        + (
            f"The planner priced the host measured in `{cfg['host_cost_file']}`, scaled to that share."
            if cfg.get("host_cost_file")
            else "The planner priced no host cost."
        )
        + "\n"
    )


def report(results: dict) -> str:
    cfg, summ = results["config"], results["summary"]
    model = str(cfg.get("model", "gpt"))
    what = (
        f"{model[9:]} emulated (PipeDream's V100 profile; compute a CPU-free wait of the profiled time / "
        f"{cfg.get('emulate_speedup')}; parameters and activations x {cfg.get('emulate_scale')}, "
        f"{cfg.get('params_total')} parameters)"
        if model.startswith("emulated:")
        else f"the {model} bench model"
    )
    lines = [
        "# Scaling on an emulated cluster (python -m tools.bench scaling)",
        "",
        f"Model: {what}. Nodes: {', '.join(map(str, cfg['nodes']))}, each a network namespace with "
        f"{cfg['stages']} ranks (a {cfg['stages']}-stage pipeline; data parallelism across nodes), one link per "
        f"node to a switch, {cfg['link']} both ways; nodes pinned round-robin to cores {cfg['cores']}. "
        f"{cfg['micro_batches']} micro-batches of {cfg['micro_batch_size']} per replica and step; DP runs, in a "
        f"job of its own, the same global batch on every rank. {cfg['warmup']} warm-up + {cfg['steps']} timed "
        f"steps per run, {cfg['rounds']} rounds (order rotated), fp32 AdamW. Command: `{cfg['command']}`"
        + (f"; then `{cfg['reanalysed_by']}`." if cfg.get("reanalysed_by") else "."),
        "",
        dilation_line(cfg),
        "All figures below are **emulated** on this 2-core machine: the compute is the profiled V100 time "
        "slept, the link is scaled with the model; only the paper's own figures (last table) are the "
        "paper's. Cells: median over rounds (min-max over rounds); ratios and scaling are taken per round "
        "between runs of the same round; **real**: the spread leaves 1.0 out.",
        "",
    ]
    lines += [
        f"Single device (whole model, one rank): {_f(summ.get('single_device_throughput'), '{:.2f}')} "
        "samples/s. Scaling 1->N = throughput on N nodes / (N x throughput on one node). Memory/device: "
        "parameters + gradients + optimizer state + peak bytes saved for backward per rank, unscaled to the "
        "profile's size (what a GPU would hold). ME = scalability x throughput / memory, scalability = "
        "throughput / (devices x single-device throughput) (the paper's definition). The prediction is the "
        "simulator on the run's own measured per-stage times, the parameter bytes and the link's rate x "
        + (
            "the efficiency a lone all-reduce of the run's shape got on the same network after the runs "
            "(table *Link calibration*)."
            if results.get("link")
            else f"{cfg.get('link_efficiency')}."
        ),
        "",
    ]
    if results.get("link"):
        lines += ["## Link calibration", ""] + link_table(results["link"]) + [""]
    if machine_line(cfg):
        lines += [machine_line(cfg), ""]
    src = cfg.get("source") or {}
    if src.get("commit"):
        lines += [
            f"Code: commit {src['commit'][:7]}"
            + (f", with uncommitted changes in {', '.join(src['uncommitted'])}" if src.get("uncommitted") else "")
            + ".",
            "",
        ]
    lines += targets_section(summ, model[9:] if model.startswith("emulated:") else model)
    lines += ["## Scaling efficiency from one node", ""] + scaling_pivot(summ)
    lines += ["", "## Against the papers", ""] + paper_table(summ)
    for n, rows in summ["by_nodes"].items():
        lines += ["", f"## {n} node{'s' if n != '1' else ''}", ""] + nodes_table(rows, int(n))
    lines += (
        [""]
        + planned_section(summ)
        + baselines_section(summ)
        + cpu_section(summ, cfg.get("waited_for_core_share", 0.05))
    )
    errs = [
        abs(r["prediction_error"])
        for rows in summ["by_nodes"].values()
        for r in rows.values()
        if r.get("prediction_error") is not None
    ]
    if errs:
        lines += [
            "",
            f"Simulator: worst error {max(errs):.1%} over {len(errs)} rows; "
            f"{sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%.",
        ]
    if results.get("wall_s"):
        lines.append(f"Wall time of the measured part: {results['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"
