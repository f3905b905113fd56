#!/usr/bin/env python3
"""A 2-node x 2-rank hippie-ds job started with DeepSpeed's own launcher, on an emulated cluster.

What a user with two machines does (docs/training.md, "Several nodes"), on one machine: two network namespaces
(PREFIX-node0, PREFIX-node1) joined by a veth pair (SUBNET.1 <-> SUBNET.2, both ends shaped with
``tc tbf``, default 1gbit), a hostfile naming the two nodes with 2 slots each, and on each node

    ip netns exec PREFIX-nodeN env GLOO_SOCKET_IFNAME=PREFIX-vethN \\
        deepspeed --hostfile OUT/hostfile --no_ssh --node_rank N --master_addr SUBNET.1 --master_port P \\
        tools/bench/workers/multinode_worker.py --deepspeed_config configs/hippie.json --out OUT/ranks --steps 3

tools/bench/workers/multinode_worker.py trains a tiny PipelineModule with ``hippie_ds.initialize``: 2 pipeline
stages inside each node, 2 data-parallel replicas across the link. The tool then checks that both
launchers exited 0, that all 4 ranks wrote their record (ranks 0,1 on node 0's veth, 2,3 on
node 1's, each node in its own namespace), that every rank got the same loss at every step, and
that traffic crossed the link. The namespaces are always removed: at exit, on Ctrl-C
(SIGINT/SIGTERM/SIGHUP) and leftovers of a crashed run at start; the launchers are ended with
their ranks.

Usage (from the repository root, as root; ``sudo`` keeps the venv's python)::

    sudo make multinode
    sudo .venv/bin/python -m tools.bench multinode --steps 5 --schedule gpipe

Exit code: 0 the job ran and every check passed, 1 a launcher failed or a check did not pass, 2
refused (not root, no ``ip netns``/``tc``; one line on stderr) or a bad option. Outputs under --out
(default out/multinode): hostfile, commands.txt (the two command lines), logs/node{0,1}.log (each
launcher's output), ranks/rank{R}.json, result.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

from tools.bench import WORKERS
from tools.bench.cluster import (
    Network,
    NodeProcesses,
    Refuse,
    check_cores,
    cleanup_on_signals,
    fix_owner,
    node_env,
    parse_rate,
    preflight,
)

WORKER = WORKERS / "multinode_worker.py"

RANKS_PER_NODE = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench multinode",
        description="Run a 2-node x 2-rank hippie-ds job with DeepSpeed's launcher (deepspeed --hostfile H --no_ssh "
        "--node_rank N) on two emulated nodes (network namespaces joined by a shaped veth pair); check "
        "that both nodes finish and all ranks agree on the loss. Needs root.",
        epilog="example: sudo .venv/bin/python -m tools.bench multinode --steps 3",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="out/multinode", help="output directory")
    p.add_argument("--config", default="configs/hippie.json", help="DeepSpeed config (with the hippie-ds keys)")
    p.add_argument("--schedule", help="override the config's pipeline.schedule (e.g. 1f1b, gpipe, 2bw)")
    p.add_argument("--steps", type=int, default=3, help="train_batch calls")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    p.add_argument("--no-shape", action="store_true", help="do not shape the link")
    p.add_argument(
        "--cores",
        default=None,
        help="pin node 0's ranks to one core and node 1's to another, e.g. 0,1 (default: no pinning)",
    )
    p.add_argument("--prefix", default="hdsm", help="names: PREFIX-node0/1 (namespaces), PREFIX-veth0/1")
    p.add_argument("--subnet", default="10.79.0", help="the link's /24: node 0 is SUBNET.1, node 1 SUBNET.2")
    p.add_argument("--port", type=int, default=29500, help="master port (on node 0)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before the job is killed")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if len(f"{a.prefix}-veth0") > 15:
        p.error(f"--prefix {a.prefix!r}: interface names are at most 15 characters ({a.prefix}-veth0)")
    if not (len(a.subnet.split(".")) == 3 and all(x.isdigit() and int(x) < 256 for x in a.subnet.split("."))):
        p.error(f"--subnet {a.subnet!r}: expected three octets, e.g. 10.79.0")
    return a


def deepspeed_command(net: Network, n: int, hostfile: Path, a, ranks_dir: Path, config: Path) -> list[str]:
    """Node ``n``'s launcher: DeepSpeed's ``deepspeed`` script from this Python's environment."""
    launcher = Path(sys.executable).with_name("deepspeed")
    if not launcher.exists():
        launcher = Path(shutil.which("deepspeed") or "deepspeed")
    worker_args = ["--deepspeed_config", str(config), "--out", str(ranks_dir), "--steps", str(a.steps)]
    if a.schedule:
        worker_args += ["--schedule", a.schedule]
    return [
        str(launcher),
        "--hostfile",
        str(hostfile),
        "--no_ssh",
        "--node_rank",
        str(n),
        "--master_addr",
        net.addrs[0],
        "--master_port",
        str(a.port),
        str(WORKER),
        *worker_args,
    ]


