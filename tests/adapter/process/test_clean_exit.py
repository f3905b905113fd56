"""The teardown abort ("terminate called without an active exception" at interpreter exit) and its
workaround, hippie_ds/adapter/process/clean_exit.py: a gloo worker thread that takes the GIL after the
interpreter began to finalize aborts the process; waiting for the workers at exit prevents it."""

import ctypes
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hippie_ds.adapter.process import clean_exit

linux_proc = pytest.mark.skipif(
    clean_exit._FUTEX is None or not Path("/proc/self/task").is_dir(),
    reason="reads /proc/self/task (Linux, x86-64 or aarch64)",
)


def _named_thread(target, name=clean_exit.WORKER_THREAD):
    """A thread whose native name is ``name`` (what the check reads), running ``target``."""
    ready = threading.Event()

    def run():
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        ready.set()
        target()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait()
    return t


@linux_proc
def test_a_worker_is_busy_until_it_parks_without_a_timeout():
    """Parked: blocked with no timeout (the queue wait of ProcessGroupGloo::runLoop); busy: waiting
    with a timeout (the GIL, a peer's data). wait_for_collectives waits for the one, not the other."""
    assert clean_exit.busy_workers() == [] and clean_exit.wait_for_collectives(timeout=1.0)
    gate, park = threading.Lock(), threading.Lock()
    gate.acquire()
    park.acquire()

    def work():
        gate.acquire(timeout=30)  # busy: a timed wait
        park.acquire()  # parked: an untimed wait

    t = _named_thread(work)
    assert not clean_exit.wait_for_collectives(timeout=0.3)
    assert clean_exit.busy_workers() == [str(t.native_id)]
    gate.release()
    assert clean_exit.wait_for_collectives(timeout=10.0) and clean_exit.busy_workers() == []
    park.release()
    t.join()


@linux_proc
def test_other_threads_are_not_waited_for():
    stop = threading.Event()
    t = _named_thread(lambda: stop.wait(30), name="other")
    assert clean_exit.busy_workers() == [] and clean_exit.wait_for_collectives(timeout=0.3)
    stop.set()
    t.join()


@linux_proc
@pytest.mark.distributed
def test_exit_waits_for_the_gloo_workers(tmp_path):
    """tests/distributed/exit_worker.py: rank 0's gloo worker completes an all-reduce while the main
    thread keeps the GIL to the end of the script. Plain, the worker gets the GIL during the
    interpreter's finalization and the rank aborts (250 from the launcher, as the CI's rare teardown
    aborts); with the wait hippie_ds.initialize registers, both ranks exit 0."""
    from launch import launch

    worker = Path(__file__).resolve().parents[2] / "distributed" / "exit_worker.py"
    with ThreadPoolExecutor(2) as pool:  # the two jobs side by side
        plain, waited = pool.map(
            lambda args: launch(
                2, tmp_path / args[0], *args[1:], worker=worker, timeout=120, launcher="deepspeed"
            ),  # processes as users start them: a
            [("plain",), ("wait", "--wait")],
        )  # forked rank's shorter exit may miss the race
    abort = "terminate called without an active exception"
    assert plain[0] != 0 and abort in plain[1], plain[1][-3000:]
    assert waited[0] == 0 and abort not in waited[1], waited[1][-3000:]
    assert "rank 1 joined the all-reduce" in waited[1]


def test_shutdown_is_exported():
    import hippie_ds

    assert hippie_ds.shutdown.__module__ == "hippie_ds" and "shutdown" in hippie_ds.__all__
    assert sys.modules["hippie_ds.adapter.process.clean_exit"].shutdown is clean_exit.shutdown
