"""An emulated cluster on one machine (the brief, section 4), shared by the tools that need one:
tools/bench.py, tools/bench_hidden_comm.py and tools/multinode.py.

* :class:`Network`: two network namespaces joined by a veth pair (one end in each, an address
  on each, ``lo`` up), both ends optionally shaped with ``tc qdisc ... tbf``; ``setup`` removes
  leftovers of a crashed run first, ``teardown`` removes the namespaces (their veth ends go with
  them). Each tool uses its own names and subnet, so they can be set up side by side.
* :func:`preflight`: refuse (:class:`Refuse`, exit code 2 in the tools) unless the tools are on
  PATH, we are root and ``ip netns`` works.
* :class:`NodeProcesses`: one launcher per emulated node (``ip netns exec NODE ...``), each in its
  own session so that :meth:`NodeProcesses.stop` ends the launcher with its ranks; logs in
  ``LOGS/node{n}.log``, lines carrying a marker echoed with the elapsed time.
* :func:`cleanup_on_signals`: SIGINT/SIGTERM/SIGHUP end the body with ``SystemExit(128 + n)``; the
  clean-up runs with those signals ignored, then the previous handlers come back.
* :class:`ForeignCpu`: CPU used by processes outside the job, sampled while it runs (noise).
"""
from __future__ import annotations

import base64
import contextlib
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Refuse(Exception):
    """A precondition is missing: print the message, exit 2."""


def free_port() -> int:
    """A TCP port free on this host now (for a local launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def sh(*cmd, check=True):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def parse_rate(rate: str) -> float:
    """tc rate (e.g. 1gbit, 500mbit, 100mbps) in bytes per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise Refuse(f"--rate {rate!r}: expected a tc rate like 1gbit, 500mbit or 100mbps")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value / 8 if m.group(3) == "bit" else value


def burst_for(rate_bytes: float) -> str:
    # tbf needs burst >= rate/HZ (at least rate/250 on this kernel); keep 1mb (the brief's) when enough.
    need = 2 * rate_bytes / 250
    return "1mb" if need <= 1024 * 1024 else str(int(math.ceil(need)))


def preflight(what: str, tools: Iterable[str] = ("ip", "tc"), hint: str = ""):
    """Raise :class:`Refuse` (a one-line message, ``hint`` appended) unless ``tools`` are on PATH,
    this process is root and ``ip netns`` works. ``what`` names the tool: "this benchmark"."""
    hint = f" {hint}" if hint else ""
    for tool in tools:
        if shutil.which(tool) is None:
            raise Refuse(f"`{tool}` is not installed or not on PATH (iproute2 / util-linux); it is needed to "
                         f"emulate two nodes.{hint}")
    if os.geteuid() != 0:
        raise Refuse(f"{what} creates network namespaces and a veth pair, which needs root: "
                     f"sudo {sys.executable} {' '.join(sys.argv)}{hint}")
    res = sh("ip", "netns", "list", check=False)
    if res.returncode != 0:
        raise Refuse(f"`ip netns` is not available here ({res.stderr.strip() or 'exit ' + str(res.returncode)}); "
                     f"network namespaces are needed to emulate two nodes.{hint}")


