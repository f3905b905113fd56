"""Run a rank worker on local ranks (gloo on CPU) and collect its files. The launching itself
(environment, process group, clean-up) is tools/bench/cluster's :class:`LocalJob`: by default its
``fork`` launcher (the ranks as DeepSpeed's launcher starts them, forked after one import of torch,
DeepSpeed and hippie_ds); ``launcher="deepspeed"`` for the tests whose point is the user's launcher,
and for every test with ``HIPPIE_TEST_LAUNCHER=deepspeed`` in the environment (slower: about 7 s a
launch more)."""

import os
from pathlib import Path

import torch

from tools.bench.cluster import LocalJob, free_port  # noqa: F401 (free_port: the tests pick ports with it)

WORKER = Path(__file__).with_name("train_worker.py")


def launch(num_ranks, out, *worker_args, timeout=240, port=None, clean_shm=True, worker=WORKER, launcher=None):
    """Run ``worker`` (default ``train_worker.py``) on ``num_ranks`` local ranks; returns
    (returncode, output, seconds). ``clean_shm``: remove the job's /dev/shm segments afterwards
    (left by stock DeepSpeed and by killed ranks)."""
    launcher = launcher or os.environ.get("HIPPIE_TEST_LAUNCHER", "fork")
    run = LocalJob(worker, num_ranks, ["--out", out, *worker_args], port=port, launcher=launcher).run(
        timeout, clean_shm=clean_shm
    )
    output = run.output + (f"\n[launch] killed after {timeout} s" if run.timed_out else "")
    return run.returncode, output, run.seconds


def collect(out, engine):
    """{layer: state}, {rank: losses}, parts [(start, stop)], params, per-replica layer states."""
    layers, losses, replicas, parts, params = {}, {}, {}, None, {}
    for f in sorted(Path(out, engine).glob("rank*.pt")):
        d = torch.load(f)
        losses[f.stem] = d["losses"]
        replicas.setdefault(d["replica"], {}).update(d["layers"])
        if d["replica"] == 0:
            layers.update(d["layers"])
        b = d["parts"]
        parts = [(b[s], b[s + 1]) for s in range(len(b) - 1)]
        params = d["params"]
    return layers, losses, parts, params, replicas
