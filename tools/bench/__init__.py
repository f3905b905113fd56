"""The bench: measurements of hippie-ds on emulated clusters, its rank workers, studies and
reports. One entry point, ``python -m tools.bench [NAME] ...`` (:mod:`tools.bench.cli`; NAME a
subcommand of :mod:`tools.bench.commands`), run from the repository root.

* ``cluster/``: the one place that runs jobs (emulated nodes, local ranks, the fork launcher);
  the tests' launches use it too.
* ``workers/``: the rank scripts the jobs start (``REPO`` is on their PYTHONPATH, so they import
  ``tools.bench...`` like everything else).
* ``studies/``: one module per subcommand, each with ``main(argv)`` and its own ``--help``.
* the cluster bench itself: ``config`` (command line, results.json's config record), ``runs`` (run
  plan, rounds, ``--auto-plan``), ``analysis`` (a run's files -> its record), ``figures`` (ratios,
  ME, scaling efficiency), ``projection``, ``report``, ``plots``; ``model``, ``engines`` and
  ``emulated`` (the emulated accelerator) for the rank worker;
* ``convergence`` (with ``convergence_report``, ``time_to_accuracy``), ``multinode`` and ``soak``:
  the convergence runs, the launcher on emulated nodes, the long-run memory check;
* ``labels`` (the one run-label grammar) and ``publish`` (the one copy to a committed folder).

Nothing here imports from ``tests/``; the tests import from here.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"  # the rank scripts (run by path, never imported by name)
