"""The report's planned-column sections of ``python -m tools.bench scaling`` (scaling_report.py calls them):
the plans against what their runs measured, each run's CPU per step (the runs that waited for a core
named), the issue's targets met or missed. Pure functions of results.json's content."""

from __future__ import annotations

from tools.bench.report import DISPLAY, _f, table

DISPLAY_PLANNED = {"planned": "planned (ME)", "planned-throughput": "planned (throughput)"}

# The targets at the most nodes: (key, what, model it is judged on (None: any), the columns
# judged (the best of them counts), the row's field, at least this: a number, or a column whose figure
# the best must not fall below with the spreads apart (its _min against the best's _max))
TARGETS = [
    ("me_vs_dp", "planned (ME) at least 8x DP's ME", None, ("planned",), "me_vs_dp", 8.0),
    (
        "throughput_vs_1f1b",
        "planned (throughput) at least 1.8x stock 1F1B",
        "vgg16",
        ("planned-throughput",),
        "vs_1f1b",
        1.8,
    ),
    (
        "never_below_job",
        "planned (throughput) never below the job as it is (hippie-1f1b), spreads apart",
        None,
        ("planned-throughput",),
        "vs_1f1b",
        "hippie-1f1b",
    ),
    (
        "scaling",
        "the best hippie column's scaling from one node at least 0.90 (the paper)",
        "gnmt16",
        ("hippie-1f1b", "planned", "planned-throughput"),
        "scaling",
        0.90,
    ),
]


def name_of(s: str) -> str:
    return DISPLAY_PLANNED.get(s) or DISPLAY.get(s, s)


MEMORY_TERMS = (
    "Memory is predicted on the terms the bench counts (state, deferral buffers, weight versions and kept "
    "activations: live state and saved tensors); *with working memory* adds the planner's estimate of one "
    "layer's forward+backward temporaries, which no such count sees."
)


def _gb(x):
    return _f(x / 1e9 if x else None, "{:.2f}")


def _pct(x):
    return _f(x, "{:+.1%}")


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'. Pure."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out) or "none"


def plan_cell(plan: dict) -> str:
    deferred = (plan.get("schedule_params") or {}).get("deferred_stages")
    layers = plan.get("deferred_layers") or {}
    return (
        f"{plan['schedule']}, {plan['pipeline_depth']} stages x {plan['data_parallel']}, "
        f"{plan['micro_batches']} x {plan['micro_batch_size']}, boundaries {plan['boundaries']}, re-computed "
        f"{_ranges(plan['checkpointed_layers'])}"
        + (f", deferred stages {deferred}" if deferred not in (None, [], "-") else "")
        + (f", deferred layers {layers}" if layers else "")
    )


def planned_rows(summary: dict):
    for n, rows in summary["by_nodes"].items():
        for s, r in rows.items():
            if r.get("plan"):
                yield n, s, r


