"""The benchmark report as markdown (report.md): the side-by-side table, rounds, memory per
rank, predictions vs measurements, the projection. Pure functions of results.json's content."""

from __future__ import annotations

DISPLAY = {
    "dp": "DP",
    "1f1b": "1F1B (stock DeepSpeed)",
    "gpipe": "GPipe+DP",
    "hippie": "hippie",
    "hippie-1f1b": "hippie-1f1b",
    "hds-1f1b": "1F1B (hippie-ds)",
}


def _f(x, fmt="{:.3f}", none="-"):
    return none if x is None else fmt.format(x)


def _mb(x):
    return _f(x / 1e6 if x is not None else None, "{:.1f}")


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def spread_cell(median, lo, hi, fmt="{:.2f}", suffix="x", real: bool | None = None) -> str:
    """``median (min-max)`` (just the median without a spread, e.g. one round), with ``**real**``
    appended where the difference is real by the report's rule (``summarize``). Pure."""
    if median is None:
        return "-"
    cell = fmt.format(median) + suffix
    if lo is not None and hi is not None and (lo != hi or real is not None):
        cell += f" ({fmt.format(lo)}-{fmt.format(hi)})"
    return cell + (" **real**" if real else "")


def rounds_of(results: dict) -> int:
    """The number of rounds of the two-node runs (1 for results from before rounds)."""
    return max([r.get("rounds") or 1 for r in results.get("runs", {}).get("two_nodes", {}).values()], default=1)


def single_runs_note(results: dict) -> str:
    """The sentence saying which reference runs were not repeated in rounds ('' if none ran)."""
    runs = results.get("runs", {})

    def once(config):
        return runs.get(config) and max((r.get("rounds") or 1) for r in runs[config].values()) == 1

    which = [
        w
        for c, w in (
            ("one_node", "the one-node runs (1-node samples/s, scaling 1->2 nodes)"),
            ("one_device", "the one-device run (single-device throughput, scalability, ME)"),
        )
        if once(c)
    ]
    if not which:
        return ""
    text = " and ".join(which)
    return f" Not repeated in rounds: {text} ran once each, so their figures carry no spread."


def _layout(name: str, r: dict) -> str:
    """DP xN, or STAGES x REPLICAS with the deferred stages and the share of each one's gradient
    applied one step late (hippie.deferred_layers)."""
    if name == "dp":
        return f"DP x{r['world']}"
    d = r["schedule_params"].get("deferred_stages")
    shares = r.get("delayed_fraction") or {}
    delayed = ", ".join(f"s{s} {v:.0%}" for s, v in sorted(shares.items())) if any(shares.values()) else ""
    return (
        f"{r['stages']} stages x {r['world'] // r['stages']}"
        + (f", deferred {d}" if d is not None else "")
        + (f" (delayed: {delayed})" if delayed else "")
    )


def main_table(results: dict) -> list[str]:
    two = results["runs"].get("two_nodes", {})
    summ = results["summary"]["schedules"]
    head = [
        "schedule",
        "layout",
        "median step (s)",
        "samples/s",
        "vs 1F1B",
        "vs DP",
        "peak saved/rank (MB)",
        "peak RSS/rank (MB)",
        "training RSS/rank (MB)",
        "ME vs DP",
        "ME vs DP (tensors)",
        "1-node samples/s",
        "scaling 1->2 nodes",
        "predicted step (s)",
        "prediction error",
    ]
    rows = []
    for name, r in two.items():
        s = summ.get(name, {})
        layout = _layout(name, r)
        pred = r.get("prediction") or {}
        several = (r.get("rounds") or 1) > 1
        step = spread_cell(
            r["median_step_s"],
            r.get("median_step_s_min") if several else None,
            r.get("median_step_s_max"),
            "{:.3f}",
            "",
        )
        rows.append(
            [
                DISPLAY.get(name, name),
                layout,
                step,
                _f(r["throughput_samples_s"], "{:.2f}"),
                spread_cell(
                    s.get("ratio_to_1f1b"),
                    s.get("ratio_to_1f1b_min") if several else None,
                    s.get("ratio_to_1f1b_max"),
                    real=s.get("real_vs_1f1b"),
                ),
                spread_cell(
                    s.get("ratio_to_dp"),
                    s.get("ratio_to_dp_min") if several else None,
                    s.get("ratio_to_dp_max"),
                    real=s.get("real_vs_dp"),
                ),
                _mb(r["mean_peak_saved_bytes"]),
                _mb(r["mean_peak_rss_bytes"]),
                _mb(r["mean_peak_training_rss_bytes"]),
                _f(s.get("me_vs_dp"), "{:.2f}x"),
                _f(s.get("me_tensors_vs_dp"), "{:.2f}x"),
                _f(s.get("one_node_throughput_samples_s"), "{:.2f}"),
                spread_cell(
                    s.get("scaling_efficiency"),
                    s.get("scaling_efficiency_min"),
                    s.get("scaling_efficiency_max"),
                    "{:.2f}",
                    "",
                ),
                _f(pred.get("step_time")),
                _f(pred.get("error"), "{:+.1%}"),
            ]
        )
    return table(head, rows)


