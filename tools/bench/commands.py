"""The bench's subcommands: ``python -m tools.bench NAME ...`` runs NAME (its own ``--help``).

Each entry maps a subcommand to the module whose ``main(argv)`` runs it, and a line for
``python -m tools.bench --help``. With no subcommand (or with options only) the command is the
cluster bench itself (:mod:`tools.bench.cli`). Studies that answered one question and are done
are archived (docs/archive.md: their published results and the commit that holds their code).
"""

from __future__ import annotations

import importlib
import sys

# name: (module, what it runs)
COMMANDS: dict[str, tuple[str, str]] = {
    "scaling": (
        "tools.bench.studies.scaling",
        "the paper's scaling table: 1, 2, 4 emulated nodes, emulated "
        "accelerator models, beside the paper's figures (needs root)",
    ),
    "dilation": (
        "tools.bench.studies.dilation",
        "does the time dilation hold: one node count of the scaling study "
        "at several D, T(D) = T_inf + h / D fitted (needs root)",
    ),
    "headline": (
        "tools.bench.studies.headline",
        "README's headline table and picture from the scaling study's published results (no run)",
    ),
    "schedules": (
        "tools.bench.studies.schedules",
        "flush schedules side by side on one node (step, bubble, memory; measured and simulated)",
    ),
    "allreduce": (
        "tools.bench.studies.allreduce",
        "all-reduce bandwidth and CPU cost on the emulated link (needs root)",
    ),
    "host-cost": (
        "tools.bench.studies.host_cost",
        "hippie-ds's engine against stock PipelineEngine: host time per instruction, 1F1B, interleaved rounds",
    ),
    "planner": ("tools.bench.studies.planner_time", "wall time of the planner on a synthetic 1,000-layer profile"),
    "cuda-plan": (
        "tools.bench.studies.cuda_plan",
        "one GPU: the job profiles itself, the planner plans one stage, "
        "the plan runs: the plan's memory against max_memory_allocated",
    ),
    "cut-sweep": (
        "tools.bench.studies.cut_sweep",
        "a plan's top candidates (cuts, configurations) trained on the GPT "
        "example in rotated rounds: measured against predicted ranking",
    ),
    "split-backward": (
        "tools.bench.studies.split_backward",
        "zb-h1's I and W from the engine's timelines beside 1f1b's whole backward and a profile's charges (no run)",
    ),
    "example-costs": (
        "tools.bench.studies.example_costs",
        "a training example's cost file (hippie.costs) for `python -m tools.bench convergence --costs`",
    ),
    "staleness": (
        "tools.bench.studies.staleness",
        "one process: which correction lets a one-step-late stage reach "
        "data parallelism's loss (rules per stage, seeds)",
    ),
    "convergence": (
        "tools.bench.convergence",
        "time to a target loss: the examples trained per schedule, seeds, step times and costs",
    ),
    "multinode": (
        "tools.bench.multinode",
        "DeepSpeed's launcher across emulated nodes (one launcher per node, needs root)",
    ),
    "soak": ("tools.bench.soak", "a long run's memory stays flat"),
}


def usage() -> str:
    """The subcommands, one line each (for ``--help``)."""
    width = max(map(len, COMMANDS))
    return "subcommands (python -m tools.bench NAME --help):\n" + "\n".join(
        f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()
    )


def run_command(name: str, argv: list[str]) -> int:
    """Run subcommand ``name`` with ``argv``; its exit code (None -> 0)."""
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"python -m tools.bench {name}", *argv]  # a study's report records sys.argv as its command
    return int(module.main(argv) or 0)
