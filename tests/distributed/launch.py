"""Run a rank worker under the real ``deepspeed`` launcher (gloo on CPU) and collect its files."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from hippie_ds.integration import deepspeed_shm_segments

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("train_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_ranks, out, *worker_args, timeout=240, port=None, clean_shm=True, worker=WORKER):
    """Run ``worker`` (default ``train_worker.py``) on ``num_ranks`` local ranks; returns
    (returncode, output, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    env["OMP_NUM_THREADS"] = "1"
    port = port or free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_ranks), "--master_port",
           str(port), str(worker), "--out", str(out), *map(str, worker_args)]
    start = time.monotonic()
    # Own process group: on a timeout the ranks die with the launcher instead of spinning on.
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[launch] killed after {timeout} s"
    finally:
        _kill_group(proc.pid)
        for path in deepspeed_shm_segments(port) if clean_shm else ():  # left by killed ranks
            os.unlink(path)
    return proc.returncode, output, time.monotonic() - start


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
