"""The bench's CUDA path, what of it runs without a GPU: where the ranks compute (--accelerator),
each emulated node's GPUs and NCCL environment, the collective backend and the instruction clock.
A GPU run itself needs one GPU per rank (docs/results.md says what is verified)."""

import argparse
import time

import pytest
import torch

from hippie_ds.adapter.profiling.timeline import Timeline, compute_clock
from tools.bench.cluster import Refuse, gpu_slices, node_env
from tools.bench.config import resolve_accelerator


def test_gpu_slices_give_every_rank_its_own_gpu_and_refuse_too_few():
    assert gpu_slices(8, 2, 4) == ["0,1,2,3", "4,5,6,7"]
    assert gpu_slices(8, 4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    with pytest.raises(Refuse, match=r"2 node\(s\) x 4 ranks need 8 GPUs, one per rank .* this machine has 1"):
        gpu_slices(1, 2, 4)


def test_node_env_holds_nccl_to_the_nodes_veth_and_gives_each_node_its_host_id():
    env = node_env("hdss-veth1", base={}, accelerator="cuda", host="hdss-node1", gpus="4,5,6,7")
    assert env["DS_ACCELERATOR"] == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "hdss-veth1"
    assert env["NCCL_HOSTID"] == "hdss-node1" and env["NCCL_IB_DISABLE"] == "1"
    cpu = node_env("hdss-veth0", base={})
    assert cpu["DS_ACCELERATOR"] == "cpu" and not any(k.startswith("NCCL_") or k == "CUDA_VISIBLE_DEVICES" for k in cpu)
    with pytest.raises(ValueError, match="needs the node's host id and its GPUs"):
        node_env("v", base={}, accelerator="cuda")
    with pytest.raises(ValueError, match="accelerator 'rocm': allowed cpu, cuda"):
        node_env("v", base={}, accelerator="rocm")


def test_accelerator_choice():
    p = argparse.ArgumentParser()
    assert resolve_accelerator(p, "auto", emulated=False, device_count=0) == ("cpu", 0)
    assert resolve_accelerator(p, "auto", emulated=False, device_count=8) == ("cuda", 8)
    assert resolve_accelerator(p, "auto", emulated=True, device_count=8) == ("cpu", 8)  # an emulated device waits
    assert resolve_accelerator(p, "cpu", emulated=False, device_count=8) == ("cpu", 8)
    for emulated, count in ((True, 8), (False, 0)):
        with pytest.raises(SystemExit):
            resolve_accelerator(p, "cuda", emulated=emulated, device_count=count)


def test_cpu_instruction_clock_is_the_plain_counter():
    assert compute_clock(torch.device("cpu")) is time.perf_counter
    assert Timeline(2).now is time.perf_counter


def test_worker_backend_is_gloo_on_the_cpu():
    from tools.bench.workers.bench_worker import backend_name

    assert backend_name() == "gloo"
