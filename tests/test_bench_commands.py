"""The bench's subcommands (``tools/bench.py NAME``, benchmarks/commands.py): every one imports and
answers ``--help``, and ``tools/bench.py --help`` lists them all. Pure: ``--help`` runs nothing."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.commands import COMMANDS, run_command, usage

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_imports_and_answers_help(name, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_command sets sys.argv
    module = importlib.import_module(COMMANDS[name][0])
    assert callable(module.main)
    with pytest.raises(SystemExit) as exc:
        run_command(name, ["--help"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tools/bench.py {name}"), out[:200]


def test_usage_names_every_subcommand():
    text = usage()
    for name, (_, line) in COMMANDS.items():
        assert f"  {name} " in text and line in text


def test_bench_help_lists_every_subcommand():
    res = subprocess.run([sys.executable, str(TOOLS / "bench.py"), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    missing = [name for name in COMMANDS if f"  {name} " not in res.stdout]
    assert not missing, f"tools/bench.py --help does not list {missing}"


def test_tools_holds_only_entry_points():
    """tools/ shows a newcomer its entry points: the studies are bench.py's subcommands, the rank
    workers launched by the tools are in tools/workers/ (bench_worker.py among them)."""
    scripts = sorted(p.name for p in TOOLS.glob("*.py"))
    assert scripts == ["bench.py", "convergence.py", "labels.py", "multinode.py", "soak.py",
                       "train_gpt.py", "train_vgg.py"]
