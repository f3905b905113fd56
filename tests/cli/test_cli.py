"""The ``hippie-ds`` command line: in-process through ``main(argv)``, and once through the
installed console script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import run
from hippie_ds.schedules import available

SHAPE = ("--stages", "4", "--micro-batches", "8")


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("hippie-ds 0.1.0")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["schedule"],
        ["schedule", "list", "--help"],
        ["schedule", "show", "--help"],
        ["schedule", "validate", "--help"],
        ["schedule", "simulate", "--help"],
        ["schedule", "trace", "--help"],
    ],
)
def test_help(capsys, argv):
    code, out, err = run(capsys, *argv, "--help")
    assert code == 0
    assert "usage: hippie-ds" in out
    assert len(out.splitlines()) > 5


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: hippie-ds" in err


def test_list(capsys):
    code, out, _ = run(capsys, "schedule", "list")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert (
        names
        == available()
        == [
            "1f1b",
            "2bw",
            "gpipe",
            "hippie",
            "hippie-1f1b",
            "hippie-interleaved",
            "hippie-zb",
            "interleaved-1f1b",
            "pipedream",
            "zb-h1",
            "zb-v",
        ]
    )
    assert "deferred_stages=auto" in out
    assert "GPipe: every stage runs all forwards" in out


def test_list_long(capsys):
    code, out, _ = run(capsys, "schedule", "list", "--long")
    assert code == 0
    assert "param deferred_stages (stage_list, default auto)" in out
    assert "W(t+1) = W(t) - lr * g(W(t-1))" in out


def test_show(capsys):
    code, out, err = run(capsys, "schedule", "show", "hippie", *SHAPE, "--stage", "3")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("schedule hippie: 4 stages, 8 micro-batches")
    assert "deferred_stages': [0, 1]" in lines[0]  # 'auto' without costs: the first half
    assert lines[1] == "stage 3 (2 buffers):"
    assert "forward_backward(mb=0, buf=0)  send_grad(mb=0, buf=0, nonblocking)" in out
    assert not any(line.startswith("stage 0") for line in lines)


def test_show_params(capsys):
    code, out, _ = run(capsys, "schedule", "show", "hippie-1f1b", *SHAPE, "--param", "deferred_stages=0,2")
    assert code == 0
    assert "'deferred_stages': [0, 2]" in out.splitlines()[0]
    code, out, _ = run(capsys, "schedule", "show", "hippie", *SHAPE, "-p", "deferred_stages=none")
    assert code == 0 and "'deferred_stages': []" in out.splitlines()[0]
    code, out, _ = run(capsys, "schedule", "show", "hippie", *SHAPE, "-p", "deferred_stages=3")
    assert code == 0 and "'deferred_stages': [3]" in out.splitlines()[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--param", "deferred_stages=7"], ["deferred_stages", "out of range", "0..3"]),
        (["--param", "nosuch=1"], ["no parameter nosuch", "deferred_stages"]),
        (["--param", "deferred_stages"], ["key=value"]),
        (["--param", "deferred_stages=a,b"], ["deferred_stages=a,b", "stage"]),
        (["--stage", "4"], ["--stage 4", "0..3"]),
    ],
)
def test_show_bad_arguments(capsys, argv, words):
    code, out, err = run(capsys, "schedule", "show", "hippie", *SHAPE, *argv)
    assert code == 2
    assert err.startswith("hippie-ds: error: ") and "Traceback" not in err
    for word in words:
        assert word in err


def test_unknown_schedule(capsys):
    code, _, err = run(capsys, "schedule", "show", "no-such-schedule", *SHAPE)
    assert code == 2
    assert "unknown schedule 'no-such-schedule'" in err and ", ".join(available()) in err


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--stages", "0", "--micro-batches", "8"], "--stages"),
        (["--stages", "4", "--micro-batches", "-1"], "--micro-batches"),
        (["--stages", "two", "--micro-batches", "8"], "--stages"),
    ],
)
def test_bad_counts(capsys, argv, field):
    for sub in ("show", "validate", "simulate"):
        code, _, err = run(capsys, "schedule", sub, "hippie", *argv)
        assert code == 2
        assert f"argument {field}" in err
        assert "Traceback" not in err


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "hippie", "hippie-1f1b"])
def test_validate_builtins(capsys, name):
    code, out, err = run(capsys, "schedule", "validate", name, *SHAPE)
    assert code == 0, out + err
    assert out.startswith(f"OK: schedule '{name}' (4 stages x 8 micro-batches)")
    assert "steps" in out and "pipeline buffers per stage" in out


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_validate_bad_yaml(capsys, tmp_path):
    path = _write(tmp_path, "broken.yaml", "name: broken\ncompute:\n  - op: forward\n    at: [stage + mb\n")
    code, out, _ = run(capsys, "schedule", "validate", path, *SHAPE)
    assert code == 1
    assert out.startswith("INVALID")
    assert f"{path}:5: not valid YAML" in out


def test_validate_unknown_op(capsys, tmp_path):
    path = _write(
        tmp_path,
        "badop.yaml",
        "name: badop\ncompute:\n  - {op: forward, at: stage + mb}\nepilogue:\n  - {op: allreduce_everything}\n",
    )
    code, out, _ = run(capsys, "schedule", "validate", path, *SHAPE)
    assert code == 1
    assert f"{path}:5: field epilogue.0.op" in out
    assert "unknown op 'allreduce_everything'" in out and "reduce_grads" in out


def test_validate_bad_expression(capsys, tmp_path):
    path = _write(
        tmp_path,
        "badexpr.yaml",
        "name: badexpr\ncompute:\n  - op: forward\n    at: stage + mb\n"
        "  - op: backward\n    at: __import__('os').getpid()\n",
    )
    code, out, _ = run(capsys, "schedule", "validate", path, *SHAPE)
    assert code == 1
    assert f"{path}:6: field compute.1.at" in out
    assert "not allowed" in out or "only abs, len, max, min, range" in out


def test_validate_expression_with_unknown_name(capsys, tmp_path):
    path = _write(tmp_path, "badname.yaml", "name: badname\ncompute:\n  - {op: forward, at: stage + mbs}\n")
    code, out, _ = run(capsys, "schedule", "validate", path, *SHAPE)
    assert code == 1
    assert "unknown name 'mbs'" in out and "compute[0]" in out


def test_validate_reports_problems(capsys, tmp_path):
    # GPipe's compute, but no optimizer step: the gradients are never applied.
    path = _write(
        tmp_path,
        "noupdate.yaml",
        "name: noupdate\ncompute:\n  - {op: forward, at: stage + mb}\n"
        "  - op: backward\n    at: micro_batches + 2 * stages - 2 - stage + mb\n"
        "epilogue:\n  - {op: reduce_grads, at: end}\n",
    )
    code, out, _ = run(capsys, "schedule", "validate", path, *SHAPE)
    assert code == 1
    assert out.startswith("INVALID: schedule 'noupdate' (4 stages x 8 micro-batches):")
    problems = [line for line in out.splitlines() if line.startswith("  - ")]
    assert len(problems) >= 1
    assert any("stage 0" in p for p in problems)


def test_validate_missing_file_is_usage_error(capsys, tmp_path):
    code, _, err = run(capsys, "schedule", "validate", str(tmp_path / "nope.yaml"), *SHAPE)
    assert code == 2 and "does not exist" in err


def test_show_broken_file_is_usage_error(capsys, tmp_path):
    path = _write(tmp_path, "broken.yaml", "name: broken\ncompute: [\n")
    code, out, err = run(capsys, "schedule", "show", path, *SHAPE)
    assert code == 2 and out == ""
    assert "not valid YAML" in err and "Traceback" not in err


COSTS = (
    "--forward",
    "1",
    "--backward",
    "2",
    "--param-bytes",
    "100e6",
    "--data-parallel",
    "2",
    "--allreduce-bandwidth",
    "125e6",
)


def test_simulate_json(capsys):
    code, out, err = run(capsys, "schedule", "simulate", "hippie", *SHAPE, *COSTS, "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("schedule", "stages", "micro_batches", "step_time", "bubble_fraction", "throughput", "per_stage"):
        assert key in data, key
    assert "events" not in data
    assert data["schedule"] == "hippie" and data["stages"] == 4 and data["micro_batches"] == 8
    assert len(data["per_stage"]) == 4
    assert data["step_time"] > 0 and 0 <= data["bubble_fraction"] < 1 and data["throughput"] > 0


def test_simulate_json_several(capsys):
    code, out, err = run(capsys, "schedule", "simulate", "1f1b", "gpipe", *SHAPE, "--json", "--iterations", "2")
    assert code == 0, err
    data = json.loads(out)
    assert [d["schedule"] for d in data] == ["1f1b", "gpipe"]


def test_simulate_table_compares(capsys):
    code, out, err = run(
        capsys, "schedule", "simulate", "1f1b", "gpipe", "hippie", *SHAPE, *COSTS, "--param", "deferred_stages=auto"
    )
    assert code == 0, err
    for word in (
        "busy",
        "idle",
        "exposed comm",
        "peak act",
        "grad buffer",
        "step time",
        "bubble",
        "throughput",
        "vs 1f1b",
    ):
        assert word in out, word
    comparison = out.strip().splitlines()[-3:]
    assert [line.split()[0] for line in comparison] == ["1f1b", "gpipe", "hippie"]
    assert comparison[0].split()[2] == "1.000x"


def test_simulate_per_stage_lists_and_units(capsys):
    code, out, err = run(
        capsys,
        "schedule",
        "simulate",
        "1f1b",
        *SHAPE,
        "--forward",
        "10ms,10ms,10ms,20ms",
        "--backward",
        "0.02",
        "--activation-bytes",
        "4MB",
        "--p2p-bandwidth",
        "inf",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["step_time"] > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--forward", "1,2"], ["--forward", "2 values for 4 stages"]),
        (["--backward", "fast"], ["--backward 'fast'", "not a number"]),
        (["--param-bytes", "-5"], ["--param-bytes", "negative"]),
        (["--allreduce-bandwidth", "0"], ["allreduce_bandwidth"]),
        (["--costs", "/nonexistent/costs.yaml"], ["/nonexistent/costs.yaml"]),
        (["--param", "nosuch=1"], ["nosuch"]),
    ],
)
def test_simulate_bad_costs(capsys, argv, words):
    code, out, err = run(capsys, "schedule", "simulate", "hippie", *SHAPE, *argv)
    assert code == 2, out
    assert err.startswith("hippie-ds: error:") and "Traceback" not in err
    for word in words:
        assert word in err


def test_simulate_costs_file(capsys, tmp_path):
    path = _write(
        tmp_path,
        "costs.yaml",
        "stages: {forward: 1.0, backward: 2.0, param_bytes: 1.0e8}\n"
        "comm: {data_parallel: 2, allreduce_bandwidth: 1.25e8}\n",
    )
    code, out, err = run(capsys, "schedule", "simulate", "gpipe", *SHAPE, "--costs", path, "--json")
    assert code == 0, err
    from_file = json.loads(out)["step_time"]
    code, out, err = run(capsys, "schedule", "simulate", "gpipe", *SHAPE, *COSTS, "--json")
    assert code == 0, err
    assert json.loads(out)["step_time"] == pytest.approx(from_file)
    # an option beside the file overrides it
    code, out, err = run(capsys, "schedule", "simulate", "gpipe", *SHAPE, "--costs", path, "--forward", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["step_time"] > from_file


def test_trace_writes_json_and_png(capsys, tmp_path):
    out_json = tmp_path / "sub" / "hippie.json"
    code, out, err = run(capsys, "schedule", "trace", "hippie", *SHAPE, *COSTS, "--out", str(out_json))
    assert code == 0, err
    trace = json.loads(out_json.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert len(events) > 0
    png = out_json.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out_json) in out and str(png) in out


def test_trace_png_option(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "schedule",
        "trace",
        "1f1b",
        "--stages",
        "2",
        "--micro-batches",
        "3",
        "--out",
        str(tmp_path / "t.json"),
        "--png",
        str(tmp_path / "pic.png"),
    )
    assert code == 0, err
    assert (tmp_path / "t.json").is_file() and (tmp_path / "pic.png").is_file()
    assert not (tmp_path / "t.png").exists()


def _console_script() -> Path:
    script = Path(sys.executable).parent / "hippie-ds"
    if not script.exists():
        pytest.skip("the hippie-ds console script is not installed in this environment (run `make venv`)")
    return script


def test_console_script(tmp_path):
    script = _console_script()
    done = subprocess.run([str(script), "schedule", "list"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hippie-1f1b" in done.stdout
    done = subprocess.run(
        [str(script), "schedule", "validate", "hippie", "--stages", "0", "--micro-batches", "8"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--stages" in done.stderr and "Traceback" not in done.stderr
