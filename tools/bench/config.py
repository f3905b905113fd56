"""The command line of python -m tools.bench and the record of it in results.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.bench import REPO
from tools.bench.commands import usage


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the epilog's lines (the subcommands) kept as written."""


DEFAULT_SCHEDULES = "dp,gpipe,1f1b,hippie,hippie-1f1b"
ALLREDUCE_MEASURED = REPO / "docs" / "bench" / "allreduce" / "results.json"  # python -m tools.bench allreduce's


def parse_args(argv=None):
    """The command line of python -m tools.bench (``--help``), checked; adds ``schedule_list``, ``plans``, ``sizes``."""
    p = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description="hippie-ds benchmark report: DP, GPipe+DP, stock 1F1B, hippie, hippie-1f1b (and any schedule by "
        "name) on an emulated two-node cluster (network namespaces, shaped link; needs root), plus a "
        "simulator projection to 16/64/1,024 V100s. Writes results.json, report.md and PNG plots.",
        epilog="example: sudo .venv/bin/python -m tools.bench --out out/bench --publish docs/bench\n\n" + usage(),
        formatter_class=_Formatter,
    )
    _add_run_arguments(p)
    _add_model_arguments(p)
    _add_cluster_arguments(p)
    _add_projection_arguments(p)
    a = p.parse_args(argv)
    _check(p, a)
    return a