def planned_section(summary: dict) -> list[str]:
    """The plans against their runs: what was planned, whether the run used it, and the predicted
    figures beside the measured ones."""
    found = list(planned_rows(summary))
    if not found:
        return []
    lines = [
        "## Planned columns: the planner's plans trained on the emulated cluster",
        "",
        "Each plan is `hippie-ds plan` for that emulated cluster (command in results.json, `plans`), run "
        "through the DeepSpeed config key `hippie.plan`. *used*: the run's stage boundaries and re-computed "
        "layers, as every rank recorded them, are the plan's. Error = (predicted - measured) / measured. "
        + MEMORY_TERMS,
        "",
    ]
    body = [[n, name_of(s), plan_cell(r["plan"]), "yes" if r.get("used_plan") else "**no**"] for n, s, r in found]
    lines += table(["nodes", "column", "plan", "used"], body) + [""]
    body = []
    for n, s, r in found:
        body.append(
            [
                n,
                name_of(s),
                _f(r.get("step_s")),
                _f(r.get("plan_predicted_step_s")),
                _pct(r.get("plan_step_error")),
                _f(r["memory_bytes"] / 1e9 if r.get("memory_bytes") else None, "{:.2f}"),
                _gb(r.get("plan_predicted_counted_memory_bytes") or r.get("plan_predicted_memory_bytes")),
                _pct(r.get("plan_memory_error")),
                _gb(r.get("plan_predicted_memory_bytes")),
                _f(r.get("me"), "{:.3g}"),
                _f(r.get("plan_predicted_me"), "{:.3g}"),
                _pct(r.get("plan_me_error")),
                _f(r.get("me_vs_dp"), "{:.2f}x"),
                _f(r.get("plan_predicted_me_vs_dp"), "{:.2f}x"),
                _pct(r.get("plan_me_vs_dp_error")),
            ]
        )
    lines += table(
        [
            "nodes",
            "column",
            "step (s)",
            "predicted",
            "error",
            "memory/device (GB)",
            "predicted",
            "error",
            "with working memory",
            "ME",
            "predicted",
            "error",
            "ME vs DP",
            "predicted",
            "error",
        ],
        body,
    )
    errs = [abs(r[k]) for _, _, r in found for k in ("plan_step_error", "plan_me_error") if r.get(k) is not None]
    if errs:
        lines += [
            "",
            f"The planner's step and ME: {sum(e <= 0.10 for e in errs)} of {len(errs)} within 10% "
            f"(worst {max(errs):.1%}).",
        ]
    return lines + [""]


def baselines_section(summary: dict) -> list[str]:
    """The planner's baselines against the bench's runs of the same shape (DP as DeepSpeed's engine
    runs it, stock 1F1B, GPipe+DP, the job as it is): predicted step and memory per device beside the
    measured ones."""
    body, errs = [], []
    for n, rows in summary["by_nodes"].items():
        for s, r in rows.items():
            if r.get("planner_baseline") is None:
                continue
            errs += [abs(r[k]) for k in ("planner_step_error", "planner_memory_error") if r.get(k) is not None]
            body.append(
                [
                    n,
                    name_of(s),
                    f"`{r['planner_baseline']}`",
                    _f(r.get("step_s")),
                    _f(r.get("planner_predicted_step_s")),
                    _pct(r.get("planner_step_error")),
                    _f(r["memory_bytes"] / 1e9 if r.get("memory_bytes") else None, "{:.2f}"),
                    _gb(r.get("planner_predicted_counted_memory_bytes") or r["planner_predicted_memory_bytes"]),
                    _pct(r.get("planner_memory_error")),
                    _gb(r["planner_predicted_memory_bytes"]),
                ]
            )
    if not body:
        return []
    lines = [
        "## The planner's baselines against the runs",
        "",
        "Each baseline a plan of that node count printed with the run's own shape (stages x data-parallel, "
        "micro-batches, cut): its predicted step and memory per device beside the measured ones. " + MEMORY_TERMS,
        "",
    ]
    header = ["nodes", "column", "baseline", "step (s)", "predicted", "error", "memory (GB)", "predicted", "error"]
    lines += table(header + ["with working memory"], body)
    lines += ["", f"The planner on its baselines: {sum(e <= 0.10 for e in errs)} of {len(errs)} within 10% "]
    lines[-1] += f"(worst {max(errs):.1%})." if errs else "."
    return lines + [""]