def check_results(net: Network, ranks_dir: Path, steps: int, link: list[dict]) -> tuple[list[str], dict]:
    """(problems, summary) from the ranks' records."""
    problems = []
    world = len(net.nodes) * RANKS_PER_NODE
    recs = {}
    for r in range(world):
        f = ranks_dir / f"rank{r}.json"
        if f.exists():
            recs[r] = json.loads(f.read_text())
        else:
            problems.append(f"rank {r} wrote no record ({f})")
    nodes = {}
    for r, rec in recs.items():
        nodes.setdefault(rec["node"], []).append(r)
        want_node = r // RANKS_PER_NODE
        if rec["node"] != want_node or rec["gloo_socket_ifname"] != net.veths[want_node]:
            problems.append(
                f"rank {r} ran on node {rec['node']} with GLOO_SOCKET_IFNAME="
                f"{rec['gloo_socket_ifname']}; expected node {want_node} on {net.veths[want_node]}"
            )
        if rec["world_size"] != world or len(rec["losses"]) != steps:
            problems.append(
                f"rank {r}: world size {rec['world_size']}, {len(rec['losses'])} losses; expected {world} and {steps}"
            )
    namespaces = {n: {recs[r]["netns"] for r in rs} for n, rs in nodes.items()}
    if len(namespaces) == len(net.nodes) and (
        any(len(v) != 1 for v in namespaces.values()) or len(set.union(*namespaces.values())) != len(net.nodes)
    ):
        problems.append(f"the nodes' ranks did not run in one network namespace per node: {namespaces}")
    losses = [recs[r]["losses"] for r in sorted(recs)]
    spread = 0.0
    if recs and all(len(x) == steps for x in losses):
        for s in range(steps):
            values = [x[s] for x in losses]
            spread = max(spread, max(values) - min(values))
            if not all(math.isfinite(v) for v in values) or not all(
                math.isclose(v, values[0], rel_tol=1e-6, abs_tol=1e-9) for v in values
            ):
                problems.append(
                    f"the ranks disagree on step {s + 1}'s loss: "
                    + ", ".join(f"rank {r}: {x[s]!r}" for r, x in zip(sorted(recs), losses))
                )
    for n, counts in enumerate(link):
        if min(counts["tx"], counts["rx"]) < 1024:
            problems.append(
                f"node {n}'s veth sent {counts['tx']} and received {counts['rx']} bytes: the job did not use the link"
            )
    summary = {
        "ranks": {
            r: {k: rec[k] for k in ("node", "local_rank", "stage", "replica", "gloo_socket_ifname", "netns")}
            for r, rec in sorted(recs.items())
        },
        "schedule": recs[0]["schedule"] if 0 in recs else None,
        "losses": losses[0] if losses else [],
        "max_loss_spread": spread,
        "link_bytes": {net.nodes[n]: c for n, c in enumerate(link)},
    }
    return problems, summary


def refusal(a) -> tuple[str | None, list[int] | None]:
    """(why this cannot run here, or None; the cores to pin the nodes to, or None)."""
    if not Path(a.config).resolve().is_file():
        return f"--config {a.config}: no such file", None
    try:
        preflight(
            "python -m tools.bench multinode",
            ("ip",) + (() if a.no_shape else ("tc",)) + (("taskset",) if a.cores else ()),
        )
        cores = None if a.cores is None else check_cores(a.cores)
        if not a.no_shape:
            parse_rate(a.rate)
    except Refuse as exc:
        return str(exc), None
    return None, cores


