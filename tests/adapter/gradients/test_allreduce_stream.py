"""hippie_ds.adapter.gradients.allreduce_stream: the asynchronous averaging all-reduce, over real process
groups (gloo on the CPU here; NCCL on a CUDA side stream wherever CUDA is available)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, backend: str):
    import deepspeed

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def _cpu_worker(rank: int, port: int):
    from deepspeed import comm as dist

    from hippie_ds.adapter.gradients.allreduce_stream import AllReduceStream

    _init(rank, 2, port, "gloo")
    stream = AllReduceStream("cpu", None, 2)
    assert stream.stream is None  # gloo's threads carry it; no stream on the CPU
    flat = torch.full((1000,), float(rank + 1))
    work = stream.start(flat)
    stream.wait(work)
    assert torch.equal(flat, torch.full((1000,), 1.5))  # (1 + 2) / 2
    # DeepSpeed's communication_data_type: an fp32 gradient crosses the wire in bf16, in its
    # rounding, and comes back into the same fp32 tensor
    wire = AllReduceStream("cpu", None, 2, torch.bfloat16)
    value = 1 + 2**-12 * (rank + 1)  # below bf16's resolution at 1: rounds to 1 on the wire
    flat = torch.full((1000,), value)
    started = wire.start(flat)
    assert started.wire.dtype == torch.bfloat16 and started.wire.element_size() * 2 == flat.element_size()
    wire.wait(started)
    assert flat.dtype == torch.float32 and torch.equal(flat, torch.full((1000,), 1.0))
    flat = torch.full((1000,), value)
    stream.wait(stream.start(flat))  # the same in fp32 keeps the bits bf16 drops
    assert torch.equal(flat, torch.full((1000,), 1 + 1.5 * 2**-12))
    dist.destroy_process_group()


def test_cpu_allreduce_averages_over_the_group():
    mp.spawn(_cpu_worker, args=(_free_port(),), nprocs=2)


def _cuda_worker(rank: int, port: int):
    from deepspeed import comm as dist

    from hippie_ds.adapter.gradients.allreduce_stream import AllReduceStream

    _init(rank, 1, port, "nccl")
    torch.cuda.set_device(0)
    stream = AllReduceStream("cuda:0", None, 4)  # divides by 4: shows whether the side stream saw the value
    assert stream.stream is not None and stream.stream != torch.cuda.current_stream()
    flat = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while ...
    flat.fill_(8.0)  # ... before it writes the gradient: a side stream that did not wait would divide zeros
    work = stream.start(flat)
    stream.wait(work)
    result = flat * 1.0  # read on the compute stream, after wait()
    assert torch.equal(result.cpu(), torch.full((1 << 20,), 2.0))
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CI has none); the CPU path is tested above")
def test_cuda_allreduce_runs_on_a_side_stream_after_the_compute_stream():
    mp.spawn(_cuda_worker, args=(_free_port(),), nprocs=1)
