"""The benchmark's projection: scaling efficiency of the schedules on 16, 64 and 1,024 V100s,
from the planner's cost model refined by the simulator on the PipeDream V100 profiles (VGG-16,
GNMT-8, GNMT-16). Pure Python, no processes."""

from __future__ import annotations

from pathlib import Path

from tools.bench import REPO
from tools.bench.figures import GB

PROJECTION_MODELS = (("vgg16", "VGG-16"), ("gnmt", "GNMT-8"), ("gnmt_large", "GNMT-16"))
PROJECTION_SCHEDULES = ("dp", "gpipe", "1f1b", "hippie", "hippie-1f1b")


def projection(
    models=PROJECTION_MODELS,
    sizes=(16, 64, 1024),
    devices_per_node=4,
    schedules=PROJECTION_SCHEDULES,
    depth=None,
    objective="throughput",
    batch_per_device=0,
    profile_dir=None,
    cluster_tail="16GB,100Gbit",
    progress=None,
) -> dict:
    """Scaling efficiency (planner's scalability: throughput / (P x single-device throughput)) per
    model, cluster size and schedule, from the planner's cost model refined by the simulator.
    Pipeline schedules: depth ``depth`` (default: a pipeline per node, ``devices_per_node``
    stages; 0: the planner's choice), the planner choosing micro-batches, partition and
    re-computation for ``objective``; dp: the planner's data-parallel baseline (all-reduce
    overlapped with the last backward); 'planner': the Hippie planner's free choice (ME
    objective, every schedule and depth). Global batch = batch_per_device (default: the
    profile's batch) x P (weak scaling). Pure Python."""
    from hippie_ds.planner import make_plan, parse_cluster, read_pipedream
    from hippie_ds.planner.profile import PlannerError

    profile_dir = Path(profile_dir) if profile_dir else _profile_dir()
    depth = devices_per_node if depth is None else depth
    rows = []
    for key, title in models:
        prof = read_pipedream(profile_dir / f"{key}.txt")
        for P in sizes:
            if P % devices_per_node:
                raise ValueError(f"{P} devices is not a multiple of {devices_per_node} per node")
            cluster = parse_cluster(f"{P // devices_per_node}x{devices_per_node},{cluster_tail}")
            G = (batch_per_device or prof.batch_size) * P
            if progress:
                progress(f"projection: {title} on {P} devices ({cluster.nodes}x{devices_per_node}), global batch {G}")
            free = make_plan(prof, cluster, G, objective="me", baselines=True, baseline_budget=0)
            dp = next((b for b in free.baselines if b.name == "dp"), None)
            dp_me = dp.prediction.me if dp and dp.prediction else None

            def row(schedule, plan_like, pred, note=""):
                return {
                    "model": title,
                    "profile": key,
                    "devices": P,
                    "nodes": cluster.nodes,
                    "schedule": schedule,
                    "global_batch": G,
                    "pipeline_depth": plan_like.pipeline_depth,
                    "data_parallel": plan_like.data_parallel,
                    "micro_batch_size": plan_like.micro_batch_size,
                    "micro_batches": plan_like.micro_batches,
                    "deferred_stages": plan_like.schedule_params.get("deferred_stages"),
                    "step_time_s": pred.step_time,
                    "throughput_samples_s": pred.throughput,
                    "scaling_efficiency": pred.scalability,
                    "memory_mean_gb": pred.memory / GB,
                    "memory_max_gb": pred.memory_max / GB,
                    "me": pred.me,
                    "me_vs_dp": pred.me / dp_me if dp_me else None,
                    "fits": pred.fits,
                    "predicted_by": pred.predicted_by,
                    "note": note,
                }

            for s in schedules:
                if s == "dp":
                    if dp and dp.prediction:
                        rows.append(row("dp", dp, dp.prediction, "all-reduce overlapped with the last backward"))
                    continue
                try:
                    p = make_plan(
                        prof,
                        cluster,
                        G,
                        schedules=[s],
                        objective=objective,
                        depths=[depth] if depth else None,
                        baselines=False,
                    )
                except PlannerError as exc:
                    rows.append({"model": title, "profile": key, "devices": P, "schedule": s, "error": str(exc)})
                    continue
                rows.append(row(s, p, p.prediction))
            rows.append(row("planner", free, free.prediction, f"{free.schedule}, ME objective, free depth"))
    return {
        "sizes": list(sizes),
        "devices_per_node": devices_per_node,
        "depth": depth,
        "objective": objective,
        "cluster": f"NODESx{devices_per_node},{cluster_tail}",
        "batch_per_device": batch_per_device or "profile",
        "rows": rows,
    }


def _profile_dir() -> Path:
    for d in (Path("/work/shared/profiles/pipedream"), REPO / "tests" / "data" / "pipedream"):
        if (d / "vgg16.txt").exists():
            return d
    raise FileNotFoundError("no PipeDream profiles (tests/data/pipedream/ is vendored in the repository)")


def link_scaling(
    models=PROJECTION_MODELS[:2],
    rates=("10Gbit", "1Gbit", "250Mbit"),
    devices_per_node=4,
    schedules=("1f1b", "hippie", "hippie-1f1b"),
    device_memory="16GB",
    profile_dir=None,
    progress=None,
) -> list[dict]:
    """Scaling efficiency from one node to two against the inter-node rate on GPUs, as the
    simulator predicts it: throughput(2 nodes) / (2 x throughput(1 node)), a pipeline of
    ``devices_per_node`` stages per node (weak scaling: the profile's batch per device), the
    planner choosing micro-batches, partition, re-computation and the deferred stages for
    throughput. The analogue of python -m tools.bench link-sweep's measurement, where no CPU core is
    shared between compute and communication. Pure Python."""
    from hippie_ds.planner import make_plan, parse_cluster, read_pipedream

    profile_dir = Path(profile_dir) if profile_dir else _profile_dir()
    rows = []
    for key, title in models:
        prof = read_pipedream(profile_dir / f"{key}.txt")
        for rate in rates:
            for s in schedules:
                if progress:
                    progress(f"{title}, {rate}, {s}")
                plans = {
                    n: make_plan(
                        prof,
                        parse_cluster(f"{n}x{devices_per_node},{device_memory},{rate}"),
                        prof.batch_size * devices_per_node * n,
                        schedules=[s],
                        objective="throughput",
                        depths=[devices_per_node],
                        baselines=False,
                    )
                    for n in (1, 2)
                }
                one, two = plans[1].prediction, plans[2].prediction
                rows.append(
                    {
                        "model": title,
                        "rate": rate,
                        "schedule": s,
                        "step_one_node_s": one.step_time,
                        "step_two_nodes_s": two.step_time,
                        "scaling": two.throughput / (2 * one.throughput),
                        "deferred_stages": plans[2].schedule_params.get("deferred_stages"),
                    }
                )
    return rows
