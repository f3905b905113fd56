"""``hippie-ds profile``: measure a ``PipelineModule`` layer list, layer by layer, into a profile.

The target is ``module:function`` (or ``path/to/file.py:function``); the function returns
``(layers, sample)`` or a mapping with ``layers``, ``sample`` and optionally ``name``,
``loss_fn`` and ``labels``: ``layers`` is the list given to ``PipelineModule`` (``LayerSpec``,
``TiedLayerSpec``, modules, callables), ``sample`` one micro-batch of the first layer's input
(its first dimension is the micro-batch size), ``loss_fn`` the ``PipelineModule``'s
``loss_fn(outputs, labels)`` and ``labels`` one micro-batch of its labels (both or neither).

Each layer runs on the output of the one before, as a pipeline stage would receive it (a
detached tensor that requires grad when it is floating point). Per layer:

* ``forward`` / ``backward``: medians over ``repeats`` runs after ``warmup`` runs; backward is
  ``torch.autograd.backward`` of the layer's output with a gradient of ones; ``spread``: the runs'
  inter-quartile range over the median. Layers that are the same work (same class, parameter
  shapes and input shape) form a group: their runs are pooled and they share the pooled medians
  (``groups``, ``own_ratio``: :mod:`hippie_ds.planner.noise`); identical layers that part by more
  than 25% make the CLI warn that the profile is noisy. ``load``: the machine's load average and
  this process's CPU over wall time while measuring;
* ``backward_weight`` and ``split_extra``: the split backward of the zero-bubble schedules as the
  engine runs it: the engine's own I and W (:mod:`hippie_ds.adapter.gradients.split_backward`:
  I one ``autograd.grad`` towards the layer's floating-point inputs that require grad, keeping
  the gradients at its parameter ops; W one ``autograd.grad`` per parameter group) are timed on
  the layer (medians); ``backward_weight`` is W (at most the backward), ``split_extra`` what I + W
  cost beyond the whole backward (at least 0: two autograd passes instead of one), so the planner
  charges I = backward - W + split_extra. A layer without parameters has W = 0 and no extra; one
  whose inputs need no gradient (an embedding of token ids) runs its whole backward as W, as the
  engine's split does, and has no extra either;
* ``recompute``: re-computation re-runs the forward with autograd recording, so the forward
  time (what a reentrant checkpoint adds to the backward);
* ``output_bytes``: the bytes of the output tensors (what crosses a cut after the layer);
* ``saved_bytes``: the distinct storages autograd saves for backward during the layer's
  forward (saved-tensor hooks), attributed to the layer that produced them: the layer's
  input is the previous layer's (not counted again), parameters are not activations, and its
  output counts when this layer or the one consuming it saves it (``output_saved``; through
  layers whose output is a view of their input, a flatten's, the first that is not). Summed over a stage
  (plus its input, and its output when no layer saves it) this is what the stage keeps per
  in-flight micro-batch (``hippie_ds.planner.recompute``);
* ``param_bytes``: its parameters' bytes (a tied module at its first use only);
* ``working_bytes``: on CUDA the allocator's peak over one forward+backward less what the layer
  keeps (:mod:`hippie_ds.adapter.profiling.layer_timing`); on the CPU none (the planner estimates it).

With a ``loss_fn`` the loss is measured the same way on the last layer's output and the labels,
as the profile's ``loss`` entry (not a layer: the layer list and the fingerprint stay the
model's). The profile records ``param_dtype``, the dtype of the built layers' parameters.

Layer names are :func:`hippie_ds.adapter.module.pipeline_module.layer_names`, so a plan made from the profile
recognises the model (``Profile.fingerprint``).

What the target's own code raises (importing its module, calling its function, building a layer,
a layer's forward or backward) comes out as :class:`TargetError`, the exception as its
``__cause__``; ``hippie-ds profile`` reports it with the target's frames only. A target that is
not usable (no such module, file or function, a wrong return value) is a ``ProfileError``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

import torch

from .adapter.profiling.layer_timing import (
    as_stage_input,
    attribute_saved,
    loadavg,
    measure_layer,
    nbytes,
    param_dtype,
    work_key,
)
from .adapter.profiling.memory import _tensors
from .planner.noise import pool
from .planner.profile import LayerProfile, Profile, ProfileError
from .planner.profile_fields import MeasuredLoad
from .adapter.module.tensor_calls import tensor_bytes


class TargetError(Exception):
    """The profile target's own code raised: importing its module, calling its function, or building,
    running or back-propagating one of its layers. The exception is ``__cause__``; ``where`` says
    which layer and phase ("" for the module and the function)."""

    def __init__(self, where: str = ""):
        super().__init__(where or "the profile target raised")
        self.where = where


def _guard(fn: Callable, where: str) -> Callable:
    """``fn`` whose exceptions come out as :class:`TargetError` (``where``), the exception its cause."""

    def call(*args):
        try:
            return fn(*args)
        except Exception as exc:
            raise TargetError(where) from exc

    return call


def load_target(target: str) -> tuple[list, Any, str]:
    """(layers, sample, name) from ``module:function`` or ``file.py:function``."""
    got = load_target_spec(target)
    return got["layers"], got["sample"], got["name"]


def load_target_spec(target: str) -> dict[str, Any]:
    """The target's ``layers``, ``sample``, ``name``, ``loss_fn`` and ``labels`` (the last two
    None when it gives no loss)."""
    if ":" not in target:
        raise ProfileError(f"profile target {target!r}: expected module:function or path/to/file.py:function")
    where, func_name = target.rsplit(":", 1)
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise ProfileError(f"profile target {target!r}: no file {where}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ProfileError(f"profile target {target!r}: {where} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        registered = sys.modules.setdefault(path.stem, module) is module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            if registered:
                del sys.modules[path.stem]
            raise TargetError() from exc
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name and (where == exc.name or where.startswith(exc.name + ".")):
                raise ProfileError(f"profile target {target!r}: cannot import {where!r}: {exc}") from None
            raise TargetError() from exc  # the module itself imports something missing
        except Exception as exc:
            raise TargetError() from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ProfileError(f"profile target {target!r}: {where} has no function {func_name!r}")
    result = _guard(fn, "")()
    loss_fn = labels = None
    if isinstance(result, dict):
        layers, sample, name = result.get("layers"), result.get("sample"), result.get("name")
        loss_fn, labels = result.get("loss_fn"), result.get("labels")
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        (layers, sample), name = result, None
    else:
        raise ProfileError(
            f"profile target {target!r}: {func_name}() must return (layers, sample) or a dict "
            f"with 'layers' and 'sample'; got {type(result).__name__}"
        )
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ProfileError(f"profile target {target!r}: 'layers' must be a non-empty list of layer specs")
    if not any(True for _ in _tensors(sample)):
        raise ProfileError(f"profile target {target!r}: 'sample' must be a tensor or a tuple of tensors")
    if (loss_fn is None) != (labels is None) or (loss_fn is not None and not callable(loss_fn)):
        raise ProfileError(
            f"profile target {target!r}: 'loss_fn' (a callable loss_fn(outputs, labels)) and "
            f"'labels' (one micro-batch of labels) come together; got loss_fn={loss_fn!r}, labels "
            f"{'given' if labels is not None else 'missing'}"
        )
    return dict(layers=list(layers), sample=sample, name=name or f"{where}:{func_name}", loss_fn=loss_fn, labels=labels)


def build_layers(layers: Sequence[Any]) -> tuple[list[Callable], list[list[torch.nn.Parameter]]]:
    """Callables for the layer list, as ``PipelineModule._build`` makes them (tied modules are
    built once per key), and the parameters each layer owns (tied: at first use). A layer whose
    constructor raises is a :class:`TargetError`."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from .adapter.module.pipeline_module import layer_name

    funcs, params, tied = [], [], {}
    for layer in layers:
        build = _guard(lambda spec: spec.build(), f"layer {len(funcs)} ({layer_name(layer)}) build")
        if isinstance(layer, TiedLayerSpec):
            first = layer.key not in tied
            if first:
                tied[layer.key] = build(layer)
            module = tied[layer.key]
            funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            params.append(list(module.parameters()) if first else [])
        elif isinstance(layer, LayerSpec):
            module = build(layer)
            funcs.append(module)
            params.append(list(module.parameters()))
        elif isinstance(layer, torch.nn.Module):
            funcs.append(layer)
            params.append(list(layer.parameters()))
        elif callable(layer):
            funcs.append(layer)
            params.append([])
        else:
            raise ProfileError(f"layer {len(funcs)}: {layer!r} is not a LayerSpec, a module or a callable")
    return funcs, params


