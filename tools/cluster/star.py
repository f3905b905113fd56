"""N emulated nodes behind one switch: a network namespace per node, each joined by its own veth
pair to a bridge in a switch namespace, so that every node has one link of its own (its NIC and
its switch port), shaped in both directions with ``tc tbf``: the node's end shapes what the node
sends, the switch's end what it receives. Two nodes through the switch see the same rate as
:class:`~cluster.network.Network`'s direct pair; four nodes each get a full link, as in a cluster
whose switch is not the bottleneck.

Same interface as :class:`~cluster.network.Network` (``nodes``, ``veths``, ``addrs``, ``setup``,
``teardown``, ``describe``, ``exec_prefix``, ``link_bytes``, ``world_info``), so
:class:`~cluster.processes.WorkerJob` runs jobs on either.
"""
from __future__ import annotations

import base64
import json
import shutil

from .network import burst_for, parse_rate, sh


class StarNetwork:
    """``n`` namespaces ``PREFIX-node{i}`` with ``PREFIX-veth{i}`` (``SUBNET.{i+1}``/24), each
    paired with ``PREFIX-sw{i}`` on bridge ``PREFIX-br`` in namespace ``PREFIX-switch``."""

    def __init__(self, prefix: str, subnet: str, n: int):
        if n < 1 or n > 250:
            raise ValueError(f"StarNetwork: {n} nodes; allowed 1..250")
        if len(f"{prefix}-veth{n - 1}") > 15:
            raise ValueError(f"StarNetwork: prefix {prefix!r} makes interface names over 15 characters")
        self.prefix, self.switch, self.bridge = prefix, f"{prefix}-switch", f"{prefix}-br"
        self.nodes = tuple(f"{prefix}-node{i}" for i in range(n))
        self.veths = tuple(f"{prefix}-veth{i}" for i in range(n))
        self.ports = tuple(f"{prefix}-sw{i}" for i in range(n))
        self.addrs = tuple(f"{subnet}.{i + 1}" for i in range(n))
        self.up = False

    def teardown(self):
        """Remove the namespaces (their veth ends and the bridge go with them) and stray veths here."""
        if shutil.which("ip") is None:
            return
        for ns in self.nodes + (self.switch,):
            sh("ip", "netns", "del", ns, check=False)
        for veth in self.veths + self.ports:
            if sh("ip", "link", "show", veth, check=False).returncode == 0:
                sh("ip", "link", "del", veth, check=False)
        self.up = False

    def setup(self, rate: str | None, burst: str = "default") -> dict:
        """Create the switch, the nodes and their links (each end shaped at ``rate`` unless None);
        returns ``{node namespace: its end's qdisc}``."""
        self.teardown()
        self.up = True
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", self.bridge, "up")
        for ns, veth, port, addr in zip(self.nodes, self.veths, self.ports, self.addrs):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", self.bridge)
            sh("ip", "-n", self.switch, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", veth, "up")
            if rate is not None:
                for where, dev in ((ns, veth), (self.switch, port)):
                    sh("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                       burst_for(parse_rate(rate), burst), "latency", "100ms")
        return {ns: sh("tc", "-n", ns, "qdisc", "show", "dev", veth).stdout.strip()
                for ns, veth in zip(self.nodes, self.veths)}

    def describe(self, qdiscs: dict | None, with_veths: bool = True) -> str:
        """One line: the nodes, their addresses, the switch and the shaping (None: unshaped)."""
        ends = ", ".join(" ".join([n] + ([v] if with_veths else []) + [a])
                         for n, v, a in zip(self.nodes, self.veths, self.addrs))
        shaping = "unshaped" if qdiscs is None else "each link both ways: " + next(iter(qdiscs.values()), "")
        return f"{len(self.nodes)} nodes ({ends}) on switch {self.switch}; {shaping}"

    def exec_prefix(self, n: int, core: str | int | None = None) -> list[str]:
        """``ip netns exec NODE`` (and ``taskset -c CORE``) for a command of node ``n``."""
        return ["ip", "netns", "exec", self.nodes[n]] + (["taskset", "-c", str(core)] if core is not None else [])

    def link_bytes(self, n: int) -> dict:
        """Bytes node ``n``'s end has sent (tx) and received (rx)."""
        stats = json.loads(sh("ip", "-n", self.nodes[n], "-j", "-s", "link", "show", "dev", self.veths[n]).stdout)
        s = stats[0].get("stats64") or stats[0]["stats"]
        return {"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])}

    def world_info(self, ranks_per_node: int, nodes: int | None = None) -> str:
        """``deepspeed.launcher.launch --world_info``: base64 JSON ``{node: [local ranks]}``."""
        info = {self.nodes[n]: list(range(ranks_per_node)) for n in range(nodes or len(self.nodes))}
        return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()
