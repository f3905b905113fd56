"""The bench's subcommands: ``tools/bench.py NAME ...`` runs study NAME (its own ``--help``).

Each entry maps a subcommand to the module (importable with tools/ as the import root) whose
``main(argv)`` runs it, and a line for ``tools/bench.py --help``. ``tools/bench.py`` with no
subcommand (or with options only) is the cluster bench itself (benchmarks/config.py).
"""
from __future__ import annotations

import importlib
import sys

# name: (module, what it measures)
COMMANDS: dict[str, tuple[str, str]] = {
    "scaling": ("benchmarks.studies.scaling", "the paper's scaling table: 1, 2, 4 emulated nodes, emulated "
                                              "accelerator models, beside the paper's figures (needs root)"),
    "schedules": ("benchmarks.studies.schedules", "flush schedules side by side on one node (step, bubble, memory; "
                                                  "measured and simulated)"),
    "link-sweep": ("benchmarks.studies.link_sweep", "the cluster bench once per inter-node link rate, collated "
                                                    "(needs root)"),
    "allreduce": ("benchmarks.studies.allreduce", "all-reduce bandwidth and CPU cost on the emulated link "
                                                  "(needs root)"),
    "gpu-projection": ("benchmarks.studies.gpu_projection", "simulated scaling one node -> two on V100 profiles "
                                                            "against link speed"),
    "planner": ("benchmarks.studies.planner_time", "wall time of the planner on a synthetic 1,000-layer profile"),
    "staleness": ("benchmarks.studies.staleness", "which correction lets a one-step-late stage reach DP's loss"),
    "tied-deferral": ("benchmarks.studies.tied_deferral", "hippie.deferred_layers on a Megatron-shaped GPT with a "
                                                          "tied embedding: 1 vs untied vs all against stock"),
    "cuda-plan": ("benchmarks.studies.cuda_plan", "one GPU: the job profiles itself, the planner plans one stage, "
                                                  "the plan runs: the plan's memory against max_memory_allocated"),
    "zero-memory": ("benchmarks.studies.zero_memory", "training state per rank on each optimizer path: fp32, ZeRO-1 "
                                                      "(fp32, bf16, BF16_Optimizer) under stock, 1f1b, hippie"),
    "example-costs": ("benchmarks.studies.example_costs", "a training example's cost file (hippie.costs) for "
                                                          "tools/convergence.py --costs"),
}


def usage() -> str:
    """The subcommands, one line each (for ``--help``)."""
    width = max(map(len, COMMANDS))
    return "subcommands (tools/bench.py NAME --help):\n" + "\n".join(
        f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items())


def run_command(name: str, argv: list[str]) -> int:
    """Run subcommand ``name`` with ``argv``; its exit code (None -> 0)."""
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"tools/bench.py {name}", *argv]  # a study's report records sys.argv as its command
    return int(module.main(argv) or 0)