class Network:
    """Two network namespaces joined by a veth pair: ``nodes[i]`` holds ``veths[i]`` with
    ``addrs[i]``/24."""

    def __init__(self, nodes: Sequence[str], veths: Sequence[str], addrs: Sequence[str]):
        if not len(nodes) == len(veths) == len(addrs) == 2:
            raise ValueError("a Network is two namespaces, two veth ends, two addresses")
        self.nodes, self.veths, self.addrs = tuple(nodes), tuple(veths), tuple(addrs)
        self.up = False

    @classmethod
    def named(cls, prefix: str, subnet: str) -> "Network":
        """``PREFIX-node{0,1}``, ``PREFIX-veth{0,1}``, ``SUBNET.1`` and ``SUBNET.2``."""
        return cls((f"{prefix}-node0", f"{prefix}-node1"), (f"{prefix}-veth0", f"{prefix}-veth1"),
                   (f"{subnet}.1", f"{subnet}.2"))

    def teardown(self):
        """Remove our namespaces (their veth ends go with them) and any stray veth of ours here."""
        if shutil.which("ip") is None:
            return
        for ns in self.nodes:
            sh("ip", "netns", "del", ns, check=False)
        for veth in self.veths:
            if sh("ip", "link", "show", veth, check=False).returncode == 0:
                sh("ip", "link", "del", veth, check=False)
        self.up = False

    def setup(self, rate: str | None) -> dict:
        """Create the namespaces and the link (shaped with tbf at ``rate`` unless None); returns
        ``{namespace: its qdisc}``."""
        self.teardown()  # leftovers of a crashed run
        self.up = True
        for ns in self.nodes:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for ns, veth, addr in zip(self.nodes, self.veths, self.addrs):
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", veth, "up")
            if rate is not None:
                sh("tc", "-n", ns, "qdisc", "replace", "dev", veth, "root", "tbf", "rate", rate, "burst",
                   burst_for(parse_rate(rate)), "latency", "100ms")
        return {ns: sh("tc", "-n", ns, "qdisc", "show", "dev", veth).stdout.strip()
                for ns, veth in zip(self.nodes, self.veths)}

    def exec_prefix(self, n: int, core: str | int | None = None) -> list[str]:
        """``ip netns exec NODE`` (and ``taskset -c CORE``) for a command of node ``n``."""
        return ["ip", "netns", "exec", self.nodes[n]] + (["taskset", "-c", str(core)] if core is not None else [])

    def link_bytes(self, n: int) -> dict:
        """Bytes node ``n``'s veth end has sent (tx) and received (rx)."""
        stats = json.loads(sh("ip", "-n", self.nodes[n], "-j", "-s", "link", "show", "dev", self.veths[n]).stdout)
        s = stats[0].get("stats64") or stats[0]["stats"]
        return {"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])}

    def world_info(self, ranks_per_node: int, nodes: int = 2) -> str:
        """``deepspeed.launcher.launch --world_info``: base64 JSON ``{node: [local ranks]}``."""
        info = {self.nodes[n]: list(range(ranks_per_node)) for n in range(nodes)}
        return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


def node_env(veth: str, base: dict | None = None) -> dict:
    """A rank's environment on an emulated node: gloo on the node's veth (without
    GLOO_SOCKET_IFNAME gloo binds 127.0.0.1), CPU accelerator, one thread, the repository on
    PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env.update({"GLOO_SOCKET_IFNAME": veth, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    return env


def remove_shm_segments(port: int):
    """DeepSpeed's CPU comm op leaves a ~64 MB /dev/shm segment per rank, named by master port
    (``hippie_ds.integration.deepspeed_shm_segments``, without importing DeepSpeed here)."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
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


# ---------------------------------------------------------------------------------- processes
class NodeProcesses:
    """The launchers of one job, one per emulated node, each started in its own session (process
    group): :meth:`stop` ends a launcher together with the rank processes it started. Output goes
    to ``logs/node{n}.log``; a line containing ``marker`` is echoed (what follows the marker) with
    the seconds since ``t0``, prefixed by ``tag`` when given."""

    def __init__(self, logs: Path, t0: float | None = None, marker: str = "[bench]", tag: str | None = None,
                 port: int | None = None):
        self.logs, self.marker, self.tag, self.port = Path(logs), marker, tag, port
        self.t0 = time.monotonic() if t0 is None else t0
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []

    def _prefix(self) -> str:
        return f"{self.tag}: " if self.tag else ""

    def start_node(self, n: int, cmd: list[str], env: dict, cwd: Path = REPO) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)
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
                raise RuntimeError(f"{self._prefix()}node {n}'s launcher exited with {c}; see "
                                   f"{self.logs}/node{n}.log" + self.tails())
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
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        if self.port is not None:
            remove_shm_segments(self.port)


# ---------------------------------------------------------------------------------- noise
class ForeignCpu:
    """Samples, once a second, the CPU time used by processes that are not this benchmark (not
    this process nor a descendant): with 4 busy ranks on 2 cores, anything else running slows
    the steps. Samples are (time.perf_counter(), cumulative foreign CPU seconds); perf_counter is
    CLOCK_MONOTONIC, the clock the ranks time their steps with."""

    def __init__(self, interval=1.0):
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._seen: dict[int, float] = {}
        self._total = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, first=False):
        import psutil  # a DeepSpeed dependency

        me = psutil.Process()
        ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
        for p in psutil.process_iter(["cpu_times"]):
            t = p.info["cpu_times"]
            if p.pid in ours or t is None:  # None: gone or not ours to read
                continue
            cpu = t.user + t.system
            before = self._seen.get(p.pid, cpu if first else 0.0)  # a new process: all its CPU is new
            self._total += max(0.0, cpu - before)
            self._seen[p.pid] = cpu
        self.samples.append((time.perf_counter(), self._total))

    def _run(self):
        self._sample(first=True)
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)

    def save(self, path: Path):
        path.write_text(json.dumps({"interval_s": self.interval, "samples": self.samples}))


def foreign_cpu_between(samples, start, end):
    """Foreign CPU seconds in [start, end], linearly interpolated between samples."""
    def at(t):
        if not samples or t <= samples[0][0]:
            return samples[0][1] if samples else 0.0
        for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
            if t <= t1:
                return c0 + (c1 - c0) * (t - t0) / ((t1 - t0) or 1)
        return samples[-1][1]
    return at(end) - at(start)