def profile_layers(
    layers: Sequence[Any],
    sample: Any,
    *,
    model: str = "model",
    repeats: int = 10,
    warmup: int = 3,
    progress: bool | TextIO = False,
    loss_fn: Callable | None = None,
    labels: Any = None,
) -> Profile:
    """Measure every layer (see the module docstring) and return the profile. ``progress``: a tqdm
    bar over the layers on stderr (True) or on the given stream; erased when a layer raises.
    ``loss_fn`` and ``labels``: the loss, measured on the last layer's output (``loss``)."""
    from tqdm import tqdm

    from .adapter.module.pipeline_module import layer_names, tie_keys

    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0")
    names, tied = layer_names(layers), tie_keys(layers)
    funcs, params = build_layers(layers)
    keys: list[str | None] = []
    load = load_meter()
    first = next(iter(_tensors(sample)))
    batch = int(first.shape[0]) if torch.Tensor.dim(first) > 0 else 1
    x = sample
    records = []
    bar = tqdm(
        total=len(funcs),
        desc="profile",
        unit="layer",
        disable=not progress,
        file=None if isinstance(progress, bool) else progress,
    )
    try:
        for i, (name, layer_fn, ps) in enumerate(zip(names, funcs, params)):
            bar.set_postfix_str(name[:30], refresh=False)
            inp = as_stage_input(x)
            measured = measure_layer(
                layer_fn,
                inp,
                ps,
                tensor_bytes(ps),
                repeats=repeats,
                warmup=warmup,
                guard=lambda f, phase, i=i, name=name: _guard(f, f"layer {i} ({name}) {phase}"),
            )
            for p in ps:
                p.grad = None
            records.append(dict(name=name, input_bytes=float(nbytes(sample)) if i == 0 else None, **measured.record))
            keys.append(work_key(name, ps, inp, tied=tied[i] is not None))
            x = measured.output
            bar.update()
    except BaseException:
        bar.leave = False  # the error message starts on a clean line
        raise
    finally:
        bar.close()
    loss = None
    if loss_fn is not None:
        name = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__
        ps = list(loss_fn.parameters()) if isinstance(loss_fn, torch.nn.Module) else []
        measured = measure_layer(
            lambda pair: loss_fn(pair[0], pair[1]),
            (as_stage_input(x), labels),
            ps,
            tensor_bytes(ps),
            repeats=repeats,
            warmup=warmup,
            guard=lambda f, phase: _guard(f, f"loss ({name}) {phase}"),
        )
        # what the loss saves for itself: the output it receives is the last layer's
        record = pool([dict(name=name, input_bytes=float(nbytes((x, labels))), **measured.record)], [None])[0][0]
        loss = LayerProfile(**attribute_saved([record])[0])
    dtype = param_dtype([p for ps in params for p in ps])
    pooled, groups = pool(records, keys)
    return Profile(
        model=model,
        batch_size=batch,
        source="hippie-ds profile",
        loss=loss,
        param_dtype=dtype,
        groups=groups or None,
        load=load(),
        layers=[LayerProfile(**fields, tied_key=key) for fields, key in zip(attribute_saved(pooled), tied)],
    )


def load_meter() -> Callable[[], MeasuredLoad]:
    """Starts measuring the machine's load; the returned call ends it: load averages before and after,
    this process's CPU seconds over wall seconds (:class:`~hippie_ds.planner.profile_fields.MeasuredLoad`)."""
    wall, cpu, before = time.perf_counter(), time.process_time(), loadavg()

    def done() -> MeasuredLoad:
        seconds = time.perf_counter() - wall
        return MeasuredLoad(
            cpus=os.cpu_count(),
            load_before=before,
            load_after=loadavg(),
            wall_seconds=seconds,
            cpu_share=(time.process_time() - cpu) / seconds if seconds > 0 else None,
        )

    return done
