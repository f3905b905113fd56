"""The planned columns of ``python -m tools.bench scaling``: ``planned`` (the planner's memory-efficiency
objective, Hippie's) and ``planned-throughput`` (its throughput objective), planned by ``hippie-ds plan``
(the CLI's own code, run in this process) for each emulated cluster and run by the bench as a user runs
a plan: the DeepSpeed config names it under ``hippie.plan`` (tools/bench/workers/bench_worker.py
``--plan-config``), nothing set by hand.

The emulated cluster, as the planner sees it. An emulated model (tools/bench/emulated.py) holds the
profile's parameters and activations x ``--emulate-scale`` and sleeps the profiled time / ``--emulate-speedup``;
its link is the shaped rate (10 Gbit/s x 1e-3 = ``10mbit``). So the planner gets that model's own profile
(:func:`emulated_profile`: the PipeDream profile with every byte figure x scale, every time / speedup,
each layer named as the module names it, by its kind (``EmulatedConv2d``, ``EmulatedReLU``:
emulated.layer_class), and its parameter bytes as the module builds them, so the plan's fingerprint is
the module's) and the emulated cluster (:func:`cluster_record`): N nodes
x ``--stages`` devices, device memory ``--plan-memory`` x scale, the shaped link x ``--link-efficiency``
between nodes, ``--p2p-bandwidth``/``--p2p-latency`` inside. Every decision the planner makes is then the
one it makes for the real-sized cluster, but for the latency. Its predicted memory and ME are given
unscaled (memory / scale, ME x scale), as the bench gives the measured ones.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path

# bench name -> the planner's objective
PLANNED = {"planned": "me", "planned-throughput": "throughput"}
JOB_SCHEDULE = "hippie-1f1b"  # the bench's job as it is: --stages stages, --micro-batch-size, the uniform cut
DEVICE_MEMORY = 16e9  # V100 16GB: PipeDream's cluster A and the Hippie paper's GPUs


def planned_names(schedules) -> list[str]:
    return [s for s in schedules if s in PLANNED]


def emulated_profile(model: str, scale: float, speedup: float = 1.0):
    """The :class:`hippie_ds.planner.Profile` of the emulated model ``model`` (vgg16, gnmt8, gnmt16) as
    tools/bench/emulated.py builds it (the module docstring says how). What each layer keeps for backward
    is the module's own (:func:`emulated_saved`), not PipeDream's default (every layer's output): the
    emulated layers keep about half of that, as VGG-16's convolutions and ReLUs share one activation."""
    from hippie_ds.planner import LayerProfile, read_pipedream
    from tools.bench.emulated import MODELS, PROFILES, layer_class

    profile = read_pipedream(PROFILES / MODELS[model], model=model)
    saved, loss = emulated_saved(model, scale)
    layers = []
    for layer, kept in zip(profile.layers, saved):
        d = layer.model_dump()
        d["name"] = layer_class(layer.name).__name__  # its kind, as the module names it
        d["param_bytes"] = 4.0 * int(round(layer.param_bytes / 4 * scale))  # EmulatedLayer's weight
        for key in ("output_bytes", "input_bytes", "working_bytes"):
            if d[key] is not None:
                d[key] *= scale
        d.update(kept)
        for key in ("forward", "backward", "backward_weight", "recompute"):
            if d[key] is not None:
                d[key] /= speedup
        layers.append(LayerProfile(**d))
    return profile.model_copy(
        update=dict(
            model=f"emulated:{model}",
            layers=layers,
            loss=loss,
            cut_bytes=[c * scale for c in profile.cuts()],
            source=f"{profile.source}: bytes x {scale}, times / {speedup}, saved bytes measured on the module "
            "(tools/bench/studies/scaling_plan.py)",
        )
    )


def emulated_saved(model: str, scale: float) -> tuple[list[dict], object]:
    """([{saved_bytes, output_saved}] per layer, the loss's profile) of the emulated module at the
    profile's batch size, measured as ``hippie-ds profile`` measures any module (saved-tensor hooks,
    each storage once, attributed to the layer that made it). The layers are built without their waits
    (times 0): only what autograd keeps is read; the loss's times are the host's microseconds, 0 here
    as before."""
    import math

    import torch

    from hippie_ds.profiler import profile_layers
    from tools.bench.emulated import emulated_specs, input_elems, loss_fn, read_profile

    batch = read_profile(model).batch_size
    specs = emulated_specs(model, batch, scale, speedup=math.inf)
    torch.manual_seed(0)
    measured = profile_layers(
        specs,
        torch.randn(batch, input_elems(model, scale)),
        repeats=1,
        warmup=0,
        loss_fn=loss_fn,
        labels=torch.zeros(batch, 1),
    )
    kept = [{"saved_bytes": x.saved_bytes, "output_saved": x.output_saved} for x in measured.layers]
    loss = measured.loss.model_copy(update=dict(forward=0.0, backward=0.0, backward_weight=0.0, recompute=0.0))
    return kept, loss


def tensor_scale(a) -> float:
    """The emulated model's bytes as its ranks build them: --emulate-scale, at every dilation D
    (scaling.dilated slows the link instead)."""
    return a.emulate_scale


def cluster_record(a, nodes: int) -> dict:
    """The emulated cluster of ``nodes`` nodes, undilated, as a ``hippie-ds plan --cluster`` file holds
    it: the link between nodes at ``--rate`` (the ranks run it at rate / D, D x slower, as their
    device); inside a node, where transfers are unshaped copies that take the host's undilated time,
    ``--p2p-bandwidth`` x D and ``--p2p-latency`` / D; the host is the measured one (``--host-cost``)
    scaled to what a rank has of it: ranks on its core / (D x 1 core)."""
    from hippie_ds.planner.host import HostCost
    from tools.bench.cluster import parse_rate
    from tools.bench.studies.scaling_summary import host_cores

    d = getattr(a, "dilate", 1.0)
    rec = {
        "nodes": nodes,
        "devices_per_node": a.stages,
        "device_memory": a.plan_memory * tensor_scale(a),
        "inter_node_bandwidth": parse_rate(a.rate) * a.link_efficiency,
        "intra_node_bandwidth": a.p2p_bandwidth * d,
        "latency": a.p2p_latency / d,
    }
    if getattr(a, "host_cost", None):
        cores = host_cores(a, nodes)
        host = HostCost.model_validate_json(Path(a.host_cost).read_text())
        rec["host"] = host.scaled(
            1 / cores, f"each rank has {cores:.3g} cores of host: D = {d:g} x cores / ranks on a core"
        ).model_dump()
    return rec


def global_batch(a, nodes: int) -> int:
    """The global batch every column of ``nodes`` nodes trains: the pipelines' (and DP's)."""
    return a.micro_batch_size * a.micro_batches * nodes


def job_arg(a) -> str:
    """``hippie-ds plan --job``: the bench's job as it is, a candidate of every plan."""
    return f"{a.stages},{a.micro_batch_size},{JOB_SCHEDULE}"


def plan_path(out: Path, nodes: int, name: str) -> Path:
    return out / "plans" / f"{nodes}_nodes_{name}.json"


def make_plans(a, out: Path, log=print, reuse: bool = False) -> dict:
    """Plan every planned column for every node count (``hippie-ds plan``, in this process); returns
    {(nodes, name): record} (:func:`plan_record`). Writes OUT/plans/: the profile, one cluster file per
    node count, the plans and each command's output."""
    from hippie_ds.cli import main as hippie_ds_main
    from hippie_ds.planner import save_profile

    names = planned_names(a.schedule_list)
    if not names:
        return {}
    d = out / "plans"
    d.mkdir(parents=True, exist_ok=True)
    model = a.model.split(":", 1)[1]
    profile_file = d / f"{model}.profile.yaml"
    save_profile(emulated_profile(model, tensor_scale(a), a.emulate_speedup), profile_file)
    found = {}
    for n in a.node_counts:
        cluster_file = d / f"cluster_{n}_nodes.json"
        cluster_file.write_text(json.dumps(cluster_record(a, n), indent=1))
        for name in names:
            path = plan_path(out, n, name)
            argv = [
                "plan",
                "--profile",
                str(profile_file),
                "--cluster",
                str(cluster_file),
                "--global-batch",
                str(global_batch(a, n)),
                "--objective",
                PLANNED[name],
                "--job",
                job_arg(a),
                "--out",
                str(path),
            ]
            if reuse and path.exists():  # --resume: the plan an earlier run of the command made and ran
                found[(n, name)] = plan_record(path, tensor_scale(a), "hippie-ds " + shlex.join(argv))
                continue
            text = io.StringIO()
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                rc = hippie_ds_main(argv)
            (d / f"{n}_nodes_{name}.txt").write_text(text.getvalue())
            if rc != 0:
                raise RuntimeError(f"hippie-ds {shlex.join(argv)} failed ({rc}):\n{text.getvalue()[-2000:]}")
            found[(n, name)] = plan_record(path, tensor_scale(a), "hippie-ds " + shlex.join(argv))
            r = found[(n, name)]
            log(
                f"planned {name} on {n} node(s): {r['pipeline_depth']} stages x {r['data_parallel']}, {r['schedule']}"
                f", {r['micro_batches']} x {r['micro_batch_size']}, boundaries {r['boundaries']}, re-computed "
                f"{len(r['checkpointed_layers'])} layers; predicted step {r['predicted']['step_s']:.3f} s",
                flush=True,
            )
    return found


def load_plans(a, out: Path) -> dict:
    """The records of plans an earlier run wrote (--analyze-only)."""
    found = {}
    for n in a.node_counts:
        for name in planned_names(a.schedule_list):
            path = plan_path(out, n, name)
            if path.exists():
                found[(n, name)] = plan_record(path, tensor_scale(a), None)
    return found


def plan_record(path: Path, scale: float, command: str | None) -> dict:
    """What the bench keeps of a plan: its choices and its prediction, unscaled to the profile's
    sizes (memory / scale, ME x scale); the planner's DP baseline's ME beside it."""
    from hippie_ds.planner import load_plan

    plan = load_plan(path)
    pred = plan.prediction
    dp = next((b.prediction for b in plan.baselines if b.name == "dp" and b.prediction is not None), None)
    return {
        "file": str(path),
        "command": command,
        "objective": plan.objective,
        "objective_figure": plan.objective_figure,
        "chosen_from": plan.chosen_from,
        "schedule": plan.schedule,
        "pipeline_depth": plan.pipeline_depth,
        "data_parallel": plan.data_parallel,
        "micro_batch_size": plan.micro_batch_size,
        "micro_batches": plan.micro_batches,
        "global_batch": plan.global_batch,
        "boundaries": list(plan.boundaries),
        "checkpointed_layers": list(plan.checkpointed_layers),
        "schedule_params": dict(plan.schedule_params),
        "deferred_layers": {str(st.stage): st.deferred_layers for st in plan.stages if st.deferred_layers is not None},
        "predicted": {
            "step_s": pred.step_time,
            "throughput": pred.throughput,
            "scalability": pred.scalability,
            # the figure the objective ranked, as the plan file records it (ME unscaled as below)
            "objective_value": (pred.objective_value * scale if plan.objective == "me" else pred.objective_value),
            "memory_bytes": pred.memory / scale,
            "counted_memory_bytes": counted_memory(pred, scale),
            "memory_max_bytes": pred.memory_max / scale,
            "me": pred.me * scale,
            "me_vs_dp": pred.me / dp.me if dp and dp.me else None,
            "dp_step_s": dp.step_time if dp else None,
            "predicted_by": pred.predicted_by,
            "single_device_throughput": plan.single_device_throughput,
            "fits": pred.fits,
        },
        "baselines": [baseline_record(b, scale) for b in plan.baselines if b.prediction is not None],
    }


def baseline_record(b, scale: float) -> dict:
    """A baseline the plan printed (DP, GPipe+DP, the job as it is under each schedule, ...), its
    shape and its predicted step and memory per device (memory / scale, as the plan's): what the
    summary holds against the bench's measured row of the same shape. Pure."""
    return {
        "name": b.name,
        "schedule": b.schedule,
        "pipeline_depth": b.pipeline_depth,
        "data_parallel": b.data_parallel,
        "micro_batch_size": b.micro_batch_size,
        "micro_batches": b.micro_batches,
        "boundaries": list(b.boundaries),
        "step_s": b.prediction.step_time,
        "memory_bytes": b.prediction.memory / scale,
        "counted_memory_bytes": counted_memory(b.prediction, scale),
        "fits": b.prediction.fits,
    }


def counted_memory(pred, scale: float) -> float | None:
    """A prediction's mean memory per device on the terms the bench counts (state, deferral buffers,
    weight versions, kept activations: live state and saved tensors; not the working memory, which no
    count of those sees), / scale. None: a plan file without its working memory. Pure."""
    working = pred.memory_working_per_stage
    if working is None:
        return None
    return sum(m - w for m, w in zip(pred.memory_per_stage, working)) / len(working) / scale
