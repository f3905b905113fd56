"""The machine the planner plans for: nodes of identical devices, a fast link inside a node and a
slower one between nodes. Pure Python.

A cluster is given as a YAML/JSON file with the fields of :class:`Cluster`, or on one line::

    4x4,16GB,100Gbit              4 nodes x 4 devices, 16e9 bytes each, 100 Gbit/s between nodes
    4x4,16GiB,12.5GB/s,300GB/s    ... 12.5e9 B/s between nodes, 300e9 B/s inside a node
    2x8,mem=80GB,inter=200Gbit,intra=450GB/s,latency=5us

Sizes: B with k/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of 1024). Rates: bytes per second
(``GB/s``, ``GBps``) or bits per second (``Gbit``, ``Gbit/s``, ``Gbps``, ``Gb/s``). Without
keys, the first size is the device memory, the first rate the inter-node bandwidth and the
second the intra-node one (default 100 GB/s: NVLink-class, the figure PipeDream's reference
plans assume inside a server).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hippie_ds.data_files import read_data_file

from .host import HostCost
from .profile import PlannerError

DEFAULT_INTRA_NODE_BANDWIDTH = 100e9


class ClusterError(PlannerError):
    """A cluster description that cannot be used."""


class Cluster(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(ge=1, description="number of nodes (servers)")
    devices_per_node: int = Field(ge=1, description="accelerators per node")
    device_memory: float = Field(gt=0, description="memory of one device (bytes)")
    inter_node_bandwidth: float = Field(gt=0, description="bandwidth between nodes, per node (bytes/s)")
    intra_node_bandwidth: float = Field(
        DEFAULT_INTRA_NODE_BANDWIDTH, gt=0, description="bandwidth between devices of a node (bytes/s)"
    )
    latency: float = Field(0.0, ge=0, description="start-up latency of one message (s)")
    host: HostCost | None = Field(
        None,
        description="the host's CPU per instruction kind (planner/host.py); none: the host is never the bottleneck",
    )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def message_latency(self) -> float:
        """Start-up of one pipeline message: the link's latency, or the host's per send/receive when longer."""
        return max(self.latency, self.host.p2p.fixed if self.host else 0.0)

    def describe(self) -> str:
        host = (
            f"; host per forward {self.host.forward.fixed * 1e3:.3g} ms + {self.host.forward.per_layer * 1e3:.3g} "
            f"ms/layer"
            if self.host
            else ""
        )
        return (
            f"{self.nodes} node(s) x {self.devices_per_node} device(s), {_bytes(self.device_memory)} each, "
            f"{_rate(self.inter_node_bandwidth)} between nodes, {_rate(self.intra_node_bandwidth)} inside{host}"
        )


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


def _rate(n: float) -> str:
    return f"{n * 8 / 1e9:.4g} Gbit/s ({n / 1e9:.4g} GB/s)"


_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_QUANTITY = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?(.*)$")


def parse_quantity(text: str, kind: str, what: str = "value") -> float:
    """A size ('16GB', '16GiB', '1.6e10'), a rate ('100Gbit', '12.5GB/s') or a time ('5us')."""
    text = text.strip()
    if kind == "time":
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us|ns)?", text)
        if not m:
            raise ClusterError(f"{what} {text!r}: expected a time such as 5us, 0.2ms or 1e-6")
        return float(m.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1}[m.group(2)]
    m = _QUANTITY.match(text)
    if not m:
        raise ClusterError(f"{what} {text!r}: not a number")
    value = float(m.group(1)) * _SCALE[(m.group(2) or "").lower()]
    unit = m.group(3).strip()
    if kind == "bytes":
        if unit not in ("", "B"):
            raise ClusterError(f"{what} {text!r}: expected bytes such as 16GB or 16GiB")
        return value
    low = unit.lower()
    if unit in ("B/s", "Bps"):
        return value
    if low in ("bit", "bits", "bit/s", "bits/s", "bps") or unit in ("b/s", "b"):
        return value / 8
    raise ClusterError(
        f"{what} {text!r}: expected a rate in bytes per second (12.5GB/s) or bits per second "
        "(100Gbit, 100Gbit/s, 100Gbps)"
    )


def _kind(token: str) -> str:
    """'size' or 'rate' of an unkeyed token, from its unit."""
    m = _QUANTITY.match(token)
    unit = m.group(3).strip() if m else ""
    if unit in ("B", ""):
        return "size" if unit == "B" else "unknown"
    return "rate"


def parse_cluster(spec: str) -> Cluster:
    """A cluster from a file (YAML/JSON with the fields of :class:`Cluster`) or a one-line spec
    (see the module docstring)."""
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file():
        return load_cluster(path)
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not tokens:
        raise ClusterError("empty cluster description; expected e.g. 4x4,16GB,100Gbit")
    m = re.fullmatch(r"(\d+)\s*[xX*]\s*(\d+)", tokens[0])
    if not m:
        raise ClusterError(f"cluster {spec!r}: must start with NODESxDEVICES, e.g. 4x4 (4 nodes of 4 devices)")
    fields: dict[str, Any] = {"nodes": int(m.group(1)), "devices_per_node": int(m.group(2))}
    rates: list[float] = []
    keys = {
        "mem": "device_memory",
        "memory": "device_memory",
        "device_memory": "device_memory",
        "inter": "inter_node_bandwidth",
        "inter_node_bandwidth": "inter_node_bandwidth",
        "intra": "intra_node_bandwidth",
        "intra_node_bandwidth": "intra_node_bandwidth",
        "latency": "latency",
    }
    for tok in tokens[1:]:
        if "=" in tok:
            key, _, value = tok.partition("=")
            field = keys.get(key.strip().lower())
            if field is None:
                raise ClusterError(
                    f"cluster {spec!r}: unknown key {key.strip()!r}; allowed: mem, inter, intra, latency"
                )
            kind = "bytes" if field == "device_memory" else "time" if field == "latency" else "rate"
            fields[field] = parse_quantity(value, kind, f"{key.strip()}=")
            continue
        kind = _kind(tok)
        if kind == "size" and "device_memory" not in fields:
            fields["device_memory"] = parse_quantity(tok, "bytes", "device memory")
        elif kind == "rate":
            rates.append(parse_quantity(tok, "rate", "bandwidth"))
        else:
            raise ClusterError(
                f"cluster {spec!r}: cannot tell what {tok!r} is; write sizes with B (16GB) and "
                "rates with /s or bit (12.5GB/s, 100Gbit), or use mem=, inter=, intra="
            )
    if rates:
        fields.setdefault("inter_node_bandwidth", rates[0])
    if len(rates) > 1:
        fields.setdefault("intra_node_bandwidth", rates[1])
    if len(rates) > 2:
        raise ClusterError(f"cluster {spec!r}: more than two bandwidths")
    missing = [
        name
        for name, f in (
            ("device memory (e.g. 16GB)", "device_memory"),
            ("inter-node bandwidth (e.g. 100Gbit)", "inter_node_bandwidth"),
        )
        if f not in fields
    ]
    if fields["nodes"] == 1 and "inter_node_bandwidth" not in fields:
        fields["inter_node_bandwidth"] = fields.get("intra_node_bandwidth", DEFAULT_INTRA_NODE_BANDWIDTH)
        missing = [x for x in missing if "inter" not in x]
    if missing:
        raise ClusterError(f"cluster {spec!r}: missing {' and '.join(missing)}")
    return _build(fields, f"cluster {spec!r}")


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    data = read_data_file(path, "cluster", ClusterError)
    if not isinstance(data, dict):
        raise ClusterError(
            f"{path}: expected a mapping with nodes, devices_per_node, device_memory, inter_node_bandwidth"
        )
    for key in ("device_memory",):
        if isinstance(data.get(key), str):
            data[key] = parse_quantity(data[key], "bytes", f"{path}: {key}")
    for key in ("inter_node_bandwidth", "intra_node_bandwidth"):
        if isinstance(data.get(key), str):
            data[key] = parse_quantity(data[key], "rate", f"{path}: {key}")
    if isinstance(data.get("latency"), str):
        data["latency"] = parse_quantity(data["latency"], "time", f"{path}: latency")
    return _build(data, str(path))


def _build(fields: dict, where: str) -> Cluster:
    try:
        cluster = Cluster.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ClusterError(f"{where}: {problems}") from None
    for f in ("device_memory", "inter_node_bandwidth", "intra_node_bandwidth"):
        if not math.isfinite(getattr(cluster, f)):
            raise ClusterError(f"{where}: {f} must be finite")
    return cluster