def rounds_table(results: dict) -> list[str]:
    """Per schedule and round: the run's median step and its ratios to 1F1B and DP of that round."""
    two = results["runs"].get("two_nodes", {})
    summ = results.get("summary", {}).get("schedules", {})
    n = rounds_of(results)
    head = ["schedule"] + [f"round {i}: step (s)" for i in range(n)] + ["vs 1F1B per round", "vs DP per round"]
    rows = []
    for name, r in two.items():
        steps = list(r.get("round_median_step_s") or [r["median_step_s"]]) + [None] * n
        s = summ.get(name, {})
        rows.append(
            [DISPLAY.get(name, name)]
            + [_f(x) for x in steps[:n]]
            + [
                ", ".join(_f(x, "{:.2f}") for x in s.get(k) or []) or "-"
                for k in ("ratio_to_1f1b_rounds", "ratio_to_dp_rounds")
            ]
        )
    return table(head, rows)


def memory_table(results: dict) -> list[str]:
    rows = []
    for name, r in results["runs"].get("two_nodes", {}).items():
        for rank, m in r["memory_per_rank"].items():
            rows.append(
                [
                    DISPLAY.get(name, name),
                    rank,
                    str(m["stage"]),
                    _mb(m["peak_saved_bytes"]),
                    _mb(m["state_bytes"]),
                    _mb(m["peak_rss_bytes"]),
                    _mb(m["rss_baseline_bytes"]),
                    _mb(m["peak_training_rss_bytes"]),
                ]
            )
    return table(
        [
            "schedule",
            "rank",
            "stage",
            "peak saved for backward (MB)",
            "params+grads+optimizer (MB)",
            "peak RSS (MB)",
            "RSS before the model (MB)",
            "training RSS (MB)",
        ],
        rows,
    )


def prediction_table(results: dict) -> list[str]:
    rows = []
    for config in ("two_nodes", "one_node", "one_device"):
        for name, r in results["runs"].get(config, {}).items():
            p = r.get("prediction") or {}
            times = "; ".join(
                f"s{s}: "
                + ", ".join(
                    f"{k[0]}{v * 1e3:.0f}"
                    for k, v in (("F", st.get("forward")), ("B", st.get("backward")), ("U", st.get("optimizer_time")))
                    if v is not None
                )
                for s, st in enumerate((p.get("costs") or {}).get("stages", []))
            )
            rows.append(
                [
                    config.replace("_", " "),
                    DISPLAY.get(name, name),
                    _f(r["median_step_s"]),
                    _f(p.get("step_time")),
                    _f(p.get("error"), "{:+.1%}"),
                    times or p.get("error") or "-",
                ]
            )
    return table(
        [
            "run",
            "schedule",
            "measured step (s)",
            "predicted step (s)",
            "error",
            "measured costs (ms: F forward, B backward, U update, per micro-batch)",
        ],
        rows,
    )