def _add_run_arguments(p: argparse.ArgumentParser):
    """What runs and where its results go: output, schedules and their plans, steps, rounds."""
    p.add_argument("--out", default="out/bench", help="output directory")
    p.add_argument(
        "--publish",
        default=None,
        metavar="DIR",
        help="also copy report.md, results.json and the plots to DIR (e.g. docs/bench)",
    )
    p.add_argument(
        "--schedules",
        default=DEFAULT_SCHEDULES,
        help="comma list: dp, 1f1b (stock DeepSpeed), hds-1f1b (hippie-ds's 1F1B), gpipe, hippie, "
        "hippie-1f1b, or any schedule name hippie-ds knows (configs/NAME.json is used if present)",
    )
    p.add_argument(
        "--plan",
        action="append",
        default=[],
        metavar="SCHEDULE=PLAN_FILE",
        help="planner layout for a schedule's two-node run (stage boundaries and re-computed layers via "
        "hippie_ds.PipelineModule(plan=...); the plan's batch settings are not applied; the one-node "
        "run keeps --partition-method, a plan being made for one world size); repeatable",
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps per schedule and run (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule (per run)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds: each round runs every schedule once on two nodes, then once on one node (its "
        "own job each: warm-up + --steps), the order rotated each round; figures are medians over "
        "rounds, ratios to 1F1B/DP and the scaling 1->2 nodes taken per round with their min-max "
        "spread (1: one run per schedule); the one-device run runs once",
    )


def add_model_choice(p: argparse.ArgumentParser) -> None:
    """--model and the emulated models' --emulate-* options (the bench, its worker, python -m tools.bench schedules)."""
    p.add_argument(
        "--model",
        default="gpt",
        help="gpt (the GPT-like bench model; --d-model, --layers, ... set its "
        "shape), vgg-example (the VGG convergence example's network, loss and digits, "
        "tools/examples/vgg.py at train_vgg.py's default width; the GPT shape options are ignored) or "
        "emulated:NAME, a profiled model whose compute is a CPU-free wait (tools/bench/emulated.py; "
        "NAME: vgg16, gnmt8, gnmt16)",
    )
    p.add_argument(
        "--emulate-scale",
        type=float,
        default=1e-3,
        help="emulated models: parameters and activations "
        "x this (scale the link by it too: every transfer then takes its profiled time)",
    )
    p.add_argument("--emulate-speedup", type=float, default=1.0, help="emulated models: the profiled times / this")


def model_choice_args(a) -> list[str]:
    """The options of :func:`add_model_choice` as a worker's command line takes them."""
    return ["--model", a.model, "--emulate-scale", str(a.emulate_scale), "--emulate-speedup", str(a.emulate_speedup)]


def _add_model_arguments(p: argparse.ArgumentParser):
    """The model and the pipeline (the same for every schedule)."""
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks per node")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per replica and step")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--vocab", type=int, default=4096)
    add_model_choice(p)
    p.add_argument("--partition-method", default="uniform", help="PipelineModule partition_method without a plan")
    p.add_argument(
        "--auto-plan",
        action="store_true",
        help="profile the model here (hippie-ds profile) and give hippie, hippie-1f1b, 2bw and pipedream "
        "their planner-chosen layout (boundaries and re-computation for ME) in the two-node run",
    )


def _add_cluster_arguments(p: argparse.ArgumentParser):
    """The emulated cluster, the reference runs and the prediction's link figures."""
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    p.add_argument(
        "--burst",
        choices=["default", "min"],
        default="default",
        help="tbf's token bucket: default 1mb (passes 1 MB at veth speed after the link idles), min the "
        "least the kernel takes (rate/250 x 1.1; the more faithful to a real link)",
    )
    p.add_argument("--no-shape", action="store_true", help="do not shape the link")
    p.add_argument("--cores", default="0,1", help="core of node 0, core of node 1 (taskset)")
    p.add_argument("--port", type=int, default=29610, help="first master port (one per job)")
    p.add_argument("--timeout", type=int, default=600, help="seconds before one job is killed")
    p.add_argument("--no-scaling", action="store_true", help="skip the one-node runs (no scaling efficiency)")
    p.add_argument("--no-single", action="store_true", help="skip the one-device run (no scalability / ME)")
    p.add_argument(
        "--comm-dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="DeepSpeed's communication_data_type for every schedule (the all-reduce's wire; "
        "default: the model's fp32); the cost files' gradient bytes follow it",
    )
    p.add_argument(
        "--accelerator",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the ranks compute: cuda (one GPU per rank, NCCL across the shaped links: "
        "cluster.node_env), cpu (gloo), auto: cuda when this machine has a GPU and the model "
        "is not emulated (an emulated device only waits)",
    )
    p.add_argument(
        "--link-efficiency",
        type=float,
        default=0.97,
        help="all-reduce bandwidth / shaped rate for the prediction (measured here by "
        "python -m tools.bench allreduce: 0.96-0.97 for one pair and for two at once, 250 Mbit/s to "
        "10 Gbit/s; the brief's 64 MB in 561 ms at 1 Gbit/s is 0.91)",
    )
    p.add_argument(
        "--allreduce-cpu-per-mb",
        default="auto",
        help="seconds of compute an all-reduce in flight takes from its stage per MB of gradient, for "
        "the prediction; 'auto': python -m tools.bench allreduce's measurement at --rate "
        f"({ALLREDUCE_MEASURED.relative_to(REPO)}), 0 where it has none",
    )
    p.add_argument(
        "--intra-allreduce-bandwidth",
        type=float,
        default=1.1e9,
        help="bytes/s of an all-reduce inside a node (prediction of one-node DP; the brief: 64 MB in ~60 ms)",
    )
    p.add_argument(
        "--p2p-bandwidth",
        type=float,
        default=4e9,
        help="bytes/s of a pipeline send inside a node (the brief: 4 MB in ~1 ms)",
    )
    p.add_argument("--p2p-latency", type=float, default=2e-4, help="seconds per pipeline send inside a node")


def _add_projection_arguments(p: argparse.ArgumentParser):
    """The projection, and re-analysing an earlier run."""
    p.add_argument("--no-projection", action="store_true", help="skip the projection")
    p.add_argument("--projection-only", action="store_true", help="only the projection (no root, no namespaces)")
    p.add_argument("--projection-sizes", default="16,64,1024", help="cluster sizes (GPUs)")
    p.add_argument(
        "--projection-depth",
        type=int,
        default=None,
        help="pipeline stages for the pipeline schedules (default: GPUs per node; 0: planner's choice)",
    )
    p.add_argument(
        "--projection-objective",
        choices=("throughput", "me"),
        default="throughput",
        help="what the planner maximizes for each pipeline schedule",
    )
    p.add_argument(
        "--projection-batch",
        type=int,
        default=0,
        help="samples per GPU (global batch = this x GPUs); 0: the profile's batch",
    )
    p.add_argument("--analyze-only", action="store_true", help="only re-analyse OUT/runs of an earlier run (no root)")


def _check(p: argparse.ArgumentParser, a):
    """Derived settings (schedule list, plans, projection sizes) and the errors argparse cannot see."""
    a.schedule_list = [s.strip() for s in a.schedules.split(",") if s.strip()]
    if not a.schedule_list:
        p.error("--schedules: empty")
    if len(set(a.schedule_list)) != len(a.schedule_list):
        p.error("--schedules: a schedule is named twice")
    a.plans = {}
    for item in a.plan:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--plan {item!r}: expected SCHEDULE=PLAN_FILE")
        if name == "dp":
            p.error("--plan: dp has no pipeline layout")
        a.plans[name] = str(Path(path).resolve())
    if a.d_model % a.heads:
        p.error("--d-model must be a multiple of --heads")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        a.sizes = [int(x) for x in a.projection_sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--projection-sizes {a.projection_sizes!r}: expected integers, e.g. 16,64,1024")
    a.allreduce_cpu_per_mb = _allreduce_cpu_per_mb(p, a.allreduce_cpu_per_mb, None if a.no_shape else a.rate)
    a.accelerator, a.device_count = resolve_accelerator(p, a.accelerator, str(a.model).startswith("emulated:"))


def resolve_accelerator(
    p: argparse.ArgumentParser, choice: str, emulated: bool, device_count: int | None = None
) -> tuple[str, int]:
    """(cpu or cuda, GPUs on this machine) for ``--accelerator``: ``auto`` takes CUDA when a GPU is
    here and the model computes for real; ``cuda`` with an emulated model or without a GPU is an
    error. ``device_count``: the GPUs (default: torch's count)."""
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and emulated:
        p.error(
            "--accelerator cuda: an emulated model only waits for its profiled time; use the GPT bench model "
            "(--model gpt) on GPUs"
        )
    if choice == "cuda" and device_count == 0:
        p.error("--accelerator cuda: no CUDA device on this machine (torch.cuda.is_available() is False)")
    if choice == "auto":
        choice = "cuda" if device_count and not emulated else "cpu"
    return choice, device_count


def _allreduce_cpu_per_mb(p: argparse.ArgumentParser, value: str, rate: str | None) -> float:
    """--allreduce-cpu-per-mb as seconds per MB: a number, or 'auto' (the measurement at ``rate``)."""
    if value != "auto":
        try:
            return float(value)
        except ValueError:
            p.error(f"--allreduce-cpu-per-mb {value!r}: expected seconds per MB or 'auto'")
    rows = json.loads(ALLREDUCE_MEASURED.read_text()) if ALLREDUCE_MEASURED.exists() else []
    return next((r.get("cpu_per_mb", 0.0) for r in rows if r["rate"] == rate), 0.0)


def parameter_count(a) -> int:
    """Parameters of the worker's GPT-like model (tools/bench/model.py) at the shape of ``a``:
    embeddings, ``layers`` pre-LN blocks (attention + 4x MLP, 12 d^2 + 13 d each), the final
    LayerNorm and the untied head; an emulated model's: its profile's, scaled; the VGG example's:
    its layers', built (they are small)."""
    from tools.bench.model import VGG_EXAMPLE, vgg_example_specs

    model = getattr(a, "model", "gpt") or "gpt"
    if model == VGG_EXAMPLE:
        return sum(q.numel() for spec in vgg_example_specs() for q in spec.build().parameters())
    if model.startswith("emulated:"):
        from tools.bench.emulated import read_profile

        return sum(int(round(layer.param_bytes / 4 * a.emulate_scale)) for layer in read_profile(model[9:]).layers)
    block = 12 * a.d_model**2 + 13 * a.d_model
    return (a.vocab + a.seq) * a.d_model + a.layers * block + 2 * a.d_model + a.d_model * a.vocab


def schedule_order(schedules: list[str]) -> list[str]:
    """The schedules in run order: stock 1F1B first (it measures the cost file for 'auto')."""
    return [s for s in schedules if s == "1f1b"] + [s for s in schedules if s != "1f1b"]


def round_orders(schedules: list[str], rounds: int) -> list[list[str]]:
    """The order of the two-node runs in each round: every schedule once per round, the order
    rotated each round (round r starts at schedule r mod S of ``schedule_order``), so a drift
    of the machine lands on every schedule alike instead of on whichever runs last. Pure."""
    ordered = schedule_order(schedules)
    n = len(ordered)
    return [ordered[r % n :] + ordered[: r % n] for r in range(rounds)] if n else []


def config_record(a) -> dict:
    """What results.json records of the command line."""
    total = parameter_count(a)
    return {
        "stages": a.stages,
        "micro_batches": a.micro_batches,
        "micro_batch_size": a.micro_batch_size,
        "global_batch": a.micro_batch_size * a.micro_batches * 2,
        "seq": a.seq,
        "d_model": a.d_model,
        "layers": a.layers,
        "vocab": a.vocab,
        "heads": a.heads,
        "warmup": a.warmup,
        "steps": a.steps,
        "params_total": f"{total / 1e6:.1f}M" if total >= 1e6 else f"{total / 1e3:.0f}K",
        "model": getattr(a, "model", "gpt"),
        "emulate_scale": getattr(a, "emulate_scale", None),
        "emulate_speedup": getattr(a, "emulate_speedup", None),
        "link": "unshaped veth"
        if a.no_shape
        else f"tbf {a.rate}" + ("" if a.burst == "default" else f" burst {a.burst}"),
        "link_efficiency": a.link_efficiency,
        "comm_dtype": a.comm_dtype or "fp32",
        "allreduce_cpu_per_mb": a.allreduce_cpu_per_mb,
        "cores": a.cores,
        "schedules": a.schedule_list,
        "accelerator": getattr(a, "accelerator", "cpu"),
        "plans": a.plans,
        "rounds": a.rounds,
        "round_orders": round_orders(a.schedule_list, a.rounds),
        "command": " ".join(["python -m tools.bench"] + sys.argv[1:]),
    }
