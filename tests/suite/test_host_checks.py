"""The suite's host checks (tests/host_checks.py), pure: what they refuse and what they remove."""

import os
import time

import host_checks


def test_shm_room_is_refused_with_the_figures_when_short(tmp_path):
    assert host_checks.shm_problem(str(tmp_path), needed=1) is None
    problem = host_checks.shm_problem(str(tmp_path), needed=2**62)
    assert "MiB free" in problem and "66 MiB a local rank" in problem
    assert "is not there" in host_checks.shm_problem(str(tmp_path / "missing"))


def test_only_a_stale_build_lock_is_removed(tmp_path):
    for op in ("fresh_op", "stale_op"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").write_text("")
    old = time.time() - host_checks.STALE_LOCK_S - 60
    os.utime(tmp_path / "stale_op" / "lock", (old, old))
    assert host_checks.remove_stale_locks(str(tmp_path)) == [str(tmp_path / "stale_op" / "lock")]
    assert (tmp_path / "fresh_op" / "lock").exists() and not (tmp_path / "stale_op" / "lock").exists()


def test_the_pytest_process_builds_where_the_ranks_build_with_the_venvs_ninja():
    from tools.bench.cluster.processes import local_env

    env = local_env()
    assert env["TORCH_EXTENSIONS_DIR"] == os.environ["TORCH_EXTENSIONS_DIR"]
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(__import__("sys").executable)
    assert os.path.dirname(__import__("sys").executable) in os.environ["PATH"].split(os.pathsep)
