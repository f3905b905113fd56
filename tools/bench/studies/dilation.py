"""``python -m tools.bench dilation``: does the time dilation hold? The scaling study's cluster at one node
count (default VGG-16, 4 nodes x 4), stock 1F1B and the planned columns (one fixed plan each), run at
several dilations D.

With D, every device time and transfer is D x longer and the host's CPU per instruction is not, so
a step measured at D and divided back by D is T(D) = T_inf + h / D: T_inf the emulated cluster's own
step, h / D what its ranks still wait for the host (and for each other's cores). The study fits that
line (least squares in 1 / D) per schedule over the D that give each rank at least one core of host
(D >= ranks on a core: below it the waits grow faster than 1 / D; the fit over every D is reported
too) and reports, per D, how far the step lies above T_inf: T(D) per row, each row's smallest D within
``--within`` (5%) of its T_inf (the D its figure needs), and the smallest D within it for every schedule.
Each planned column (``planned``: the ME objective, ``planned-throughput``: the throughput one) is the
planner's at the first D of ``--dilations`` (the scaling study's default) and is then re-planned at every
other D with the same depth, schedule, micro-batch size and boundaries (a plan's fingerprint holds the
ranks' bytes, x D), so every D runs the same configuration; the report says whether the re-computed
layers agreed too. No row is rerun at a larger D here (the scaling study's ``--max-dilate`` is each D).

Writes OUT/D<d>/ (each D's scaling study: runs, plans, its results.json), OUT/results.json and
OUT/report.md; the host cost fitted from the first D's runs into OUT/host_cost.json (what the scaling
study's ``--host-cost`` takes). ``--publish DIR`` copies results.json, report.md and host_cost.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.bench.publish import publish

WITHIN = 0.05


def fit_dilation(points: list[tuple[float, float]]) -> dict:
    """Least squares of T(D) = T_inf + h / D over ``points`` [(D, step / D)]; each D's excess
    T(D) / T_inf - 1. Pure."""
    xs, ys = [1 / d for d, _ in points], [t for _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    h = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    t_inf = my - h * mx
    return {
        "t_inf": t_inf,
        "h": h,
        "points": [{"dilation": d, "step_s": t, "excess": t / t_inf - 1 if t_inf > 0 else None} for d, t in points],
    }


def fits_above(steps: dict, least: float) -> dict:
    """Per schedule the fit over the D of at least ``least`` (ranks on a core: below it a rank has less
    than a core of host, the waits grow faster than 1 / D and no line holds), where two such D
    were run. Pure."""
    return {
        name: fit_dilation([(d, t) for d, t in points if d >= least])
        for name, points in steps.items()
        if sum(d >= least for d, _ in points) >= 2
    }


def smallest_dilation(fits: dict, within: float = WITHIN) -> float | None:
    """The smallest D whose fitted T(D) = T_inf + h / D is within ``within`` of T_inf for every
    schedule (h / D <= within x T_inf), among the D measured; None when none is. Pure."""
    measured = sorted({p["dilation"] for f in fits.values() for p in f["points"]})
    for d in measured:
        if all(f["t_inf"] > 0 and f["h"] / d <= within * f["t_inf"] for f in fits.values()):
            return d
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench dilation",
        description=__doc__.split("\n\n")[0],
        epilog="example: sudo .venv/bin/python -m tools.bench dilation --model emulated:vgg16 "
        "--nodes 4 --dilations 16,4,8,32 --publish docs/bench/dilation/vgg16. Other "
        "options go to the scaling study (python -m tools.bench scaling --help).",
    )
    p.add_argument("--nodes", type=int, default=4, help="the one node count measured")
    p.add_argument(
        "--dilations",
        default="16,4,8,32",
        help="the D to run, the first the one the fixed plan is made at (the scaling study's default)",
    )
    p.add_argument(
        "--schedules",
        default="1f1b,planned,planned-throughput",
        help="the scaling study's columns to run at each D (a planned one: its plan fixed at the first D)",
    )
    p.add_argument("--within", type=float, default=WITHIN, help="how close to T_inf the chosen D must be")
    p.add_argument("--out", default="out/bench/dilation")
    p.add_argument("--publish", default=None, metavar="DIR")
    p.add_argument("--analyze-only", action="store_true", help="re-fit OUT/results.json of an earlier run")
    own, rest = p.parse_known_args(argv)
    try:
        own.dilation_list = [float(x) for x in own.dilations.split(",") if x.strip()]
    except ValueError:
        p.error(f"--dilations {own.dilations!r}: expected numbers, e.g. 16,4,8,32")
    if len(own.dilation_list) < 2 or min(own.dilation_list) < 1:
        p.error(f"--dilations {own.dilations!r}: at least two D of at least 1 (a line needs two points)")
    return own, rest


def study_args(own, rest: list[str], d: float, out: Path):
    """The scaling study's options at dilation ``d``: one node count, no single-device run, no
    link calibration (the simulator is not what this study checks)."""
    from tools.bench.studies import scaling

    a = scaling.parse_args(
        [
            "--nodes",
            f"1,{own.nodes}" if own.nodes != 1 else "1,2",
            "--dilate",
            str(d),
            "--schedules",
            own.schedules,
            "--no-single",
            "--resume",
            "--out",
            str(out),
            *rest,
        ]
    )
    a.node_counts, a.link_efficiency_given, a.max_dilate = [own.nodes], True, d  # T(D) at every D: no reruns
    a.command = " ".join(["python -m tools.bench dilation", *sys.argv[1:]])
    return a


def fix_plan(first: Path, a, out: Path, name: str = "planned") -> dict:
    """Re-plan the plan at ``first`` for ``a``'s dilation with its depth, schedule, micro-batch size and
    boundaries, into the scaling study's plan path of the column ``name`` under ``out``; what it chose
    beside the first."""
    from hippie_ds.planner import load_plan, make_plan, parse_cluster, save_plan
    from tools.bench.studies.scaling_plan import cluster_record, emulated_profile, plan_path, tensor_scale

    p0 = load_plan(first)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    cluster_file = out / "plans" / f"cluster_{a.node_counts[0]}_nodes.json"
    cluster_file.write_text(json.dumps(cluster_record(a, a.node_counts[0]), indent=1))
    profile = emulated_profile(a.model.split(":", 1)[1], tensor_scale(a), a.emulate_speedup)
    plan = make_plan(
        profile,
        parse_cluster(str(cluster_file)),
        p0.global_batch,
        objective=p0.objective,
        schedules=(p0.schedule,),
        depths=(p0.pipeline_depth,),
        micro_batch_sizes=(p0.micro_batch_size,),
        boundaries=p0.boundaries,
        candidates=0,
        baselines=False,
    )
    save_plan(plan, plan_path(out, a.node_counts[0], name))
    return {
        "same_configuration": (plan.schedule, plan.micro_batches, list(plan.boundaries))
        == (p0.schedule, p0.micro_batches, list(p0.boundaries)),
        "same_recomputation": list(plan.checkpointed_layers) == list(p0.checkpointed_layers),
    }


def main(argv=None) -> int:
    from tools.bench.studies import scaling
    from tools.bench.studies.host_samples import fit_runs

    own, rest = parse_args(argv)
    out = Path(own.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if own.analyze_only:
        results = json.loads((out / "results.json").read_text())
        steps = {}
        for d, entry in results["per_dilation"].items():
            for name, row in entry["rows"].items():
                steps.setdefault(name, []).append((float(d), row["step_s"]))
        return finish(own, out, results, steps, study_args(own, rest, own.dilation_list[0], out / "unused"))
    from tools.bench.studies.scaling_plan import load_plans, plan_path, planned_names, tensor_scale

    steps: dict[str, list] = {}
    per_d, first = {}, None
    for d in own.dilation_list:
        out_d = out / f"D{d:g}"
        a = study_args(own, rest, d, out_d)
        fixed = {
            name: fix_plan(plan_path(first, own.nodes, name), a, out_d, name)
            for name in planned_names(a.schedule_list)
            if first is not None
        } or None
        print(f"dilation D = {d:g}: {out_d}", flush=True)
        scaling.measure(a, out_d)
        first = out_d if first is None else first  # the plans made at the first D
        runs = scaling.analyse(a, out_d, None)
        summary = scaling.summarize(runs, a.node_counts, tensor_scale(a), load_plans(a, out_d), len(a.core_list), d)
        rows = summary["by_nodes"][str(own.nodes)]
        per_d[f"{d:g}"] = {"rows": rows, "fixed_plan": fixed, "load_average": list(__import__("os").getloadavg())}
        for name, row in rows.items():
            steps.setdefault(name, []).append((d, row["step_s"]))
    # the host at the first D (the scaling study's default): its CPU per instruction does not depend on D
    # (scaling.dilated keeps the tensors' size), one D's runs fit it
    d0 = own.dilation_list[0]
    host = fit_runs(
        out / f"D{d0:g}" / "runs",
        source=f"fitted from every rank's instructions at D = {d0:g} "
        f"({out / f'D{d0:g}'}, python -m tools.bench dilation)",
    )
    results = {
        "command": " ".join(["python -m tools.bench dilation", *sys.argv[1:]]),
        "nodes": own.nodes,
        "per_dilation": per_d,
        "source": scaling.source_state(),
        "machine": scaling.machine(),
        "host_cost": host.model_dump() if host else None,
    }
    if host:
        (out / "host_cost.json").write_text(host.model_dump_json(indent=1))
    return finish(own, out, results, steps, a)


def finish(own, out: Path, results: dict, steps: dict, a) -> int:
    """Fit, write results.json and report.md, publish."""
    from tools.bench.studies.dilation_report import report
    from tools.bench.studies.scaling_summary import host_cores

    least = own.dilation_list[0] / host_cores(a, own.nodes)  # ranks on the busiest core
    fits = fits_above(steps, least)
    results.update(
        {
            "fits": fits,
            "fits_every_dilation": fits_above(steps, 0.0),
            "fitted_from_dilation": least,
            "within": own.within,
            "smallest_dilation": smallest_dilation(fits, own.within),
            "smallest_dilation_per_row": {name: smallest_dilation({name: f}, own.within) for name, f in fits.items()},
        }
    )
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "report.md").write_text(report(results))
    print(report(results))
    host = (out / "host_cost.json").exists()
    publish(
        own.publish,
        ("report.md", "results.json", "host_cost.json") if host else ("report.md", "results.json"),
        base=out,
    )
    return 0
