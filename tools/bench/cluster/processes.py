"""Jobs: rank workers under DeepSpeed's launchers, on emulated nodes (one launcher per node, in
its namespace) or on local ranks, always ended together with their ranks, their /dev/shm
segments removed; and the clean-up on signals and for files written under sudo."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tools.bench import REPO
from tools.bench.cluster.network import Network, Refuse

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port() -> int:
    """A TCP port free on this host now (for a local launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_env(base: dict | None = None) -> dict:
    """A local job's environment: one OpenMP thread, the repository first on PYTHONPATH (the ranks
    import this checkout's hippie_ds, and the rank scripts ``tools.bench...``), this Python's bin
    folder first on PATH (torch's JIT build of DeepSpeed's CPU ops runs a bare ``ninja``: the venv's,
    even when the venv is not activated), the venv's torch_extensions unless set."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PATH": os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH")])),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        }
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    return env


def node_env(
    veth: str, base: dict | None = None, accelerator: str = "cpu", host: str | None = None, gpus: str | None = None
) -> dict:
    """A rank's environment on an emulated node: :func:`local_env` plus gloo on the node's veth
    (without GLOO_SOCKET_IFNAME gloo binds 127.0.0.1), one MKL thread, unbuffered output, and the
    accelerator: ``cpu`` (DeepSpeed's CPU accelerator), or ``cuda`` with NCCL held to the veth
    across nodes. NCCL takes ranks with the same host hash for one machine and joins them by
    shared memory or P2P, past the shaped link: ``host`` (the node's namespace) gives each node
    its own (NCCL_HOSTID), so P2P stays inside a node and sockets on the veth carry the rest
    (no InfiniBand); ``gpus``: the node's CUDA_VISIBLE_DEVICES (:func:`gpu_slices`)."""
    env = local_env(base)
    env.update({"GLOO_SOCKET_IFNAME": veth, "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    elif accelerator == "cuda":
        if host is None or gpus is None:
            raise ValueError("node_env(accelerator='cuda') needs the node's host id and its GPUs")
        env.update(
            {
                "DS_ACCELERATOR": "cuda",
                "NCCL_SOCKET_IFNAME": veth,
                "NCCL_HOSTID": host,
                "NCCL_IB_DISABLE": "1",
                "CUDA_VISIBLE_DEVICES": gpus,
            }
        )
    else:
        raise ValueError(f"accelerator {accelerator!r}: allowed cpu, cuda")
    return env


def gpu_slices(device_count: int, nodes: int, ranks_per_node: int) -> list[str]:
    """Each emulated node's CUDA_VISIBLE_DEVICES: node n gets GPUs n x RPN .. (n+1) x RPN - 1, one per
    rank (NCCL refuses two ranks of a communicator on one GPU). :class:`Refuse` when there are too
    few. Pure."""
    need = nodes * ranks_per_node
    if device_count < need:
        raise Refuse(
            f"--accelerator cuda: {nodes} node(s) x {ranks_per_node} ranks need {need} GPUs, one per rank "
            f"(NCCL puts no two ranks of a group on one GPU); this machine has {device_count}"
        )
    return [",".join(str(n * ranks_per_node + i) for i in range(ranks_per_node)) for n in range(nodes)]


def remove_shm_segments(port: int):
    """DeepSpeed's CPU comm op leaves a ~64 MB /dev/shm segment per rank, named by master port
    (``hippie_ds.adapter.integration.deepspeed_shm_segments``, without importing DeepSpeed here)."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def kill_session(pid: int):
    """SIGKILL a process group started with ``start_new_session`` (a launcher and its ranks)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def fix_owner(out: Path):
    """Files written as root under sudo: give them back to the invoking user."""
    uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
    if os.geteuid() != 0 or not uid:
        return
    for root, dirs, files in os.walk(out):
        for n in [root] + [os.path.join(root, x) for x in dirs + files]:
            try:
                os.chown(n, int(uid), int(gid or uid))
            except OSError:
                pass


@contextlib.contextmanager
def cleanup_on_signals(cleanup: Callable[[], None]):
    """Run the body; SIGINT/SIGTERM/SIGHUP end it with ``SystemExit(128 + signum)``. ``cleanup``
    runs afterwards in every case, with those signals ignored (a second Ctrl-C cannot interrupt
    the tear-down); then the previous handlers come back."""

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)  # finish cleaning up whatever arrives now
        try:
            cleanup()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# ---------------------------------------------------------------------------------- local ranks
@dataclass
class LocalRun:
    """How a :class:`LocalJob` ended: the launcher's exit code (negative: killed), whether it was
    killed at the timeout, its and its ranks' output ('' when it went to a log file), seconds."""

    returncode: int
    timed_out: bool
    output: str
    seconds: float


class LocalJob:
    """A rank worker on ``num_ranks`` local ranks, run from the repository root in :func:`local_env`,
    in a session of its own.

    ``launcher="deepspeed"``: under DeepSpeed's launcher (``deepspeed.launcher.runner --num_gpus N
    --master_port P WORKER ARGS``), as a user runs it. ``launcher="fork"``: the ranks forked from one
    process that imported torch, DeepSpeed and hippie_ds once (:mod:`tools.bench.cluster.fork_ranks`), each
    with the environment, arguments, first-failure rule and exit code DeepSpeed's launcher gives
    it; it saves about 2.5 s of CPU per rank and the runner's two imports of DeepSpeed per launch,
    which is what the tests use it for (tests/real_clients/test_dropin.py and the failed-rank tests keep
    DeepSpeed's launcher)."""

    def __init__(
        self,
        worker: str | Path,
        num_ranks: int,
        worker_args: Sequence = (),
        port: int | None = None,
        launcher: str = "deepspeed",
    ):
        self.port = port or free_port()
        if launcher == "deepspeed":
            start = ["-m", "deepspeed.launcher.runner", "--num_gpus", str(num_ranks), "--master_port", str(self.port)]
        elif launcher == "fork":
            start = ["-u", "-m", "tools.bench.cluster.fork_ranks", str(num_ranks), str(self.port)]
        else:
            raise ValueError(f"launcher {launcher!r}: allowed deepspeed, fork")
        self.command = [sys.executable, *start, str(worker), *map(str, worker_args)]

    def run(self, timeout: float, log: Path | None = None, clean_shm: bool = True) -> LocalRun:
        """Run to the end or ``timeout`` seconds. At the timeout, and afterwards in any case (ranks
        a failed launcher left behind), the session is killed with its ranks; then the job's
        /dev/shm segments are removed (unless ``clean_shm`` is False). Output to ``log`` (a file)
        or returned."""
        start = time.monotonic()
        with open(log, "w") if log is not None else contextlib.nullcontext() as sink:
            proc = subprocess.Popen(
                self.command,
                env=local_env(),
                cwd=REPO,
                text=True,
                start_new_session=True,
                stdout=sink if sink is not None else subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            timed_out = False
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_session(proc.pid)
                output, _ = proc.communicate()
            finally:
                kill_session(proc.pid)
                proc.wait()
                if clean_shm:
                    remove_shm_segments(self.port)
        return LocalRun(proc.returncode, timed_out, output or "", time.monotonic() - start)


# ---------------------------------------------------------------------------------- emulated nodes
class NodeProcesses:
    """The launchers of one job, one per emulated node, each started in its own session (process
    group): :meth:`stop` ends a launcher together with the rank processes it started. Output goes
    to ``logs/node{n}.log``; a line containing ``marker`` is echoed (what follows the marker) with
    the seconds since ``t0``, prefixed by ``tag`` when given."""

    def __init__(
        self,
        logs: Path,
        t0: float | None = None,
        marker: str = "[bench]",
        tag: str | None = None,
        port: int | None = None,
    ):
        self.logs, self.marker, self.tag, self.port = Path(logs), marker, tag, port
        self.t0 = time.monotonic() if t0 is None else t0
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []

    def _prefix(self) -> str:
        return f"{self.tag}: " if self.tag else ""

    def start_node(self, n: int, cmd: list[str], env: dict, cwd: Path = REPO) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.procs.append(proc)
        t = threading.Thread(target=self._pump, args=(n, proc), daemon=True)
        t.start()
        self.threads.append(t)
        return proc

    def _pump(self, n, proc):
        with open(self.logs / f"node{n}.log", "w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if self.marker in line:
                    msg = line.split(self.marker, 1)[1].strip()
                    print(f"[{time.monotonic() - self.t0:6.1f}s] {self._prefix()}{msg}", flush=True)

    def wait(self, timeout: float):
        """Until every launcher exited 0; RuntimeError (with the logs' last lines) when one
        exits otherwise or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                break
            failed = [(n, c) for n, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                n, c = failed[0]
                raise RuntimeError(
                    f"{self._prefix()}node {n}'s launcher exited with {c}; see {self.logs}/node{n}.log" + self.tails()
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self._prefix()}the job ran past --timeout {timeout} s" + self.tails())
            time.sleep(0.3)
        for t in self.threads:
            t.join(timeout=5)

    def tails(self, lines: int = 25) -> str:
        time.sleep(1)
        out = []
        for n in range(len(self.procs)):
            p = self.logs / f"node{n}.log"
            text = p.read_text().splitlines()[-lines:] if p.exists() else []
            out.append(f"\n--- last lines of node{n}.log ---\n" + "\n".join(text))
        return "".join(out)

    def stop(self):
        """End the launchers we started (their process groups: launcher + its rank processes),
        then remove the job's /dev/shm segments."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_session(p.pid)
                p.wait(timeout=5)
        if self.port is not None:
            remove_shm_segments(self.port)


class WorkerJob(NodeProcesses):
    """One launch of a rank worker on an emulated :class:`Network`: DeepSpeed's per-node launcher
    (``deepspeed.launcher.launch --world_info ... --node_rank N``) once per node in use, in that
    node's namespace, pinned to its core; node 0's command line saved to ``LOGS/command.txt``."""

    def __init__(
        self,
        network: Network,
        worker: str | Path,
        worker_args: Sequence[str],
        logs: Path,
        nodes: int,
        ranks_per_node: int,
        cores: Sequence,
        port: int,
        t0: float | None = None,
        tag: str | None = None,
        accelerator: str = "cpu",
        device_count: int = 0,
    ):
        super().__init__(logs, t0=t0, tag=tag, port=port)
        self.network, self.worker, self.worker_args = network, worker, list(worker_args)
        self.nodes, self.rpn, self.cores = nodes, ranks_per_node, list(cores)
        self.accelerator = accelerator
        self.gpus = gpu_slices(device_count, nodes, ranks_per_node) if accelerator == "cuda" else [None] * nodes

    def start(self):
        world_info = self.network.world_info(self.rpn, self.nodes)
        self.logs.mkdir(parents=True, exist_ok=True)
        for n in range(self.nodes):
            cmd = self.network.exec_prefix(n, self.cores[n]) + [
                sys.executable,
                "-u",
                "-m",
                "deepspeed.launcher.launch",
                f"--world_info={world_info}",
                f"--node_rank={n}",
                f"--master_addr={self.network.addrs[0]}",
                f"--master_port={self.port}",
                str(self.worker),
                *self.worker_args,
            ]
            if n == 0:
                (self.logs / "command.txt").write_text(" ".join(cmd) + "\n")
            self.start_node(
                n,
                cmd,
                node_env(
                    self.network.veths[n], accelerator=self.accelerator, host=self.network.nodes[n], gpus=self.gpus[n]
                ),
            )

    def run(self, timeout: float):
        """:meth:`start`, :meth:`wait` up to ``timeout`` seconds, and :meth:`stop` in any case."""
        self.start()
        try:
            self.wait(timeout)
        finally:
            self.stop()
