"""The benchmark report: schedules side by side on an emulated two-node cluster, plus a projection.

One command (``make bench``, as root) that

1. sets up the emulated two-node cluster of the brief (section 4): two network namespaces
   (``hdsb-node0``, ``hdsb-node1``) joined by a veth pair (10.78.0.1 <-> 10.78.0.2), both ends
   shaped with ``tc tbf rate 1gbit``; 2 ranks per node, node 0's pinned to core 0 and node 1's to
   core 1 (``taskset``); a 2-stage pipeline inside each node, data parallelism across the link;
2. trains the same GPT-like model (tools/bench/workers/bench_worker.py) with every schedule asked for
   (``--schedules``, default ``dp,gpipe,1f1b,hippie,hippie-1f1b``), each in its own processes
   (so that each rank's peak resident memory is its own):

   * ``dp``: plain DeepSpeed data parallelism (no pipeline) over all 4 ranks, same global batch;
   * ``1f1b``: stock DeepSpeed (``deepspeed.initialize``, its ``TrainSchedule``);
   * ``gpipe``, ``hippie``, ``hippie-1f1b`` and any other schedule name (``2bw``, ``pipedream``,
     ...): ``hippie_ds.initialize`` with ``configs/NAME.json``'s ``pipeline.schedule`` and
     ``hippie`` section; ``deferred_stages: auto`` is resolved from a cost file measured on the
     stock 1F1B run (so ``1f1b`` runs first); ``hds-1f1b`` is hippie-ds's own compiled 1F1B;
   * ``--plan NAME=PLAN`` gives a schedule a planner layout (stage boundaries, re-computed
     layers) through ``hippie_ds.PipelineModule(plan=...)``;

   The two-node runs come in ``--rounds`` rounds (default 3): each round runs every schedule once
   (a fresh job each), the order rotated from round to round (round r starts at the r-th
   schedule, 1F1B being the first of round 0), so drift of the machine lands on every schedule
   alike rather than inside the ratios. Figures are medians over rounds; ratios to stock 1F1B
   and DP are taken per round (runs of the same round) and reported as median (min-max); a
   difference counts as real only when it holds in every round (``summarize``);
3. runs the same schedules on node 0 alone (its 2 ranks, same per-replica batch) for the scaling
   efficiency from one node to two, inside the same rounds (each round: every schedule on two
   nodes, then on one), so the scaling is taken per round and has its spread too; and the whole
   model on one rank (core 0), once, for the single-device throughput;
4. predicts every run's step time with hippie-ds's simulator from the run's own measured
   per-stage forward/backward/optimizer times, parameter bytes and the link bandwidth;
5. projects scaling efficiency to 16, 64 and 1,024 V100s with the planner's cost model and
   simulator on the PipeDream V100 profiles (VGG-16, GNMT-8, GNMT-16).

Outputs (``--out``, default out/bench): ``results.json``, ``report.md``, ``*.png`` plots,
``runs/<config>/<schedule>/`` (per-rank step records, timelines, launcher logs, Gantt charts of
the last two steps in ``traces/``); with ``--rounds`` > 1 each two-node run in its own
``runs/two_nodes/<schedule>/round<R>/`` (``--analyze-only`` reads either layout).
``--publish DIR`` copies report.md, results.json and the
plots to DIR (``make bench`` publishes to docs/bench/, the committed copy).

Figures (definitions, also in the report):

* step time: wall time of one ``train_batch`` per rank; per step the slowest rank's; the median
  over the timed steps (after ``--warmup`` untimed ones); with rounds, the median over rounds of
  each round's median. Throughput = samples a step / median.
* memory per rank: peak bytes saved for backward (``saved_tensors_hooks``, storages counted
  once from first pack until autograd releases them, parameters excluded) and peak resident
  memory (VmHWM); "training RSS" = VmHWM minus the process's VmRSS after imports and
  ``init_distributed``, before the model is built (the interpreter, torch and DeepSpeed's own
  ~0.3 GB are the same for every schedule and are not what the schedules differ in).
* a device is an emulated node's core: scalability = throughput / (cores x single-device
  throughput); ME = scalability x throughput / memory, memory = mean over ranks of the peak
  training RSS; reported as a ratio to DP (the ratio does not depend on what a device is).
* scaling efficiency one node -> two = throughput on 2 nodes / (2 x throughput on 1 node).

Usage::

    sudo .venv/bin/python -m tools.bench                     # everything, defaults (3 rounds, ~20 min)
    sudo .venv/bin/python -m tools.bench --rounds 1          # one run per schedule, as before rounds
    sudo .venv/bin/python -m tools.bench --schedules 1f1b,hippie --steps 4 --no-scaling
    .venv/bin/python -m tools.bench --projection-only        # no root needed
    .venv/bin/python -m tools.bench --analyze-only           # re-analyse OUT/runs of an earlier run

Needs root and ``ip netns`` for the measured part (refuses with exit code 2 otherwise). The
namespaces are always removed: at exit, on SIGINT/SIGTERM/SIGHUP, and leftovers at start.

This module is the entry point (``main``); the parts live in the package tools/bench/:
config.py (command line, results.json's config record), runs.py (run plan, rounds, running the
jobs, ``--auto-plan``), analysis.py (a run's files -> its record, rounds combined), figures.py
(ratios, ME, scaling efficiency), projection.py, report.py (report.md) and plots.py; the rank
worker is workers/bench_worker.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# The pure parts, importable from here as they always were (tests/bench/test_bench.py uses them so).
from tools.bench.analysis import analyse_all, analyse_job, combine_rounds, measured_costs, predict
from tools.bench.cluster import Refuse, fix_owner
from tools.bench.commands import COMMANDS, run_command
from tools.bench.config import config_record, parse_args, round_orders
from tools.bench.figures import ranges_overlap, round_ratios, spread_excludes, summarize
from tools.bench.plots import plots
from tools.bench.projection import projection
from tools.bench.publish import publish as publish_files
from tools.bench.report import projection_pivot, report_markdown, spread_cell
from tools.bench.runs import auto_plan, measure, preflight, run_plan

__all__ = [
    "main",
    "parse_args",
    "config_record",
    "run_plan",
    "round_orders",
    "analyse_all",
    "analyse_job",
    "combine_rounds",
    "measured_costs",
    "predict",
    "summarize",
    "round_ratios",
    "spread_excludes",
    "ranges_overlap",
    "projection",
    "projection_pivot",
    "report_markdown",
    "spread_cell",
    "write_outputs",
]


def write_outputs(out: Path, results: dict, publish: str | None):
    """results.json, report.md and the plots in ``out`` (and copies in ``publish``); returns the report."""
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = report_markdown(results)
    (out / "report.md").write_text(md)
    publish_files(publish, ["report.md", "results.json"] + results["plots"], base=out)
    return md


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # a study: python -m tools.bench NAME ...
        return run_command(argv[0], argv[1:])
    a = parse_args(argv)
    out = Path(a.out).resolve()
    if a.auto_plan and not (a.analyze_only or a.projection_only):
        out.mkdir(parents=True, exist_ok=True)
        a.plans.update(auto_plan(a, out))
    results: dict = {"config": config_record(a), "runs": {}}
    if a.analyze_only:
        old = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
        results["config"] = {**old.get("config", results["config"]), "reanalysed_by": results["config"]["command"]}
        results["runs"] = analyse_all(out, a, run_plan(a))
        results["wall_s"], results["noise"] = old.get("wall_s"), old.get("noise", {})
        results["projection"] = old.get("projection")
    elif not a.projection_only:
        try:
            preflight(a)
        except Refuse as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        rc = 0
        try:
            results["runs"], results["wall_s"], results["noise"] = measure(a, out)
        except RuntimeError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            rc = 1
        if rc:
            fix_owner(out)
            return rc
    out.mkdir(parents=True, exist_ok=True)
    if results["runs"]:
        results["summary"] = summarize(results["runs"])
    if not a.no_projection and (not a.analyze_only or results.get("projection") is None):
        t = time.monotonic()
        results["projection"] = projection(
            sizes=a.sizes,
            depth=a.projection_depth,
            objective=a.projection_objective,
            batch_per_device=a.projection_batch,
            progress=lambda m: print(m, flush=True),
        )
        print(f"projection: {time.monotonic() - t:.1f} s", flush=True)
    md = write_outputs(out, results, a.publish)
    print("\n" + md)
    print(
        f"results: {out}/results.json, {out}/report.md, plots {', '.join(results['plots']) or 'none'}"
        + (f"; published to {a.publish}" if a.publish else "")
    )
    fix_owner(out)
    if a.publish:
        fix_owner(Path(a.publish))
    return 0
