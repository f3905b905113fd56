"""Two emulated nodes on one machine: network namespaces joined by a (shaped) veth pair, and the
checks that refuse politely where they cannot be made (not root, no ``ip netns``, bad cores)."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
from typing import Iterable, Sequence


class Refuse(Exception):
    """A precondition is missing: print the message, exit 2."""


def sh(*cmd, check=True):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


# the largest frame a veth sends (MTU 1500 + the Ethernet header): tbf's bucket must hold one
FRAME_BYTES = 1514
# tbf's queue, in seconds of its rate ("latency"): what it holds before it drops
QUEUE_S = 0.1


def parse_rate(rate: str) -> float:
    """tc rate (e.g. 1gbit, 500mbit, 100mbps) in bytes per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise Refuse(f"--rate {rate!r}: expected a tc rate like 1gbit, 500mbit or 100mbps")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value / 8 if m.group(3) == "bit" else value


def burst_for(rate_bytes: float, burst: str = "default") -> str:
    """tbf's burst (its token bucket) for a rate. tbf needs burst >= rate/HZ (at least rate/250 on
    this kernel), and at least one full frame (``FRAME_BYTES``: a slow link's rate/HZ is less).
    "default": 1mb (the brief's) when that is enough, else twice the least. "min": just above the
    least. The bucket fills while the link idles and then passes that many bytes
    at veth speed: a 1.6 MB all-reduce after 0.2 s idle takes 0.021 s at 250mbit with 1mb, against
    0.051 s back to back (python -m tools.bench allreduce --idle-s). A real link has no such credit, so
    "min" is the more faithful; at 1gbit even the least is 0.5 MB."""
    least = max(rate_bytes / 250, FRAME_BYTES)  # tbf drops a frame larger than its bucket
    if burst == "min":
        return str(int(math.ceil(1.1 * least)))
    if burst != "default":
        raise Refuse(f"--burst {burst!r}: allowed default (1mb, or twice the least) or min")
    return "1mb" if 2 * least <= 1024 * 1024 else str(int(math.ceil(2 * least)))


def rate_arg(rate_bytes: float) -> str:
    """A rate in bytes per second as tc's rate argument (whole bits per second). Pure."""
    return f"{max(1, round(rate_bytes * 8))}bit"


def preflight(what: str, tools: Iterable[str] = ("ip", "tc"), hint: str = ""):
    """Raise :class:`Refuse` (a one-line message, ``hint`` appended) unless ``tools`` are on PATH,
    this process is root and ``ip netns`` works. ``what`` names the tool: "this benchmark"."""
    hint = f" {hint}" if hint else ""
    for tool in tools:
        if shutil.which(tool) is None:
            raise Refuse(
                f"`{tool}` is not installed or not on PATH (iproute2 / util-linux); it is needed to "
                f"emulate two nodes.{hint}"
            )
    if os.geteuid() != 0:
        raise Refuse(
            f"{what} creates network namespaces and a veth pair, which needs root: "
            f"sudo {sys.executable} {' '.join(sys.argv)}{hint}"
        )
    res = sh("ip", "netns", "list", check=False)
    if res.returncode == 0:  # listing works where adding does not (a container without CAP_SYS_ADMIN)
        probe = f"hds-probe-{os.getpid()}"
        res = sh("ip", "netns", "add", probe, check=False)
        if res.returncode == 0:
            sh("ip", "netns", "del", probe, check=False)
    if res.returncode != 0:
        raise Refuse(
            f"`ip netns` is not available here ({res.stderr.strip() or 'exit ' + str(res.returncode)}); "
            f"network namespaces are needed to emulate two nodes.{hint}"
        )


def check_cores(spec: str) -> list[int]:
    """``--cores A,B``: node 0's core and node 1's, two distinct cores this process may use
    (:class:`Refuse` otherwise)."""
    try:
        cores = [int(c) for c in spec.split(",")]
    except ValueError:
        cores = []
    if len(cores) != 2 or cores[0] == cores[1] or not set(cores) <= os.sched_getaffinity(0):
        raise Refuse(
            f"--cores {spec!r}: need two distinct cores this process may use "
            f"(allowed: {sorted(os.sched_getaffinity(0))})"
        )
    return cores


