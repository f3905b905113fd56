"""The benchmarks' library: what tools/bench.py, its subcommands (``tools/bench.py NAME``) and the
rank worker tools/workers/bench_worker.py share (imported as ``from benchmarks.analysis import ...``;
tools/ is the import root).

``config`` (command line, results.json's config record), ``runs`` (run plan, rounds, running the
jobs, ``--auto-plan``), ``analysis`` (a run's files -> its record, rounds combined), ``figures``
(ratios, ME, scaling efficiency), ``projection``, ``report`` (report.md), ``plots``; ``model`` (the
GPT-like model and its data), ``engines`` (engines, configs, memory figures) and ``emulated`` (the
emulated accelerator) for the worker; ``commands`` (the subcommands: NAME -> module) and
``studies/`` (one module per subcommand: schedules, link-sweep, allreduce,
gpu-projection, planner, staleness, example-costs); ``convergence_report`` and
``time_to_accuracy`` (tools/convergence.py's tables, pictures and time to accuracy).
"""
