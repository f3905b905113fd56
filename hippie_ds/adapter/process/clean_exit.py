"""A clean process exit after gloo collectives: no "terminate called without an active exception".

**The abort.** Now and then a rank that has finished its work and written its results dies at
interpreter exit with ``terminate called without an active exception`` (SIGABRT: status 134, 250
from DeepSpeed's launcher), stock DeepSpeed as much as hippie-ds. The cause is torch's, with
Python before 3.14: ``ProcessGroupGloo`` runs each collective on one of its worker threads
(``pt_gloo_runloop``), which drops its reference to the finished work, and with it to the work's
tensors, just after completing it; a tensor that Python also holds then releases its Python
object, which takes the GIL. A worker still that far behind when the interpreter starts to
finalize (it was preempted, or waited for the GIL the main thread kept up to the end of the
script) gets the GIL after finalization began, and CPython ends such a thread with
``pthread_exit``, whose unwinding crosses a ``noexcept`` destructor (``~AsyncWork``): C++ calls
``std::terminate``. Native backtrace at the abort: ``ProcessGroupGloo::runLoop`` ->
``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` -> ``take_gil`` ->
``pthread_exit`` -> ``std::terminate``. ``destroy_process_group()`` does not help: it neither
stops nor joins the workers (the process groups live on while DeepSpeed holds them), and a
process group destroyed during finalization joins workers that may still need the GIL.

**The workaround** (:func:`wait_for_collectives`): before the interpreter finalizes, release the
GIL until every gloo worker thread of the process is parked in its queue wait (read from
``/proc/self/task``: a ``futex`` wait without a timeout; a thread waiting for the GIL waits with
one), so that no worker holds a work any more. ``hippie_ds.initialize`` registers it at exit
(:func:`wait_at_exit`); scripts that train with ``deepspeed.initialize`` call
:func:`hippie_ds.shutdown` at the end (docs/reference.md, "Clean exit").
"""

from __future__ import annotations

import atexit
import os
import platform
import time

WORKER_THREAD = "pt_gloo_runloop"  # c10d::ProcessGroupGloo::runLoop's thread name
EXIT_WAIT_S = 5.0  # at exit: idle workers park within microseconds; a collective in flight may never end
_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())  # the futex syscall number
_registered = False


def _parked(tid: str) -> bool:
    """A gloo worker is parked: sleeping in ``futex`` with no timeout (its queue's
    ``condition_variable::wait``). Busy when running, waiting with a timeout (the GIL, a peer's
    data) or elsewhere."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/self/task/{tid}/syscall") as f:
            call = f.read().split()
    except (OSError, IndexError):
        return True  # the thread has exited
    return state == "S" and len(call) > 4 and call[0] == str(_FUTEX) and int(call[4], 16) == 0


def busy_workers() -> list[str]:
    """Thread ids of this process's gloo worker threads that are not parked."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    busy = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != WORKER_THREAD:
                    continue
        except OSError:
            continue
        if not _parked(tid):
            busy.append(tid)
    return busy


def wait_for_collectives(timeout: float = 10.0) -> bool:
    """Release the GIL until every gloo worker thread has dropped its last work (parked twice in
    a row, 1 ms apart); at most ``timeout`` seconds (a collective a peer never joins). True when
    they are parked (or there are none); False on the timeout, or where ``/proc`` cannot tell
    (not Linux on x86-64 or aarch64: then it only sleeps 50 ms)."""
    if _FUTEX is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return False
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        quiet = quiet + 1 if not busy_workers() else 0
        if quiet < 2:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)  # releases the GIL: a worker waiting for it frees its tensors
    return True


def shutdown(timeout: float = 10.0) -> bool:
    """The end of a script, on every rank: :func:`wait_for_collectives`, then
    ``torch.distributed.destroy_process_group()`` if a process group is up. Returns what
    :func:`wait_for_collectives` returned."""
    settled = wait_for_collectives(timeout)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return settled


def wait_at_exit() -> None:
    """Register :func:`wait_for_collectives` (at most :data:`EXIT_WAIT_S`) at exit, once per process
    (``hippie_ds.initialize`` does): ``atexit`` callbacks run before the interpreter finalizes."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(wait_for_collectives, EXIT_WAIT_S)
