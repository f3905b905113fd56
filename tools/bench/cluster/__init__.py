"""The one place that runs jobs for the tools and the tests: an emulated cluster on one machine
(the brief, section 4) and local multi-rank jobs. Used by python -m tools.bench,
python -m tools.bench multinode (emulated nodes), python -m tools.bench convergence,
python -m tools.bench soak and tests/distributed/launch.py (local jobs).

* :mod:`tools.bench.cluster.network`: :class:`Network`, two network namespaces joined by a veth pair (one end
  in each, an address on each, ``lo`` up), both ends optionally shaped with ``tc qdisc ... tbf``;
  ``setup`` removes leftovers of a crashed run first, ``teardown`` removes the namespaces (their
  veth ends go with them). Each tool uses its own names and subnet, so they can be set up side by
  side. :func:`preflight` refuses (:class:`Refuse`, exit code 2 in the tools) unless the tools are
  on PATH, we are root and ``ip netns`` works; :func:`check_cores` the two cores to pin nodes to.
* :mod:`tools.bench.cluster.star`: :class:`StarNetwork`, N namespaces behind a bridge (a switch namespace), one
  shaped link per node (both directions), the same interface as :class:`Network`.
* :mod:`tools.bench.cluster.processes`: :class:`NodeProcesses`, one launcher per emulated node (``ip netns
  exec NODE ...``), each in its own session so that :meth:`NodeProcesses.stop` ends the launcher
  with its ranks; logs in ``LOGS/node{n}.log``, lines carrying a marker echoed with the elapsed
  time. :class:`WorkerJob`, a rank worker started by DeepSpeed's per-node launcher on every node
  in use. :class:`LocalJob`, a worker on N local ranks (``deepspeed.launcher.runner``, or
  :mod:`tools.bench.cluster.fork_ranks`: the ranks forked after one import of torch and DeepSpeed), ended with
  its ranks and its /dev/shm segments removed. :func:`cleanup_on_signals`:
  SIGINT/SIGTERM/SIGHUP end the body with ``SystemExit(128 + n)``; the clean-up runs with those
  signals ignored, then the previous handlers come back.
* :mod:`tools.bench.cluster.noise`: :class:`ForeignCpu`, CPU used by processes outside the job, sampled while
  it runs; :func:`core_ticks`, the busy and total clock ticks of some cores or the machine.
"""

from tools.bench.cluster.network import (
    QUEUE_S,
    Network,
    Refuse,
    burst_for,
    check_cores,
    parse_rate,
    preflight,
    rate_arg,
    sh,
)
from tools.bench.cluster.noise import ForeignCpu, core_ticks, foreign_cpu_between
from tools.bench.cluster.processes import (
    REPO,
    LocalJob,
    LocalRun,
    NodeProcesses,
    WorkerJob,
    cleanup_on_signals,
    fix_owner,
    free_port,
    gpu_slices,
    local_env,
    node_env,
    remove_shm_segments,
)
from tools.bench.cluster.star import StarNetwork

__all__ = [
    "QUEUE_S",
    "REPO",
    "ForeignCpu",
    "LocalJob",
    "LocalRun",
    "Network",
    "NodeProcesses",
    "Refuse",
    "StarNetwork",
    "WorkerJob",
    "burst_for",
    "check_cores",
    "cleanup_on_signals",
    "core_ticks",
    "fix_owner",
    "foreign_cpu_between",
    "free_port",
    "gpu_slices",
    "local_env",
    "node_env",
    "parse_rate",
    "preflight",
    "rate_arg",
    "remove_shm_segments",
    "sh",
]
