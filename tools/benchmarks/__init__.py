"""The benchmarks' library: what tools/bench.py, tools/bench_hidden_comm.py, tools/bench_schedules.py
and their rank worker tools/bench_worker.py share (imported as ``from benchmarks.analysis import ...``;
tools/ is the import root).

``config`` (command line, results.json's config record), ``runs`` (run plan, rounds, running the
jobs, ``--auto-plan``), ``analysis`` (a run's files -> its record, rounds combined), ``figures``
(ratios, ME, scaling efficiency), ``projection``, ``report`` (report.md), ``plots``;
``hidden_comm_analysis`` (tools/bench_hidden_comm.py's analysis); ``model`` (the GPT-like model and
its data) and ``engines`` (engines, configs, memory figures) for the worker.
"""
