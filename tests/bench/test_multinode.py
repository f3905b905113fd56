"""python -m tools.bench multinode: a 2-node x 2-rank job started with DeepSpeed's own launcher
(``deepspeed --hostfile H --no_ssh --node_rank N``) on two emulated nodes (network namespaces
joined by a shaped veth pair). The real run needs root and ``ip netns`` (skipped otherwise);
the refusal and --help run anywhere."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.cluster import Refuse, preflight

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TOOL = ["-m", "tools.bench", "multinode"]  # run from REPO
# Names of our own, so that the test and a `sudo make multinode` can run side by side.
PREFIX, SUBNET = "hdsmt", "10.81.0"


def _netns_available() -> bool:
    try:
        preflight("tests/bench/test_multinode.py", ("ip", "tc"))  # root, `ip netns`, `tc`: what the tool checks
    except Refuse:
        return False
    return True


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def multinode():
    from tools.bench import multinode

    return multinode


@pytest.mark.skipif(not _netns_available(), reason="needs root, `ip netns` and `tc` (emulated nodes)")
def test_two_nodes_with_the_deepspeed_launcher(tmp_path):
    out = tmp_path / "mn"
    res = subprocess.run(
        [
            sys.executable,
            *TOOL,
            "--out",
            str(out),
            "--steps",
            "2",
            "--prefix",
            PREFIX,
            "--subnet",
            SUBNET,
            "--timeout",
            "150",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "multinode: OK" in res.stdout and "all 4 ranks agree on the loss" in res.stdout
    # What a user types on two machines: one `deepspeed --hostfile ... --no_ssh --node_rank N` per node.
    commands = (out / "commands.txt").read_text().splitlines()
    assert len(commands) == 2
    for n, cmd in enumerate(commands):
        assert cmd.startswith(f"ip netns exec {PREFIX}-node{n} env GLOO_SOCKET_IFNAME={PREFIX}-veth{n} ")
        assert f"--hostfile {out / 'hostfile'} --no_ssh --node_rank {n} --master_addr {SUBNET}.1" in cmd
    assert (out / "hostfile").read_text() == f"{PREFIX}-node0 slots=2\n{PREFIX}-node1 slots=2\n"
    result = json.loads((out / "result.json").read_text())
    assert result["ok"] and result["schedule"] == "hippie" and len(result["losses"]) == 2
    ranks = result["ranks"]
    assert {r: (x["node"], x["gloo_socket_ifname"]) for r, x in ranks.items()} == {
        "0": (0, f"{PREFIX}-veth0"),
        "1": (0, f"{PREFIX}-veth0"),
        "2": (1, f"{PREFIX}-veth1"),
        "3": (1, f"{PREFIX}-veth1"),
    }
    assert ranks["0"]["netns"] == ranks["1"]["netns"] != ranks["2"]["netns"] == ranks["3"]["netns"]
    assert {(x["stage"], x["replica"]) for x in ranks.values()} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for r in range(4):
        assert json.loads((out / "ranks" / f"rank{r}.json").read_text())["losses"] == result["losses"]
    assert all(v["tx"] > 1024 and v["rx"] > 1024 for v in result["link_bytes"].values())
    # Torn down: no namespaces, no ranks, no shared-memory segments of the job.
    assert f"{PREFIX}-node" not in _namespaces()
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{SUBNET}.1_29500_*"))


def test_refuses_without_root(multinode, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/sbin/{name}")  # as if `ip` and `tc` were there
    assert multinode.main(["--out", str(tmp_path / "mn")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("multinode: ") and "root" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "mn").exists()


def test_help_and_bad_options(multinode):
    res = subprocess.run([sys.executable, *TOOL, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0 and "--no_ssh" in res.stdout and "--steps" in res.stdout
    for argv in (["--steps", "0"], ["--prefix", "much-too-long-prefix"], ["--subnet", "10.1"]):
        with pytest.raises(SystemExit) as exc:
            multinode.parse_args(argv)
        assert exc.value.code == 2
