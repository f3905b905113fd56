"""Test markers. ``distributed``: the test launches real ranks (the ``deepspeed`` launcher, gloo,
several processes); everything else is single-process and fast. ``make test`` runs both;
``make test-unit`` (``pytest -m "not distributed"``) the fast half alone.

``fp16``: the test (or the launch its fixture shares) builds fp16 engines. DeepSpeed's CPU
accelerator refuses fp16 where oneDNN has no fp16 kernels (AMD EPYC), though torch computes it:
there the suite turns on the test-only switch of tests/fp16_switch for itself and every process it
starts, stock reference and hippie-ds alike; where torch cannot compute fp16 at all, the fp16 tests
skip with the reason. The end of the run says which, and how many fp16 tests ran and skipped.

Also the planner tests' shared fixtures: the vendored PipeDream profiles and a plan of VGG-16."""

import platform
from pathlib import Path

import pytest

import fp16_switch
import host_checks
from planner_fixtures import PROFILES, V100_CLUSTER

FP16 = {}  # the switch's decision, set once in pytest_configure


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: launches real ranks (deepspeed launcher, gloo, processes)")
    config.addinivalue_line("markers", "fp16: builds fp16 engines (itself or in its fixture's launch)")
    host_checks.environment()
    decision = fp16_switch.decide()
    if decision.switch:
        fp16_switch.switch_on_for_children()
    FP16["decision"] = decision


def pytest_collection_modifyitems(config, items):
    decision = FP16["decision"]
    if any(item.get_closest_marker("distributed") for item in items) and not config.option.collectonly:
        _prepare_host_for_ranks(config)
    for item in items:
        callspec = getattr(item, "callspec", None)  # an fp16 file (test_fp16_*.py) or an fp16 parameter
        if (
            "fp16" in item.path.name or (callspec is not None and "fp16" in callspec.id.lower())
        ) and item.get_closest_marker("fp16") is None:
            item.add_marker(pytest.mark.fp16)
        if decision.skip and item.get_closest_marker("fp16") is not None:
            item.add_marker(pytest.mark.skip(reason=f"fp16: {decision.skip}"))


def _prepare_host_for_ranks(config):
    """Before the first launch: /dev/shm room, no stale build lock, DeepSpeed's CPU ops built."""
    problem = host_checks.shm_problem()
    if problem:
        pytest.exit(f"the distributed tests cannot run here: {problem}", returncode=3)
    removed = host_checks.remove_stale_locks()
    try:
        lines = host_checks.build_ops()
    except Exception as e:  # no compiler, no ninja: every rank would fail the same way later
        pytest.exit(
            f"DeepSpeed's CPU ops do not build here ({type(e).__name__}: {e}); the distributed tests "
            f"need ninja and g++",
            returncode=3,
        )
    report = config.pluginmanager.get_plugin("terminalreporter")
    if report is not None:
        for lock in removed:
            report.write_line(f"removed a stale build lock: {lock}")
        report.write_line("DeepSpeed's CPU ops: " + "; ".join(lines))


def pytest_terminal_summary(terminalreporter):
    decision = FP16.get("decision")
    if decision is None:
        return
    counts = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            # a passed test's report is its call's; a skip or an error of its setup is the setup's
            if "fp16" in getattr(report, "keywords", {}) and report.when in ("call", "setup"):
                counts[outcome] = counts.get(outcome, 0) + 1
    how = (
        "DeepSpeed's CPU accelerator accepts fp16 here"
        if decision.deepspeed_accepts
        else "DeepSpeed's CPU accelerator refuses fp16 here (oneDNN has no fp16 kernels); the tests' switch "
        "(tests/fp16_switch) let it accept fp16, for stock and hippie-ds alike"
        if decision.switch
        else f"fp16 cannot run here: {decision.skip}"
    )
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "none in this run"
    terminalreporter.write_line(f"fp16 tests on {_cpu_model()}: {summary}. {how}.")


@pytest.fixture(scope="module")
def vgg():
    from hippie_ds.planner import read_pipedream

    return read_pipedream(PROFILES / "vgg16.txt")


@pytest.fixture(scope="module")
def gnmt():
    from hippie_ds.planner import read_pipedream

    return read_pipedream(PROFILES / "gnmt.txt")


@pytest.fixture(scope="module")
def vgg_plan(vgg):
    from hippie_ds.planner import make_plan, parse_cluster

    return make_plan(vgg, parse_cluster(V100_CLUSTER), 2048)
