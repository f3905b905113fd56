"""N emulated nodes behind one switch: a network namespace per node, each joined by its own veth
pair to a bridge in a switch namespace, so that every node has one link of its own (its NIC and
its switch port), shaped in both directions with ``tc tbf``: the node's end shapes what the node
sends, the switch's end what it receives. Two nodes through the switch see the same rate as
:class:`~cluster.network.Network`'s direct pair; four nodes each get a full link, as in a cluster
whose switch is not the bottleneck.

Same interface as :class:`~cluster.network.Network` (both are :class:`~cluster.network.Namespaces`:
``exec_prefix``, ``link_bytes``, ``world_info``, ``qdiscs`` are shared), so
:class:`~cluster.processes.WorkerJob` runs jobs on either.
"""

from __future__ import annotations

from tools.bench.cluster.network import Namespaces, sh


class StarNetwork(Namespaces):
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
        self._remove(self.nodes + (self.switch,), self.veths + self.ports)

    def setup(self, rate: str | None, burst: str = "default") -> dict:
        """Create the switch, the nodes and their links (each end shaped at ``rate`` unless None);
        returns ``{node namespace: its end's qdisc}``."""
        self.teardown()
        self.up = True
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", self.bridge, "up")
        for n, (ns, veth, port) in enumerate(zip(self.nodes, self.veths, self.ports)):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", port)
            self._bring_up(n, rate, burst)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", self.bridge)
            sh("ip", "-n", self.switch, "link", "set", port, "up")
            self._shape(self.switch, port, rate, burst)
        return self.qdiscs()

    def shaped_ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped link end: each node's veth end and its switch port."""
        return [*zip(self.nodes, self.veths), *((self.switch, port) for port in self.ports)]

    def describe(self, qdiscs: dict | None, with_veths: bool = True) -> str:
        """One line: the nodes, their addresses, the switch and the shaping (None: unshaped)."""
        ends = ", ".join(
            " ".join([n] + ([v] if with_veths else []) + [a]) for n, v, a in zip(self.nodes, self.veths, self.addrs)
        )
        shaping = "unshaped" if qdiscs is None else "each link both ways: " + next(iter(qdiscs.values()), "")
        return f"{len(self.nodes)} nodes ({ends}) on switch {self.switch}; {shaping}"
