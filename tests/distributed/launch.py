"""Run a rank worker under the real ``deepspeed`` launcher (gloo on CPU) and collect its files."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("train_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_ranks, out, *worker_args, timeout=240):
    """Run ``train_worker.py`` on ``num_ranks`` local ranks; returns (returncode, output, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_ranks), "--master_port",
           str(free_port()), str(WORKER), "--out", str(out), *map(str, worker_args)]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


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
