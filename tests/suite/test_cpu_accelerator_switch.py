"""The tests' fp16 switch (tests/fp16_switch): on exactly when DeepSpeed's CPU accelerator would refuse
fp16, whatever this machine's CPU answers; applied in the processes the suite starts; never reached
from user code."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fp16_switch

REPO = Path(__file__).resolve().parents[2]


def _raises():
    raise RuntimeError("no mkldnn")


@pytest.mark.parametrize(
    "mkldnn,deepspeed_accepts",
    [(lambda: True, True), (lambda: False, False), (lambda: None, False), (_raises, False)],
    ids=["mkldnn-yes", "mkldnn-no", "mkldnn-none", "mkldnn-raises"],
)
def test_the_switch_is_on_exactly_when_deepspeed_refuses_fp16(mkldnn, deepspeed_accepts):
    """The mkldnn answer forced each way: DeepSpeed's own ``is_fp16_supported`` (unpatched) decides, and
    the switch is its negation where torch computes fp16 (every x86 CPU these machines have)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert fp16_switch.torch_computes_fp16() is None
    decision = fp16_switch.decide(mkldnn)
    assert decision.deepspeed_accepts is deepspeed_accepts
    assert decision.switch is (not deepspeed_accepts)
    assert decision.skip is None
    with fp16_switch.forced_mkldnn(mkldnn):  # the answer DeepSpeed's accelerator gives at its start-up check
        original = getattr(CPU_Accelerator.is_fp16_supported, "__wrapped__", CPU_Accelerator.is_fp16_supported)
        assert bool(original(CPU_Accelerator())) is deepspeed_accepts


def test_fp16_tests_skip_where_torch_cannot_compute_fp16(monkeypatch):
    monkeypatch.setattr(fp16_switch, "torch_computes_fp16", lambda: "torch cannot compute fp16 on this CPU")
    decision = fp16_switch.decide(lambda: None)
    assert not decision.switch and decision.skip == "torch cannot compute fp16 on this CPU"


def _accelerator_in_a_fresh_process(env):
    code = (
        "from deepspeed.accelerator import get_accelerator; import torch; a = get_accelerator(); "
        "print(a.device_name(), bool(a.is_fp16_supported()), torch.float16 in a.supported_dtypes())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()[-3:]


def test_a_process_the_suite_starts_gets_the_switch_and_a_plain_one_does_not():
    base = {k: v for k, v in os.environ.items() if k not in (fp16_switch.ENV, "PYTHONPATH")}
    base["DS_ACCELERATOR"] = "cpu"
    plain = _accelerator_in_a_fresh_process(base)
    assert plain == ["cpu", str(fp16_switch.accepts_fp16()), str(fp16_switch.accepts_fp16())]
    switched = dict(base, **{fp16_switch.ENV: "1", "PYTHONPATH": str(fp16_switch.DIR)})
    assert _accelerator_in_a_fresh_process(switched) == ["cpu", "True", "True"]
    # the suite's own processes: on where (and only where) this machine's DeepSpeed refuses fp16
    assert (os.environ.get(fp16_switch.ENV) == "1") is fp16_switch.decide().switch


def test_user_code_never_reaches_the_switch():
    for folder in ("hippie_ds", "tools", "configs", "schedules"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".json", ".yaml", ".cfg", ".txt"):
                text = path.read_text(errors="replace")
                assert "fp16_switch" not in text and fp16_switch.ENV not in text, path