def start_nodes(net: Network, job: NodeProcesses, a, hostfile: Path, ranks_dir: Path, cores) -> list[str]:
    """Start ``deepspeed`` on both nodes; returns the command lines as a user on the node types them."""
    config = Path(a.config).resolve()
    commands = []
    for n in range(len(net.nodes)):
        cmd = deepspeed_command(net, n, hostfile, a, ranks_dir, config)
        prefix = net.exec_prefix(n, None if cores is None else cores[n])
        shown = prefix + ["env", f"GLOO_SOCKET_IFNAME={net.veths[n]}"] + cmd
        commands.append(shlex.join(shown))
        print(f"node {n}: {commands[-1]}", flush=True)
        job.start_node(n, prefix + cmd, node_env(net.veths[n]))
    return commands


def report(net: Network, out: Path, a, link: list[dict], wall: float, commands: list[str], hostfile: Path) -> int:
    """Check the ranks' records, write result.json, print the verdict; the exit code."""
    problems, summary = check_results(net, out / "ranks", a.steps, link)
    summary.update(wall_s=wall, commands=commands, hostfile=hostfile.read_text(), ok=not problems)
    (out / "result.json").write_text(json.dumps(summary, indent=1))
    if problems:
        for p in problems:
            print(f"multinode: {p}", file=sys.stderr)
        return 1
    placement = "; ".join(
        f"{net.nodes[n]}: ranks {', '.join(str(r) for r in range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE))}"
        f" on {net.veths[n]}"
        for n in range(len(net.nodes))
    )
    print(
        f"multinode: OK in {wall:.0f} s: schedule {summary['schedule']}, 2 nodes x {RANKS_PER_NODE} ranks "
        f"({placement}); all {len(summary['ranks'])} ranks agree on the loss at every step: "
        + " ".join(f"{x:.6f}" for x in summary["losses"])
        + "; link bytes sent "
        + ", ".join(f"{k}: {v['tx']}" for k, v in summary["link_bytes"].items())
    )
    return 0


def run(a) -> int:
    out = Path(a.out).resolve()
    why, cores = refusal(a)
    if why is not None:
        print(f"multinode: {why}", file=sys.stderr)
        return 2

    net = Network.named(a.prefix, a.subnet)
    ranks_dir = out / "ranks"
    shutil.rmtree(ranks_dir, ignore_errors=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    (out / "result.json").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    hostfile = out / "hostfile"
    hostfile.write_text("".join(f"{ns} slots={RANKS_PER_NODE}\n" for ns in net.nodes))
    start = time.monotonic()
    job = NodeProcesses(out / "logs", t0=start, marker="[multinode]", port=a.port)
    link, rc = [], 0

    def cleanup():
        job.stop()
        net.teardown()

    with cleanup_on_signals(cleanup):
        try:
            qdiscs = net.setup(None if a.no_shape else a.rate)
            print(f"emulated nodes: {net.describe(None if a.no_shape else qdiscs)}", flush=True)
            print(f"hostfile {hostfile}: " + ", ".join(hostfile.read_text().split("\n")[:-1]), flush=True)
            commands = start_nodes(net, job, a, hostfile, ranks_dir, cores)
            (out / "commands.txt").write_text("\n".join(commands) + "\n")
            job.wait(a.timeout)
            link = [net.link_bytes(n) for n in range(len(net.nodes))]
        except RuntimeError as exc:
            print(f"multinode: {exc}", file=sys.stderr)
            rc = 1
        except SystemExit as exc:  # a signal (cleanup_on_signals)
            print(
                f"multinode: interrupted (exit {exc.code}); stopping the launchers and removing the namespaces",
                file=sys.stderr,
            )
            raise
    if rc == 0:
        rc = report(net, out, a, link, time.monotonic() - start, commands, hostfile)
    fix_owner(out)
    return rc


def main(argv=None) -> int:
    return run(parse_args(argv))
