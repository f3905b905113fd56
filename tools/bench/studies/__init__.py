"""The bench's studies: one module per ``python -m tools.bench NAME`` subcommand (tools/bench/commands.py
maps NAME to its module), each with ``main(argv) -> int`` and its own ``--help``.

``schedules`` (flush schedules side by side on one node), ``link_sweep`` (the cluster bench per
link rate), ``allreduce`` (the emulated link's all-reduce; rank worker tools/bench/workers/allreduce_worker.py),
``gpu_projection`` (simulated scaling on V100 profiles), ``planner_time`` (the planner's speed),
``staleness`` with ``staleness_stage`` (delayed updates and their corrections, one process),
``example_costs`` (a training example's cost file for python -m tools.bench convergence).
"""
