"""The DeepSpeed internals hippie-ds relies on (``hippie_ds._compat.SEAMS``) exist on the installed
DeepSpeed, the adapter uses no private DeepSpeed name the list leaves out, and ``setup.py`` pins the
range the list allows."""
import re
from pathlib import Path

import deepspeed

from hippie_ds import _compat

ROOT = Path(__file__).resolve().parents[1]
DS = Path(deepspeed.__file__).parent
# DeepSpeed sources whose private names the adapter may reach (the SEAMS modules, and ZeRO's optimizer)
DS_SOURCES = [DS / "runtime" / "engine.py", DS / "runtime" / "pipe" / "engine.py", DS / "runtime" / "pipe" / "module.py",
              DS / "runtime" / "pipe" / "p2p.py", DS / "runtime" / "bf16_optimizer.py",
              DS / "runtime" / "zero" / "stage_1_and_2.py"]


def _defined_in_deepspeed() -> set[str]:
    names = set()
    for path in DS_SOURCES:
        text = path.read_text()
        names |= set(re.findall(r"def (_[A-Za-z]\w*)", text))
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=", text))
        names |= set(re.findall(r"^\s*(_[A-Za-z]\w*)\s*=", text, re.M))
    return names


def _used_by_hippie() -> set[str]:
    used = set()
    for path in [*ROOT.glob("hippie_ds/adapter/*.py"), *ROOT.glob("hippie_ds/*.py")]:
        used |= set(re.findall(r"\.(_[A-Za-z]\w*)", path.read_text()))
    return used


# tools/ reaches DeepSpeed through the adapter (timeline.time_stock_handlers rebinds the stock map for the
# bench); what it still touches itself, with why
TOOLS_ALLOWED = {"_topo": "tools/bench/workers/bench_worker.py reads a module's topology for its report"}


def test_tools_touch_no_private_deepspeed_name():
    used = set()
    for path in ROOT.glob("tools/**/*.py"):
        used |= set(re.findall(r"\.(_[A-Za-z]\w*)", path.read_text()))
    touched = sorted((used & _defined_in_deepspeed()) - set(TOOLS_ALLOWED))
    assert touched == [], f"tools/ touches DeepSpeed internals itself; go through hippie_ds.adapter: {touched}"


def test_every_seam_exists_on_the_installed_deepspeed():
    assert _compat.missing_seams() == []


def test_the_adapter_uses_no_private_deepspeed_name_outside_the_seams():
    listed = {n for owners in _compat.SEAMS.values() for names in owners.values() for n in names}
    unlisted = sorted((_used_by_hippie() & _defined_in_deepspeed()) - listed)
    assert unlisted == [], f"add these DeepSpeed internals to hippie_ds/_compat.py SEAMS (or stop using them): {unlisted}"


def test_a_missing_seam_is_reported():
    _compat.SEAMS["deepspeed.runtime.pipe.engine"]["PipelineEngine"] += ("_no_such_internal",)
    try:
        assert _compat.missing_seams() == ["deepspeed.runtime.pipe.engine.PipelineEngine._no_such_internal"]
    finally:
        _compat.SEAMS["deepspeed.runtime.pipe.engine"]["PipelineEngine"] = \
            _compat.SEAMS["deepspeed.runtime.pipe.engine"]["PipelineEngine"][:-1]


def test_setup_pins_the_range_the_seams_allow():
    setup = (ROOT / "setup.py").read_text()
    assert f'"{_compat.REQUIREMENT}"' in setup
    lo, hi = _compat.SUPPORTED_DEEPSPEED
    assert _compat.REQUIREMENT == f"deepspeed>={lo[0]}.{lo[1]}.{lo[2]},<{hi[0]}.{hi[1]}"
    _compat.check_deepspeed_version(deepspeed.__version__)


def test_every_seam_is_used():
    """A SEAMS entry is a DeepSpeed internal hippie-ds reaches (as ``.name``, or a string of the name
    given to getattr/setattr); one nothing uses only narrows the supported range for nothing."""
    text = "\n".join(p.read_text() for p in [*ROOT.glob("hippie_ds/**/*.py"), *ROOT.glob("tools/**/*.py")]
                     if p.name != "_compat.py")
    unused = sorted(f"{module}.{owner + '.' if owner else ''}{name}" for module, owners in _compat.SEAMS.items()
                    for owner, names in owners.items() for name in names
                    if not re.search(rf"\.{re.escape(name)}\b|[\"']{re.escape(name)}[\"']|def {re.escape(name)}\(", text))
    assert unused == [], f"hippie_ds/_compat.py SEAMS lists internals nothing uses: {unused}"
    named = sorted(name for owners in _compat.RELIED_ON.values() for names in owners.values() for name in names
                   if re.search(rf"\.{re.escape(name)}\b", text))
    assert named == [], f"RELIED_ON lists internals hippie-ds names: move them to SEAMS: {named}"
