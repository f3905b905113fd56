"""Where a stage's asynchronous gradient all-reduce runs, and the stream waits it needs.

On CUDA it is queued on a side stream of its own, so that its scaling and NCCL's launch do not
wait behind the forward and backward kernels already queued on the compute stream, and the
collective overlaps the next ones. Roughly:

    side.wait_stream(compute)        # the gradients were written on the compute stream
    with side: flat /= world; work = all_reduce(flat, async_op=True)
    ... compute goes on ...
    work.wait()                      # makes the (then current) compute stream wait for NCCL

``flat`` is recorded on the side stream, so that the caching allocator does not hand its memory
to another kernel while the side stream may still use it. Elsewhere (the CPU and gloo, whose own
threads carry the collective) there is no stream: the all-reduce starts from the calling thread.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist


class AllReduceStream:
    """Starts and finishes the asynchronous, averaging all-reduce of one flat gradient tensor over
    a data-parallel group; on CUDA devices on a side stream, elsewhere on the caller's thread."""

    def __init__(self, device: torch.device | str, group, world_size: int):
        self.device = torch.device(device)
        self.group = group
        self.world_size = world_size
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def start(self, flat: torch.Tensor):
        """Divides ``flat`` by the group's size and starts summing it over the group, in place.
        Returns the collective's handle for :meth:`wait`."""
        if self.stream is None:
            flat.div_(self.world_size)
            return dist.all_reduce(flat, group=self.group, async_op=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        flat.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            flat.div_(self.world_size)
            return dist.all_reduce(flat, group=self.group, async_op=True)

    @staticmethod
    def wait(work) -> None:
        """Finishes a started all-reduce: the caller (on CUDA, its current stream) may read the
        tensor afterwards."""
        work.wait()