class Namespaces:
    """What every emulated cluster here shares: node ``i`` is network namespace ``nodes[i]`` holding
    veth end ``veths[i]`` with ``addrs[i]``/24 (:class:`Network`: two joined directly;
    :class:`~cluster.star.StarNetwork`: N behind a switch). Subclasses set those and ``up``."""

    nodes: tuple[str, ...]
    veths: tuple[str, ...]
    addrs: tuple[str, ...]
    shaping: tuple | None = None  # (rate, burst, queue_s) ``reshape`` last shaped the links at

    def _remove(self, namespaces: Sequence[str], links: Sequence[str]):
        """Delete ``namespaces`` (their veth ends go with them) and any of ``links`` left here."""
        if shutil.which("ip") is None:
            return
        for ns in namespaces:
            sh("ip", "netns", "del", ns, check=False)
        for link in links:
            if sh("ip", "link", "show", link, check=False).returncode == 0:
                sh("ip", "link", "del", link, check=False)
        self.up, self.shaping = False, None

    @staticmethod
    def _shape(ns: str, dev: str, rate: str | None, burst: str, queue_s: float = QUEUE_S):
        """tbf at ``rate`` (its bucket :func:`burst_for` ``burst``, its queue ``queue_s`` seconds of the
        rate) on ``dev`` in ``ns``; nothing for None."""
        if rate is not None:
            sh(
                "tc",
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst_for(parse_rate(rate), burst),
                "latency",
                f"{queue_s * 1e3:.0f}ms",
            )

    def shaped_ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped link end: each node's veth end."""
        return list(zip(self.nodes, self.veths))

    def reshape(self, rate: str, burst: str = "default", queue_s: float = QUEUE_S) -> bool:
        """Shape every link end at ``rate`` (a time-dilated job's own rate), unless ``reshape`` already
        did at these settings; whether it shaped them."""
        if self.shaping == (rate, burst, queue_s):
            return False
        for ns, dev in self.shaped_ends():
            self._shape(ns, dev, rate, burst, queue_s)
        self.shaping = (rate, burst, queue_s)
        return True

    def _bring_up(self, n: int, rate: str | None, burst: str):
        """Move node ``n``'s veth end into its namespace, address it, bring it and ``lo`` up, shape it."""
        ns, veth = self.nodes[n], self.veths[n]
        sh("ip", "link", "set", veth, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{self.addrs[n]}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", veth, "up")
        self._shape(ns, veth, rate, burst)

    def qdiscs(self) -> dict:
        """``{node namespace: the qdisc of its veth end}``."""
        return {
            ns: sh("tc", "-n", ns, "qdisc", "show", "dev", veth).stdout.strip()
            for ns, veth in zip(self.nodes, self.veths)
        }

    def exec_prefix(self, n: int, core: str | int | None = None) -> list[str]:
        """``ip netns exec NODE`` (and ``taskset -c CORE``) for a command of node ``n``."""
        return ["ip", "netns", "exec", self.nodes[n]] + (["taskset", "-c", str(core)] if core is not None else [])

    def link_bytes(self, n: int) -> dict:
        """Bytes node ``n``'s veth end has sent (tx) and received (rx)."""
        stats = json.loads(sh("ip", "-n", self.nodes[n], "-j", "-s", "link", "show", "dev", self.veths[n]).stdout)
        s = stats[0].get("stats64") or stats[0]["stats"]
        return {"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])}

    def world_info(self, ranks_per_node: int, nodes: int | None = None) -> str:
        """``deepspeed.launcher.launch --world_info``: base64 JSON ``{node: [local ranks]}`` of the
        first ``nodes`` nodes (all by default)."""
        info = {self.nodes[n]: list(range(ranks_per_node)) for n in range(nodes or len(self.nodes))}
        return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


class Network(Namespaces):
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
        return cls(
            (f"{prefix}-node0", f"{prefix}-node1"),
            (f"{prefix}-veth0", f"{prefix}-veth1"),
            (f"{subnet}.1", f"{subnet}.2"),
        )

    def teardown(self):
        """Remove our namespaces (their veth ends go with them) and any stray veth of ours here."""
        self._remove(self.nodes, self.veths)

    def setup(self, rate: str | None, burst: str = "default") -> dict:
        """Create the namespaces and the link (shaped with tbf at ``rate`` unless None, its bucket
        :func:`burst_for` ``burst``); returns ``{namespace: its qdisc}``."""
        self.teardown()  # leftovers of a crashed run
        self.up = True
        for ns in self.nodes:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for n in range(2):
            self._bring_up(n, rate, burst)
        return self.qdiscs()

    def describe(self, qdiscs: dict | None, with_veths: bool = True) -> str:
        """One line: each node's namespace (and veth) and address, and the shaping (None: unshaped)."""
        ends = [" ".join([self.nodes[n]] + ([self.veths[n]] if with_veths else []) + [self.addrs[n]]) for n in range(2)]
        return f"{ends[0]} <-> {ends[1]}; " + (
            "unshaped" if qdiscs is None else "; ".join(f"{k}: {v}" for k, v in qdiscs.items())
        )