def cpu_section(summary: dict, waited_share: float) -> list[str]:
    """Each run's CPU per step, and the runs whose ranks waited for a core."""
    body, flagged = [], []
    for n, rows in summary["by_nodes"].items():
        for s, r in rows.items():
            if r.get("cpu_s_per_step_all_ranks") is None:
                continue
            if r.get("waited_for_core"):
                flagged.append(f"{name_of(s)} on {n} node(s)")
            body.append(
                [
                    n,
                    name_of(s),
                    _f(r.get("step_s")),
                    _f(r["cpu_s_per_step_all_ranks"]),
                    _f(r.get("cores"), "{}"),
                    _f(r.get("cpu_load_vs_cores"), "{:.2f}"),
                    _f(r.get("cpu_share_median"), "{:.0%}"),
                    _f(r.get("runqueue_wait_share_max"), "{:.1%}"),
                    "**waited for a core**" if r.get("waited_for_core") else "no",
                ]
            )
    if not body:
        return []
    lines = [
        "## CPU per step: which runs waited for a core",
        "",
        "Per run: the CPU time every rank spent in a timed step (process CPU, all threads; median over steps, "
        "summed over ranks), over what its cores give in a step (*load vs cores*: above 1 the ranks asked for "
        "more CPU than the cores had); a rank's CPU over its step's wall (median rank); and the largest share of "
        "the step a rank's main thread (the one running its instructions) sat runnable on a run queue, "
        "waiting for a core (the kernel's schedstat; "
        f"worst round). A run whose rank waited more than {waited_share:.0%} of its step is flagged: its "
        "figures measure the machine's contention as much as the schedule.",
        "",
    ]
    lines += table(
        [
            "nodes",
            "schedule",
            "step (s)",
            "CPU s/step, all ranks",
            "cores",
            "load vs cores",
            "CPU/wall (median rank)",
            "run-queue wait (worst rank)",
            "flag",
        ],
        body,
    )
    lines += [
        "",
        ("Waited for a core: " + ", ".join(flagged) + ".")
        if flagged
        else "No run's ranks waited for a core beyond the threshold.",
    ]
    return lines + [""]


def targets(summary: dict, model: str) -> list[dict]:
    """The issue's targets for this model: met, missed (with the measured figure), or not judged here
    (another model, or no figure). Pure."""
    top = max(summary["by_nodes"], key=int)
    here = summary["by_nodes"][top]
    out = []
    for key, what, on, columns, field, least in TARGETS:
        if on is not None and on != model:
            continue
        rows = {s: here[s] for s in columns if s in here}
        figures = {s: r.get(field) for s, r in rows.items() if r.get(field) is not None}
        best = max(figures, key=figures.get) if figures else None
        if isinstance(least, str):  # not below that column, the spreads apart
            ref = here.get(least) or {}
            floor = ref.get(f"{field}_min", ref.get(field))
            high = (rows.get(best) or {}).get(f"{field}_max", figures.get(best)) if best else None
            met = None if best is None or floor is None else not high < floor
        else:
            floor = least
            met = None if best is None else figures[best] >= least
        out.append(
            {
                "key": key,
                "target": what,
                "nodes": int(top),
                "field": field,
                "least": floor,
                "figures": figures,
                "best": best,
                "met": met,
                "waited_for_core": [s for s in rows if rows[s].get("waited_for_core")],
            }
        )
    return out


def targets_section(summary: dict, model: str) -> list[str]:
    found = targets(summary, model)
    if not found:
        return []
    lines = ["## The issue's targets on this model", ""]
    body = []
    for t in found:
        figures = ", ".join(f"{name_of(s)} {v:.2f}" for s, v in t["figures"].items()) or "-"
        verdict = "-" if t["met"] is None else "met" if t["met"] else "**missed**"
        cpu = ", ".join(name_of(s) for s in t["waited_for_core"]) or "none"
        least = "-" if t["least"] is None else f"{t['least']:.2f}"
        body.append([t["target"], least, f"{t['nodes']} nodes: {figures}", verdict, cpu])
    return (
        lines + table(["target", "at least", "measured", "verdict", "planned runs that waited for a core"], body) + [""]
    )


def machine_line(cfg: dict) -> str:
    m = cfg.get("machine") or {}
    if not m:
        return ""

    def load(key):
        return "/".join(f"{x:.1f}" for x in m.get(key) or []) or "-"

    return (
        f"Machine: {m.get('host')} ({m.get('cpu')}, {m.get('cores')} cores, {m.get('cores_usable')} usable); "
        f"load average (1/5/15 min) {load('load_average_at_start')} when the runs began, {load('load_average')} "
        "when the analysis ran."
    )
