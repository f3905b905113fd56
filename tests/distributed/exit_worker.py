"""Rank worker for tests/adapter/process/test_clean_exit.py: the teardown abort of
hippie_ds/adapter/process/clean_exit.py made deterministic. Rank 0's gloo worker thread completes an all-reduce of a
tensor that Python holds (rank 1 joins it late) and, releasing the work, waits for the GIL to release the tensor's
Python object, while the main thread keeps the GIL (a long switch interval, a busy loop) up to
the end of the script: the worker gets the GIL only once the interpreter finalizes, and CPython
ends it there: "terminate called without an active exception". With ``--wait`` (what
``hippie_ds.initialize`` registers) the exit first waits for the worker."""

import argparse
import ctypes
import sys
import time

import torch
import torch.distributed as dist

from hippie_ds.adapter.process import clean_exit


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--wait", action="store_true", help="register clean_exit.wait_at_exit() on rank 0")
    p.add_argument("--late", type=float, default=1.0, help="rank 1 joins this long after rank 0 starts it")
    args = p.parse_args()
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        if args.wait:
            clean_exit.wait_at_exit()
        sys.setswitchinterval(100.0)  # a thread waiting for the GIL does not ask for it (for 100 s)
        sys.hippie_exit_test_tensor = torch.ones(10)  # held by Python to the end
        result = ctypes.c_float.from_address(sys.hippie_exit_test_tensor.data_ptr())  # read without a torch call
        dist.all_reduce(sys.hippie_exit_test_tensor, async_op=True)  # the Work is dropped: the worker drops last
        store.set("rank0_waiting", "1")
        print("rank 0 waits for its all-reduce, holding the GIL", flush=True)  # (writing releases the GIL)
        deadline = time.monotonic() + 120.0
        while result.value != 2.0 and time.monotonic() < deadline:  # torch calls would release the GIL
            pass
        settle = time.monotonic() + 0.5
        while time.monotonic() < settle:  # the worker completes the work, then waits for the GIL
            pass
    else:
        store.wait(["rank0_waiting"])
        time.sleep(args.late)
        dist.all_reduce(torch.ones(10))
        clean_exit.wait_for_collectives()  # its own exit: clean in both variants
        print("rank 1 joined the all-reduce", flush=True)


if __name__ == "__main__":
    main()
