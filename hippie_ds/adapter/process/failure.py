"""A rank whose instruction handler raises mid-schedule ends the job now, not at the timeout.

A pipeline step is a chain of messages and collectives: once one rank stops in the middle, its
neighbours wait for a message that will not come, its data-parallel peers for a collective it will
not join, each until the process group's timeout (DeepSpeed's default: 10 minutes). DeepSpeed's
launcher ends the job as soon as one rank exits, and gloo peers of an exited rank see its closed
connections; but the failing rank may not exit:

* its script catches the exception and calls a collective (a barrier, a checkpoint) that the
  others, stuck in the pipeline, never join;
* a collective of its own is still in flight (an asynchronous all-reduce its peers have not
  joined): the interpreter's teardown waits for it in the process group's destructor;

and with one launcher per node, or a backend whose peers do not see a closed connection (NCCL),
the others wait for the timeout even when it does.

So the first exception out of a handler (:func:`end_job_on_failure`, called by the engine's
instruction loop) is logged with the rank, the stage and the instruction, and propagates as
usual; meanwhile the rank's process groups are aborted (best effort, from a daemon thread: an
abort can itself wait for work in flight), so that peers blocked on it fail at once and, in their
own handlers, do the same for theirs; and the process exits with status 1 without the
interpreter's teardown: from ``sys.excepthook`` when the exception is not caught (after the
``atexit`` callbacks), at exit when it is, and in any case :data:`EXIT_GRACE_S` seconds after the
failure. Not for ``StopIteration`` (a data iterator running out, which a script may catch) nor
single-rank jobs (no peers to wait).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

EXIT_GRACE_S = 10.0  # a failed rank's script may clean up (not communicate) this long, then it exits

_failed = False


def end_job_on_failure(exc: BaseException, rank: int, where: str) -> None:
    """Called with the exception a schedule handler raised, before it propagates (see the module
    docstring). ``where``: the stage and instruction, for the log line."""
    global _failed
    import torch.distributed as dist

    if (
        _failed
        or isinstance(exc, StopIteration)
        or not dist.is_available()
        or not dist.is_initialized()
        or dist.get_world_size() < 2
    ):
        return
    _failed = True
    print(
        f"hippie-ds: rank {rank} failed in {where}: {type(exc).__name__}: {exc}; its pipeline peers cannot go on: "
        f"aborting its process groups so that they fail now instead of at the process group's timeout; this "
        f"process exits (status 1) when the exception leaves the script, at exit, or in {EXIT_GRACE_S:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    timer = threading.Timer(EXIT_GRACE_S, _grace_exit)  # apart from the abort, which may block
    timer.daemon = True
    timer.start()
    threading.Thread(target=_abort, name="hippie-ds-abort", daemon=True).start()
    atexit.register(_exit_now)
    previous = sys.excepthook

    def excepthook(*info):
        previous(*info)
        _exit_now()

    sys.excepthook = excepthook


def _abort() -> None:
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # noqa: BLE001 (best effort: the exit closes the connections anyway)
        pass


def _grace_exit() -> None:
    print(
        f"hippie-ds: still running {EXIT_GRACE_S:.0f} s after a failed instruction; exiting",
        file=sys.stderr,
        flush=True,
    )
    _hard_exit()


def _exit_now() -> None:
    """The ``atexit`` callbacks not yet run (ours excepted), then exit(1) without the interpreter's
    teardown, which would wait for collectives in flight."""
    atexit.unregister(_exit_now)
    try:
        atexit._run_exitfuncs()
    finally:
        _hard_exit()


def _hard_exit() -> None:
    try:
        logging.shutdown()
    except Exception:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(1)
