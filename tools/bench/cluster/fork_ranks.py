"""A local job's ranks forked from one process that imported torch, DeepSpeed and hippie_ds once:
the ``fork`` launcher of :class:`cluster.LocalJob`, what the tests run their rank workers with.

    python -u -m cluster.fork_ranks NUM_RANKS MASTER_PORT WORKER [ARGS...]

Each rank gets what DeepSpeed's launcher gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
CROSS_RANK/SIZE, MASTER_ADDR/PORT in the environment; ``WORKER --local_rank=R ARGS`` as its
argv, the worker's folder first on sys.path) and runs the worker as ``__main__``; as under that
launcher, the first rank to fail ends the others (SIGTERM, SIGKILL 10 s later) and its exit code
is the job's (a signal's -n as 256 - n). What it saves: a rank's imports cost about 2.5 s of CPU
and DeepSpeed's runner imports DeepSpeed twice more, per launch, on CI's 2 cores.

The imports start no thread (checked: a fork with threads running would copy their locks held);
each rank draws fresh seeds for Python's and NumPy's global generators, as a new process does, and
exits as a process does (atexit handlers, then the interpreter's finalization, where gloo's teardown
abort would show: tests/adapter/process/test_clean_exit.py). This process itself leaves with ``os._exit``."""

import os
import random
import runpy
import signal
import sys
import time


def _run_rank(rank: int, num_ranks: int, port: str, worker: str, args: list[str]):
    """In the forked child: become rank ``rank`` and run the worker; never returns (SystemExit,
    or the worker's exception propagates and the interpreter exits 1 with its traceback)."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(num_ranks),
            "LOCAL_SIZE": str(num_ranks),
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
    )
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [worker, f"--local_rank={rank}", *args]
    sys.path[0] = os.path.dirname(os.path.abspath(worker))
    runpy.run_path(worker, run_name="__main__")
    sys.exit(0)


def _wait(pids: list[int]) -> int:
    """0 when every rank exits 0; else the first failed rank's exit code, the others ended."""
    running = set(pids)
    while running:
        pid, status = os.wait()
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            _end(running)
            return code % 256
    return 0


def _end(pids: set[int]):
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            for pid in list(pids):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    pids.discard(pid)
            time.sleep(0.05)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    num_ranks, port, worker, args = int(argv[0]), argv[1], argv[2], argv[3:]
    import torch  # noqa: F401  (the imports every rank shares)
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer or manual_seed: ~1.3 s)
    import deepspeed  # noqa: F401
    import hippie_ds.adapter.integration  # noqa: F401

    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        print(
            f"cluster.fork_ranks: the imports started {len(threads) - 1} thread(s); forking now is unsafe",
            file=sys.stderr,
        )
        return 2
    import gc

    gc.freeze()  # the imports' objects outlive every rank: no collection walks them (0.7 s less at each rank's exit)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(num_ranks):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, num_ranks, port, worker, args)
        pids.append(pid)
    return _wait(pids)


if __name__ == "__main__":
    code = main(sys.argv[1:])  # the ranks (children) never return here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not a rank: skip tearing torch down again (about 1 s)
