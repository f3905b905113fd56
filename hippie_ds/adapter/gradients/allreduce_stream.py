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

The wire's dtype is DeepSpeed's ``communication_data_type`` (its engine property: the config key,
else fp16 / bf16 under those precisions, else fp32), as in its own ``allreduce_bucket``: a flat
gradient of another dtype (bf16's fp32 accumulators) is cast for the collective and copied back
when it is waited for. So a bf16 run sends half the bytes, as stock DeepSpeed's does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from deepspeed import comm as dist


class InFlight(NamedTuple):
    """A started all-reduce: the collective's handle, the caller's tensor, and the tensor on the
    wire (``flat`` itself, or its cast to the communication dtype)."""

    work: object
    flat: torch.Tensor
    wire: torch.Tensor


class AllReduceStream:
    """Starts and finishes the asynchronous, averaging all-reduce of one flat gradient tensor over
    a data-parallel group; on CUDA devices on a side stream, elsewhere on the caller's thread."""

    def __init__(self, device: torch.device | str, group, world_size: int, dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.group = group
        self.world_size = world_size
        self.dtype = dtype  # the wire's (communication_data_type); None: the tensor's own
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _average(self, flat: torch.Tensor) -> InFlight:
        wire = flat if self.dtype in (None, flat.dtype) else flat.to(self.dtype)
        wire.div_(self.world_size)
        return InFlight(dist.all_reduce(wire, group=self.group, async_op=True), flat, wire)

    def start(self, flat: torch.Tensor) -> InFlight:
        """Divides ``flat`` by the group's size and starts summing it over the group (in place,
        or on its cast to the wire's dtype). Returns what :meth:`wait` finishes."""
        if self.stream is None:
            return self._average(flat)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        flat.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            return self._average(flat)

    @staticmethod
    def wait(started: InFlight) -> None:
        """Finishes a started all-reduce: the caller (on CUDA, its current stream) may read the
        tensor afterwards."""
        started.work.wait()
        if started.wire is not started.flat:
            started.flat.copy_(started.wire)
