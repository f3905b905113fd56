"""The bench's subcommands (``python -m tools.bench NAME``, tools/bench/commands.py): every one imports and
answers ``--help``, and ``python -m tools.bench --help`` lists them all. Pure: ``--help`` runs nothing."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.commands import COMMANDS, run_command, usage

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_imports_and_answers_help(name, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_command sets sys.argv
    module = importlib.import_module(COMMANDS[name][0])
    assert callable(module.main)
    with pytest.raises(SystemExit) as exc:
        run_command(name, ["--help"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m tools.bench {name}"), out[:200]


def test_usage_names_every_subcommand():
    text = usage()
    for name, (_, line) in COMMANDS.items():
        assert f"  {name} " in text and line in text


def test_bench_help_lists_every_subcommand():
    res = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    missing = [name for name in COMMANDS if f"  {name} " not in res.stdout]
    assert not missing, f"python -m tools.bench --help does not list {missing}"


def test_tools_holds_the_examples_and_the_bench():
    """tools/ shows a newcomer two things: the user examples (their two training scripts, run by path
    under the ``deepspeed`` launcher) and the bench, one package with one entry point, ``python -m
    tools.bench [NAME]``: none of its modules is a script of its own (the rank workers, started by
    path by the bench's jobs, live in tools/bench/workers/; the fork launcher is run as a module)."""
    tools = REPO / "tools"
    assert sorted(p.name for p in tools.iterdir() if p.name != "__pycache__") == ["__init__.py", "bench", "examples"]
    scripts = {
        p.relative_to(tools).as_posix() for p in tools.rglob("*.py") if 'if __name__ == "__main__"' in p.read_text()
    }
    workers = {p.relative_to(tools).as_posix() for p in (tools / "bench" / "workers").glob("*_worker.py")}
    assert scripts - workers == {"examples/train_gpt.py", "examples/train_vgg.py", "bench/cluster/fork_ranks.py"}
    assert "bench_worker.py" in {p.rsplit("/", 1)[1] for p in workers}
