"""The figures of ``python -m tools.bench scaling`` (tools/bench/studies/scaling.py) per node count and
schedule: ratios per round, scaling from one node, scalability, memory and ME against DP, the planned
columns' predictions beside them, the CPU verdict; every time divided back by its row's dilation D
(tools/bench/studies/row_dilation.py: a row that waited for a core ran again at a larger D). Pure."""

from __future__ import annotations

from tools.bench.figures import round_ratios, spread_excludes

NAMES = {1: "one_node", 2: "two_nodes", 4: "four_nodes", 8: "eight_nodes"}
# a rank that waited for a core longer than this share of the step measured the machine's contention
WAITED_FOR_CORE = 0.05
# how scaling.dilated slows a transfer, as results.json records it (results before it scaled the tensors by D)
DILATION_RULE = "rate / D"


def host_cores(a, nodes: int) -> float:
    """Cores of host each rank has, in dilated time, on ``nodes`` nodes: D x cores / ranks of the
    busiest core (nodes are pinned round-robin to ``--cores``). Pure."""
    per_core = -(-nodes // len(a.core_list)) * a.stages
    return a.dilate / per_core


def config_name(nodes: int) -> str:
    """The runs' key of a node count: one_node, two_nodes, four_nodes, ... (``N_nodes`` otherwise)."""
    return NAMES.get(nodes, f"{nodes}_nodes")


def emulated_memory(r: dict, scale: float) -> float | None:
    """Mean bytes per rank an emulated device would hold: parameters, gradients, optimizer state and
    the peak saved for backward, divided by the model's scale (the profile's real sizes)."""
    state, saved = r.get("mean_state_bytes"), r.get("mean_peak_saved_bytes")
    if state is None or saved is None:
        return None
    return (state + saved) / scale


def summarize(
    runs: dict,
    node_counts: list[int],
    scale: float,
    plans: dict | None = None,
    cores: int | None = None,
    dilation: float = 1.0,
) -> dict:
    """Per node count and schedule: ratios to 1F1B and DP per round, scaling from one node per
    round, scalability, memory and ME against DP (the paper's definitions); the planned columns'
    predictions beside their measured figures (``plans``: {(nodes, name): scaling_plan.plan_record});
    each run's CPU per step against ``cores`` (the cores its nodes were pinned to, at most one per
    node). ``dilation`` D: the job's; each run at its own D (its ``dilation``, else the job's) has
    times D x the emulated cluster's, and so is reported / D (throughput x D), ratios and scaling
    taken between such undilated figures; ``scale`` is the tensors' (scaling_plan.tensor_scale: the
    same at every D). Pure."""
    single_run = (runs.get("one_device") or {}).get("dp") or {}
    single = undilated(single_run, dilation).get("throughput_samples_s")
    one = runs.get(config_name(1), {})
    out = {"single_device_throughput": single, "by_nodes": {}}
    for n in node_counts:
        here = runs.get(config_name(n), {})
        devices = next(iter(here.values()))["world"] if here else n  # every run on n nodes uses them all
        rows = {}
        for s, r in here.items():
            d = r.get("dilation") or dilation
            rows[s] = _row(
                s,
                undilated(r, dilation),
                {k: undilated(v, dilation) for k, v in here.items()},
                undilated(one.get(s) or {}, dilation),
                n,
                devices,
                single,
                scale,
                d,
            )
            rows[s]["dilation_tried"] = r.get("dilation_tried")
            rows[s].update(cpu_fields(r, min(n, cores) if cores else None))
        dp_me = (rows.get("dp") or {}).get("me")
        for row in rows.values():
            row["me_vs_dp"] = row["me"] / dp_me if row.get("me") and dp_me else None
        for s, row in rows.items():
            if (n, s) in (plans or {}):
                row.update(planned_fields(row, here[s], plans[(n, s)]))
        baselines = [b for (m, _), p in sorted((plans or {}).items()) if m == n for b in p.get("baselines") or []]
        for s, row in rows.items():
            if s not in PLANNED_COLUMNS:
                row.update(planner_baseline_fields(s, row, baselines))
        out["by_nodes"][str(n)] = rows
    return out


def undilated(r: dict, dilation: float) -> dict:
    """The run's throughputs (median and per round) x its own D (``dilation``: where it records
    none), so that runs at different D compare. Pure."""
    d = r.get("dilation") or dilation
    out = dict(r)
    if r.get("throughput_samples_s"):
        out["throughput_samples_s"] = r["throughput_samples_s"] * d
    if r.get("round_throughput_samples_s"):
        out["round_throughput_samples_s"] = [x * d if x else x for x in r["round_throughput_samples_s"]]
    return out


PLANNED_COLUMNS = ("planned", "planned-throughput")
# the planner's baseline that predicts a bench column: (its name, its schedule); the pipelines are the
# job as it is on DeepSpeed's uniform cut with the deferral a job without a plan runs (not searched)
BASELINE_OF = {
    "dp": ("dp", "1f1b"),
    "1f1b": ("job:uniform", "1f1b"),
    "gpipe": ("job:uniform", "gpipe"),
    "hippie-1f1b": ("job:uniform", "hippie-1f1b"),
}


def planner_baseline_fields(column: str, row: dict, baselines: list[dict]) -> dict:
    """The planner's prediction of a measured baseline column (DP, stock 1F1B, GPipe+DP, the job as it
    is): the first baseline any plan of the node count printed under that column's name and schedule
    with the run's shape (stages x data-parallel, micro-batch size and count, cut), its predicted step
    and memory per device and their errors against the row. {} where no plan printed one. Pure."""
    want = BASELINE_OF.get(column)
    if want is None:
        return {}
    stages = 1 if column == "dp" else len(row.get("parts") or []) - 1
    if stages < 1 or not row.get("devices"):
        return {}
    shape = (stages, row["devices"] // stages, row.get("micro_batch_size"), row.get("micro_batches"))
    for b in baselines:
        if (b["name"], b["schedule"]) != want:
            continue
        if (b["pipeline_depth"], b["data_parallel"], b["micro_batch_size"], b["micro_batches"]) != shape:
            continue
        if column != "dp" and b["boundaries"] != row.get("parts"):
            continue
        return {
            "planner_baseline": b["name"],
            "planner_predicted_step_s": b["step_s"],
            "planner_step_error": _error(b["step_s"], row.get("step_s")),
            "planner_predicted_memory_bytes": b["memory_bytes"],
            "planner_predicted_counted_memory_bytes": b.get("counted_memory_bytes"),
            "planner_memory_error": _error(_counted(b), row.get("memory_bytes")),
        }
    return {}


def _counted(predicted: dict) -> float:
    """A prediction's memory on the bench's terms (scaling_plan.counted_memory), else all of it (an
    older plan file: the working memory in it)."""
    counted = predicted.get("counted_memory_bytes")
    return predicted["memory_bytes"] if counted is None else counted


def _error(predicted, measured):
    return (predicted - measured) / measured if predicted is not None and measured else None


def planned_fields(row: dict, run: dict, plan: dict) -> dict:
    """A planned column's plan and its predictions beside the measured row: step, memory per device,
    ME and ME against DP, each with its error ((predicted - measured) / measured); ``used_plan``: the
    run's stage boundaries and re-computed layers are the plan's (as its ranks recorded them). Pure."""
    p = plan["predicted"]
    return {
        "plan": {
            k: plan[k]
            for k in (
                "objective",
                "schedule",
                "pipeline_depth",
                "data_parallel",
                "micro_batch_size",
                "micro_batches",
                "boundaries",
                "checkpointed_layers",
                "schedule_params",
                "deferred_layers",
                "command",
                "file",
            )
        },
        "used_plan": run.get("parts") == plan["boundaries"]
        and run.get("checkpointed_layers") == plan["checkpointed_layers"],
        "plan_predicted_step_s": p["step_s"],
        "plan_step_error": _error(p["step_s"], row.get("step_s")),
        "plan_predicted_memory_bytes": p["memory_bytes"],
        "plan_predicted_counted_memory_bytes": p.get("counted_memory_bytes"),
        "plan_memory_error": _error(_counted(p), row.get("memory_bytes")),
        "plan_predicted_me": p["me"],
        "plan_me_error": _error(p["me"], row.get("me")),
        "plan_predicted_me_vs_dp": p["me_vs_dp"],
        "plan_me_vs_dp_error": _error(p["me_vs_dp"], row.get("me_vs_dp")),
        "plan_predicted_by": p["predicted_by"],
    }


def cpu_fields(r: dict, cores: int | None) -> dict:
    """A run's CPU per step (analysis.cpu_figures) and its verdict: ``waited_for_core`` when in any
    round a rank waited for a core more than WAITED_FOR_CORE of the step (the run then measures the
    machine's contention: reported, not averaged in); ``cpu_load_vs_cores``: the CPU every rank asked
    per step over what ``cores`` give in a step. Pure."""
    waits = [w for w in (r.get("round_runqueue_wait_share_max") or [r.get("runqueue_wait_share_max")]) if w is not None]
    total, step = r.get("cpu_s_per_step_all_ranks"), r.get("median_step_s")
    return {
        "cpu_s_per_step_all_ranks": total,
        "cpu_share_median": r.get("cpu_share_median"),
        "runqueue_wait_share_max": max(waits) if waits else None,
        "waited_for_core": max(waits) > WAITED_FOR_CORE if waits else None,
        "cores": cores,
        "cpu_load_vs_cores": total / (step * cores) if total is not None and step and cores else None,
    }


def _row(
    name: str, r: dict, here: dict, one: dict, n: int, devices: int, single, scale: float, dilation: float = 1.0
) -> dict:
    """One row; ``r``, ``here`` and ``one`` with undilated throughputs (``undilated``), the times still
    the run's own at ``dilation``, its D."""
    thr = r.get("throughput_samples_s")

    def t(x):  # a dilated time, back to the emulated cluster's
        return x / dilation if x is not None else None

    v1 = round_ratios(r.get("round_throughput_samples_s"), (here.get("1f1b") or {}).get("round_throughput_samples_s"))
    vd = round_ratios(r.get("round_throughput_samples_s"), (here.get("dp") or {}).get("round_throughput_samples_s"))
    sc = round_ratios(r.get("round_throughput_samples_s"), one.get("round_throughput_samples_s"))
    mem = emulated_memory(r, scale)
    scal = thr / (devices * single) if thr and single else None
    pred = r.get("prediction") or {}
    return {
        "dilation": dilation,
        "step_s": t(r.get("median_step_s")),
        "step_min": t(r.get("median_step_s_min")),
        "step_max": t(r.get("median_step_s_max")),
        "throughput": thr,
        "devices": devices,
        "vs_1f1b": v1["median"],
        "vs_1f1b_min": v1["min"],
        "vs_1f1b_max": v1["max"],
        "real_vs_1f1b": spread_excludes(v1["min"], v1["max"]) if v1["n"] > 1 and name != "1f1b" else None,
        "vs_dp": vd["median"],
        "vs_dp_min": vd["min"],
        "vs_dp_max": vd["max"],
        "scaling": sc["median"] / n if sc["median"] else None,
        "scaling_min": sc["min"] / n if sc["min"] else None,
        "scaling_max": sc["max"] / n if sc["max"] else None,
        "scaling_rounds": [x / n if x else None for x in sc["rounds"]],
        "memory_bytes": mem,
        "scalability": scal,
        "me": scal * thr / (mem / 1e9) if scal and mem else None,
        "exposed_allreduce_s": {k: t(v) for k, v in (r.get("exposed_allreduce_s_per_step") or {}).items()},
        "predicted_step_s": t(pred.get("step_time")),
        "prediction_error": pred.get("error"),
        "layout": (f"DP x{r['world']}" if name == "dp" else f"{r['stages']} stages x {r['world'] // r['stages']}"),
        "micro_batches": r.get("micro_batches"),
        "micro_batch_size": r.get("micro_batch_size"),
        "parts": r.get("parts"),
        "checkpointed_layers": r.get("checkpointed_layers"),
        "deferred_stages": (r.get("schedule_params") or {}).get("deferred_stages"),
        "delayed_fraction": r.get("delayed_fraction"),
    }
