"""``hippie-ds profile``'s errors from the target's own code: a target module or layer that raises on import,
at build or in forward is reported as the user's error (their file and line), exit code 2."""

import sys
from pathlib import Path

import pytest

from cli_run import run


# ------------------------------------------------------------------ profile: errors from the target's code
HIPPIE_DIR = Path(__file__).resolve().parents[2] / "hippie_ds"

TARGET = """\
import torch


def width():
    raise ValueError("bad width")


def build():
    return [torch.nn.Linear(width(), 2)], torch.zeros(2, 4)


class Boom(torch.nn.Module):
    def forward(self, x):
        return self.explode(x)

    def explode(self, x):
        raise RuntimeError("boom in forward")


class BadInit(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        raise TypeError(f"cannot make {n}")


def forward_raises():
    return [torch.nn.Linear(4, 4), Boom()], torch.zeros(2, 4)


def init_raises():
    from deepspeed.pipe import LayerSpec
    return [torch.nn.Linear(4, 4), LayerSpec(BadInit, 3)], torch.zeros(2, 4)
"""


def _profile_target(capsys, tmp_path, target, *extra):
    pytest.importorskip("torch")
    return run(capsys, "profile", target, "--out", str(tmp_path / "p.yaml"), "--repeats", "1", "--warmup", "0", *extra)


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _assert_user_report(code, err, head, path, *lines):
    """Exit code 2; the first line is ``head``; the traceback shows the user's file at ``lines``
    and nothing of hippie-ds or the import machinery."""
    assert code == 2, err
    assert err.splitlines()[0] == head, err
    for line in lines:
        assert f'File "{path}", line {line}' in err, err
    assert str(HIPPIE_DIR) not in err and "hippie_ds/" not in err, err
    assert "importlib" not in err and "runpy" not in err, err
    assert err.rstrip().endswith(head.rsplit(" raised ", 1)[1]), err  # ends with the exception itself
    assert not (path.parent / "p.yaml").exists()


def test_profile_target_raises(capsys, tmp_path):
    path = tmp_path / "mymod.py"
    path.write_text(TARGET)
    target = f"{path}:build"
    code, out, err = _profile_target(capsys, tmp_path, target, "--no-progress")
    _assert_user_report(
        code,
        err,
        f"hippie-ds profile: target {target!r} raised ValueError: bad width",
        path,
        _line_of(path, "return [torch.nn.Linear(width(), 2)]"),
        _line_of(path, 'raise ValueError("bad width")'),
    )
    assert out == ""


def test_profile_target_module_raises_on_import(capsys, tmp_path, monkeypatch):
    (tmp_path / "brokenmod.py").write_text("import torch\n\nWIDTH = int('wide')\n\n\ndef build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _profile_target(capsys, tmp_path, "brokenmod:build")
    _assert_user_report(
        code,
        err,
        "hippie-ds profile: target 'brokenmod:build' raised ValueError: invalid literal for int() with base 10: 'wide'",
        tmp_path / "brokenmod.py",
        3,
    )
    assert "brokenmod" not in sys.modules
    # A module that does not exist is still a usage error, in one line.
    code, _, err = _profile_target(capsys, tmp_path, "no_such_module_here:build")
    assert code == 2 and err == (
        "hippie-ds: error: profile target 'no_such_module_here:build': cannot import "
        "'no_such_module_here': No module named 'no_such_module_here'\n"
    )


def test_profile_layer_raises_at_build(capsys, tmp_path):
    pytest.importorskip("deepspeed")
    path = tmp_path / "mymod_init.py"
    path.write_text(TARGET)
    target = f"{path}:init_raises"
    code, _, err = _profile_target(capsys, tmp_path, target, "--no-progress")
    _assert_user_report(
        code,
        err,
        f"hippie-ds profile: target {target!r}: layer 1 (BadInit) build raised TypeError: cannot make 3",
        path,
        _line_of(path, 'raise TypeError(f"cannot make'),
    )
    assert "deepspeed" not in err.split("Traceback", 1)[1]  # LayerSpec.build, which calls it, is not shown


def test_profile_layer_forward_raises(capsys, tmp_path):
    pytest.importorskip("deepspeed")
    path = tmp_path / "mymod_forward.py"
    path.write_text(TARGET)
    target = f"{path}:forward_raises"
    code, _, err = _profile_target(capsys, tmp_path, target, "--no-progress")
    head = f"hippie-ds profile: target {target!r}: layer 1 (Boom) forward raised RuntimeError: boom in forward"
    _assert_user_report(
        code,
        err,
        head,
        path,
        _line_of(path, "return self.explode(x)"),
        _line_of(path, 'raise RuntimeError("boom in forward")'),
    )
    assert "torch/nn/modules" not in err  # the module-call machinery that leads to the user's forward
    # With the progress bar: it is erased, and the report starts where it stood.
    code, _, err = _profile_target(capsys, tmp_path, target)
    assert code == 2
    assert err.split("\n")[0].split("\r")[-1] == head, err
    assert "profile:" in err.split("\n")[0]  # the (tqdm) bar was there
