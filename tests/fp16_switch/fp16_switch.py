"""The tests' fp16 switch: lets DeepSpeed's CPU accelerator accept fp16 on a CPU where it refuses it
only because oneDNN (mkldnn) has no fp16 kernels there (AMD EPYC: ``torch.ops.mkldnn.
_is_mkldnn_fp16_supported()`` is falsy; Intel Xeons with AVX512-FP16/AMX: True). torch computes
fp16 on every x86 CPU; the refusal is DeepSpeed's start-up check (``_do_sanity_check``), not a
missing kernel.

Test-only: nothing under hippie_ds/ or tools/ imports it. The pytest process decides once
(:func:`decide`) and, when the switch is needed, sets :data:`ENV` for every process it starts, so
the stock DeepSpeed reference and hippie-ds get the same accelerator: each fp16 comparison still
compares like with like. ``sitecustomize.py`` beside this file applies it in those processes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ENV = "HIPPIE_TEST_FP16_ON_CPU"  # "1": patch DeepSpeed's CPU accelerator to accept fp16
DIR = Path(__file__).resolve().parent  # put first on PYTHONPATH: its sitecustomize.py applies the switch
ACCELERATOR_MODULE = "deepspeed.accelerator.cpu_accelerator"


@contextlib.contextmanager
def forced_mkldnn(is_mkldnn_fp16_supported=None):
    """Inside: torch's ``torch.ops.mkldnn._is_mkldnn_fp16_supported`` is the callable given (None: torch's own)."""
    import torch

    if is_mkldnn_fp16_supported is None:
        yield
        return
    saved = torch.ops.mkldnn._is_mkldnn_fp16_supported
    torch.ops.mkldnn._is_mkldnn_fp16_supported = is_mkldnn_fp16_supported
    try:
        yield
    finally:
        torch.ops.mkldnn._is_mkldnn_fp16_supported = saved


def accepts_fp16(is_mkldnn_fp16_supported=None) -> bool:
    """What DeepSpeed's CPU accelerator answers, by its own code (``CPU_Accelerator.is_fp16_supported``
    unpatched): the mkldnn answer, taken from torch unless given (a callable, to force it)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    original = getattr(CPU_Accelerator.is_fp16_supported, "__wrapped__", CPU_Accelerator.is_fp16_supported)
    with forced_mkldnn(is_mkldnn_fp16_supported):
        return bool(original(object.__new__(CPU_Accelerator)))


def torch_computes_fp16() -> str | None:
    """None when torch runs the fp16 ops the tests' models use (Linear, Embedding, LayerNorm, GELU,
    softmax, forward and backward) on this CPU; else why not."""
    import torch

    try:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 4).half()
        lin, norm = torch.nn.Linear(4, 4).half(), torch.nn.LayerNorm(4).half()
        x = torch.nn.functional.gelu(norm(lin(emb(torch.tensor([[1, 2, 3]])))))
        loss = torch.softmax(x.float(), -1).sum() + x.sum()
        loss.backward()
        if lin.weight.grad is None or lin.weight.grad.dtype != torch.float16 or x.dtype != torch.float16:
            return "torch's fp16 ops fell back to another dtype on this CPU"
    except Exception as e:  # a missing kernel: RuntimeError "not implemented for 'Half'"
        return f"torch cannot compute fp16 on this CPU: {type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class Decision:
    """How the suite runs fp16 on this machine: ``switch`` on (DeepSpeed would refuse fp16 and torch
    computes it), ``skip`` (a reason: fp16 cannot run at all), or neither (DeepSpeed accepts fp16)."""

    deepspeed_accepts: bool
    switch: bool
    skip: str | None


def decide(is_mkldnn_fp16_supported=None) -> Decision:
    """The switch is on exactly when DeepSpeed's CPU accelerator would refuse fp16 and torch computes
    it; fp16 tests skip when torch cannot compute fp16 at all."""
    accepts = accepts_fp16(is_mkldnn_fp16_supported)
    cannot = torch_computes_fp16()
    return Decision(deepspeed_accepts=accepts, switch=not accepts and cannot is None, skip=cannot)


def _accept_fp16(cls):
    original = cls.is_fp16_supported
    if getattr(original, "__wrapped__", None) is not None:
        return

    def is_fp16_supported(self):
        return True

    is_fp16_supported.__wrapped__ = original
    cls.is_fp16_supported = is_fp16_supported


def apply():
    """Make DeepSpeed's CPU accelerator accept fp16: now if its module is imported, else as soon as
    it is (an import hook, so a process that never imports DeepSpeed pays nothing)."""
    module = sys.modules.get(ACCELERATOR_MODULE)
    if module is not None:
        _accept_fp16(module.CPU_Accelerator)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's CPU accelerator module with the other finders, and patches its class right
    after the module runs (DeepSpeed builds its accelerator while ``import deepspeed`` runs)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != ACCELERATOR_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _accept_fp16(module.CPU_Accelerator)
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]

        spec.loader.exec_module = exec_module
        return spec


def switch_on_for_children():
    """Set the switch for every process started from now on (and apply it here)."""
    os.environ[ENV] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DIR), os.environ.get("PYTHONPATH")]))
    apply()