def projection_table(proj: dict) -> list[str]:
    rows = []
    for r in proj["rows"]:
        if "error" in r:
            rows.append([r["model"], str(r["devices"]), r["schedule"], "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        layout = f"{r['pipeline_depth']} x {r['data_parallel']}"
        rows.append(
            [
                r["model"],
                str(r["devices"]),
                r["schedule"],
                layout,
                f"{r['micro_batch_size']} x {r['micro_batches']}",
                _f(r["step_time_s"] * 1e3, "{:.1f}"),
                _f(r["scaling_efficiency"], "{:.1%}"),
                _f(r["memory_mean_gb"], "{:.2f}"),
                _f(r["me_vs_dp"], "{:.2f}x"),
                (r["note"] + ("" if r["fits"] else " DOES NOT FIT")).strip(),
            ]
        )
    return table(
        [
            "model",
            "GPUs",
            "schedule",
            "stages x dp",
            "micro-batch x M",
            "step (ms)",
            "scaling efficiency",
            "memory/GPU (GB)",
            "ME vs DP",
            "note",
        ],
        rows,
    )


def projection_pivot(proj: dict) -> list[str]:
    sizes = proj["sizes"]
    by = {}
    for r in proj["rows"]:
        if "error" not in r:
            by.setdefault((r["model"], r["schedule"]), {})[r["devices"]] = r["scaling_efficiency"]
    head = ["model", "schedule"] + [f"{n} GPUs" for n in sizes]
    rows = [[m, s] + [_f(v.get(n), "{:.1%}") for n in sizes] for (m, s), v in by.items()]
    return table(head, rows)


def report_markdown(results: dict) -> str:
    """The report (report.md): the measured side-by-side comparison (when runs were made) and the
    projection (when it ran)."""
    lines = ["# hippie-ds benchmark report", ""]
    if results.get("runs"):
        lines += measured_section(results)
    proj = results.get("projection")
    if proj:
        lines += projection_section(proj, results.get("plots", []))
    lines += [
        "",
        "Reproduce: `sudo make bench` (or `sudo .venv/bin/python -m tools.bench --help`); "
        "`python -m tools.bench --projection-only` for the projection alone (no root).",
    ]
    return "\n".join(lines) + "\n"


def measured_section(results: dict) -> list[str]:
    """The two-node comparison: setup, how rounds are read, the main table, definitions, plots,
    rounds, memory, predictions, exposed all-reduce and noise."""
    cfg = results.get("config", {})
    lines = [
        f"Emulated cluster: 2 nodes (network namespaces) x {cfg.get('stages')} ranks, one core per node, "
        f"link {cfg.get('link')}; pipeline of {cfg.get('stages')} stages inside a node, data parallelism across. "
        + (
            f"Model: {cfg['model'][9:]} emulated (tools/bench/emulated.py: PipeDream's V100 profile, compute a "
            "CPU-free "
            f"wait; parameters and activations x {cfg.get('emulate_scale')}, times / {cfg.get('emulate_speedup')}), "
            f"fp32 AdamW ({cfg.get('params_total', '?')} parameters). "
            if str(cfg.get("model", "gpt")).startswith("emulated:")
            else f"Model: the VGG convergence example (tools/examples/vgg.py: scikit-learn's 8x8 digits), fp32 AdamW "
            f"({cfg.get('params_total', '?')} parameters). "
            if cfg.get("model") == "vgg-example"
            else f"Model: GPT-like, {cfg.get('layers')} blocks, d_model {cfg.get('d_model')}, "
            f"vocab {cfg.get('vocab')}, "
            f"sequence {cfg.get('seq')}, fp32 AdamW ({cfg.get('params_total', '?')} parameters). "
        )
        + f"{cfg.get('micro_batches')} micro-batches of {cfg.get('micro_batch_size')} per replica and step "
        f"(global batch {cfg.get('global_batch')}); {cfg.get('warmup')} warm-up + {cfg.get('steps')} timed steps "
        f"per schedule and run, each run in its own processes. Command: `{cfg.get('command', '')}`.",
        "",
        "## Side by side (two emulated nodes)",
        "",
    ]
    n = rounds_of(results)
    if n > 1:
        lines += [
            f"The two-node runs came in {n} rounds: each round ran every schedule once (a fresh job), the order "
            "rotated from one round to the next (round r starts at the r-th schedule), so a drift of the machine "
            "lands on every schedule alike. Step time: median over rounds of each round's median step "
            "(min-max over rounds in brackets). Ratios (vs 1F1B, vs DP) are throughput ratios taken per round, "
            "between runs of the same round, shown as `median (min-max)` over rounds. A difference is marked "
            "**real** only when it holds in every round: vs 1F1B when the ratio's min-max spread does not "
            "include 1.0; vs DP when the schedule's throughput range over rounds and DP's do not overlap. "
            "Anything unmarked is within the round-to-round noise of this machine." + single_runs_note(results),
            "",
        ]
    else:
        lines += [
            "Each schedule ran once (one round, `--rounds 1`): the ratios carry no spread, so no difference "
            "below is marked real; rerun with `--rounds 3` or more to see which hold across rounds.",
            "",
        ]
    lines += main_table(results)
    lines += definitions(results)
    for png in ("throughput.png", "memory.png", "me.png", "prediction.png"):
        if png in results.get("plots", []):
            lines.append(f"![{png[:-4]}]({png})")
    if n > 1:
        lines += rounds_section(results)
    lines += ["", "## Memory per rank (two nodes)", ""] + memory_table(results)
    lines += ["", "## Predicted vs measured step time", ""] + prediction_table(results)
    return lines + exposure_and_noise(results)


def definitions(results: dict) -> list[str]:
    """The paragraph under the main table: single-device throughput and what each figure means."""
    cfg = results.get("config", {})
    thr1 = results["summary"].get("single_device_throughput")
    return [
        "",
        f"Single device (whole model, one rank on one core): {_f(thr1, '{:.2f}')} samples/s. "
        "Throughput: samples a step / median step (slowest rank's `train_batch`). ME = scalability x "
        "throughput / memory, memory = mean per-rank peak training RSS (peak RSS minus the RSS before "
        "the model was built); ME (tensors) uses parameters+gradients+optimizer state + peak bytes saved "
        "for backward instead. Scalability counts a device per emulated node (core); the ME ratio to DP "
        "does not depend on that choice. Scaling 1->2 nodes = two-node throughput / (2 x one-node "
        "throughput), one node = node 0's ranks alone with the same per-replica batch. The prediction "
        "is hippie-ds's simulator on the run's own measured per-stage times (below), parameter bytes "
        f"and the link ({cfg.get('link_efficiency', 1):.2f} x the shaped rate for the all-reduce; an "
        f"all-reduce in flight takes {cfg.get('allreduce_cpu_per_mb', 0) * 1e3:.2f} ms of its stage's "
        "compute per MB).",
        "",
    ]


def rounds_section(results: dict) -> list[str]:
    """## Rounds: the order of each round, the per-round table, which round the details are from."""
    lines = ["", "## Rounds (two nodes)", ""]
    orders = results.get("config", {}).get("round_orders") or []
    if orders:
        lines += [
            "Order: "
            + "; ".join(f"round {i}: " + ", ".join(DISPLAY.get(x, x) for x in o) for i, o in enumerate(orders))
            + ".",
            "",
        ]
    lines += rounds_table(results)
    detail = ", ".join(
        f"{DISPLAY.get(k, k)}: round {r['detail_round']}"
        for k, r in results["runs"].get("two_nodes", {}).items()
        if r.get("detail_round") is not None
    )
    return lines + [
        "",
        "Memory, stage timings and predictions below are those of each schedule's median round "
        f"(the lower median with an even number of rounds; {detail}); the prediction error is "
        "against the median over rounds.",
    ]


def exposure_and_noise(results: dict) -> list[str]:
    """Exposed all-reduce per stage, CPU used by other processes, wall time."""
    lines = []

    def stage(v, step):
        return f"{v:.3f} s ({v / step:.1%})" if step else f"{v:.3f} s"

    exposed = [
        f"{DISPLAY.get(n, n)}: "
        + ", ".join(
            f"s{s} {stage(v, r.get('median_step_s'))}" for s, v in sorted(r["exposed_allreduce_s_per_step"].items())
        )
        for n, r in results["runs"].get("two_nodes", {}).items()
    ]
    if exposed:
        lines += [
            "",
            "Exposed all-reduce per step (s, and its share of the median step: time the rank's stream "
            "spends in ReduceGrads / StartAllReduce / WaitAllReduce, mean over the stage's ranks; of "
            "the median round):",
            "",
        ]
        lines += ["- " + r for r in exposed]
    noisy = results.get("noise", {}).get("foreign_cpu_cores_mean")
    if noisy is not None:
        lines += [
            "",
            f"CPU used by other processes during the runs: {noisy:.2f} cores on average"
            + (" (the machine was busy: rerun on a quiet machine)" if noisy > 0.05 else "")
            + ".",
        ]
    if results.get("wall_s"):
        lines.append(f"Wall time of the measured part: {results['wall_s']:.0f} s.")
    return lines


def projection_section(proj: dict, plots: list[str]) -> list[str]:
    """## Projection: the setup, the pivot table (and plot), the details folded."""
    lines = [
        "",
        "## Projection: scaling efficiency on V100 clusters (planner cost model + simulator)",
        "",
        f"PipeDream V100 profiles; clusters of NODES x {proj['devices_per_node']} V100 (16 GB), 100 Gbit/s "
        f"between nodes, 100 GB/s inside (the planner's NVLink-class default); global batch = "
        f"{proj['batch_per_device']} per GPU x GPUs (weak scaling). Pipeline schedules: "
        f"{proj['depth'] or 'planner-chosen'} stages (a pipeline per node, data parallelism across), "
        f"micro-batches, partition and re-computation chosen by the planner for {proj['objective']}; dp: the "
        "planner's data-parallel baseline (all-reduce overlapped with the last micro-batch's backward); "
        "planner: the Hippie planner's own choice (ME objective, any schedule and depth). Scaling "
        "efficiency = throughput / (GPUs x single-GPU throughput). The paper claims > 90% on 16 GPUs.",
        "",
    ]
    lines += projection_pivot(proj) + [""]
    if "projection.png" in plots:
        lines += ["![projection](projection.png)", ""]
    return lines + ["<details><summary>Projection details</summary>", ""] + projection_table(proj) + ["", "</details>"]
