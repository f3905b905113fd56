"""One layer measured on one input: the per-layer part of a profile, shared by ``hippie-ds profile``
(:mod:`hippie_ds.profiler`, a layer list in one process) and ``hippie.profile``
(:mod:`hippie_ds.adapter.profiling.profile_in_place`, the running job's own layers and inputs).

:func:`measure_layer` runs the layer on a stage input (detached tensors, floating ones requiring
grad) and returns its profile fields (see :mod:`hippie_ds.profiler` for what each means) and the
saved-tensor accounting that :func:`attribute_saved` turns into ``saved_bytes`` over the whole
layer list (a layer's output counts when it or the next layer saves it, so the next layer's
record is needed: across stages, after a gather).

Working memory (``working_bytes``) comes from the CUDA caching allocator: one more untimed
forward+backward between ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated``,
less what was allocated before it and what the layer keeps (its saved tensors and output). It
resets the device's peak statistic (a job reading ``max_memory_allocated`` reads it after the
profiled steps). Elsewhere there is no allocator statistic: None, the planner estimates it.

Times come from a clock: :data:`WALL_CLOCK` (``time.perf_counter``, CPU layers) or
:class:`CudaClock` (``torch.cuda.Event`` pairs recorded around each timed run on the current
stream; one synchronisation after a layer's runs of one kind, none inside a timed run).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .memory import _tensors, storage_key
from ..module.tensor_calls import tensor_bytes


class WallClock:
    """Host seconds (``time.perf_counter``): what a CPU layer takes."""

    name = "wall clock"

    def start(self):
        return time.perf_counter()

    def stop(self, mark):
        return time.perf_counter() - mark

    def seconds(self, marks: list) -> list[float]:
        return list(marks)


class CudaClock:
    """Device seconds between two ``torch.cuda.Event`` records on the current stream: the layer's
    kernels, not the host's launch loop. ``seconds`` synchronises on the last event only."""

    name = "CUDA events"

    def start(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return mark, end

    def seconds(self, marks: list) -> list[float]:
        if marks:
            marks[-1][1].synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in marks]


WALL_CLOCK = WallClock()


def clock_for(device: torch.device | str):
    """CUDA events on a CUDA device, the wall clock elsewhere."""
    return CudaClock() if torch.device(device).type == "cuda" else WALL_CLOCK


def _timed(clock, runs: int, body: Callable[[Any], Any], before: Callable[[], Any] = lambda: None) -> list[float]:
    """Seconds of ``body(before())`` over ``runs`` runs; only ``body`` is timed."""
    marks = []
    for _ in range(runs):
        arg = before()
        mark = clock.start()
        body(arg)
        marks.append(clock.stop(mark))
    return clock.seconds(marks)


def as_stage_input(x: Any) -> Any:
    """What a stage receives: detached tensors, floating ones requiring grad."""
    if isinstance(x, torch.Tensor):
        y = torch.Tensor.detach(x)
        if torch.Tensor.is_floating_point(y):
            torch.Tensor.requires_grad_(y, True)
        return y
    if isinstance(x, (list, tuple)):
        return type(x)(as_stage_input(v) for v in x)
    return x


def detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.Tensor.detach(x)
    if isinstance(x, (list, tuple)):
        return type(x)(detach(v) for v in x)
    return x


def nbytes(obj: Any) -> int:
    return tensor_bytes(_tensors(obj))


def backward_ones(out: Any) -> bool:
    """``torch.autograd.backward`` of the outputs that require grad, with gradients of ones."""
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not outs:
        return False
    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return True


def grad_targets(out: Any, inp: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(outputs that require grad, inputs that require grad, parameters): the parameters are the
    leaves of the outputs' autograd graph other than the inputs (whatever the layer closes over)."""
    outs = [t for t in _tensors(out) if t.requires_grad]
    ins = [t for t in _tensors(inp) if t.requires_grad]
    inputs = {id(t) for t in ins}
    params, seen, todo = [], set(), [t.grad_fn for t in outs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if leaf is not None and id(leaf) not in inputs:
            params.append(leaf)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return outs, ins, params


def grad_towards(outs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    if outs and targets:
        torch.autograd.grad(outs, targets, [torch.ones_like(t) for t in outs], allow_unused=True)


def weight_time(fn, inp: Any, backward: float, repeats: int, warmup: int, clock=WALL_CLOCK) -> float:
    """W of the layer's backward (:mod:`hippie_ds.profiler`): backward - the input pass, clamped to
    [0, the parameter pass], from the medians of the two passes."""
    outs, ins, params = grad_targets(fn(inp), inp)
    if not outs or not params:
        return 0.0
    if not ins:
        return backward

    def median_pass(towards_params: bool) -> float:
        def prepare():
            return grad_targets(fn(inp), inp)

        def run(targets):
            outs, ins, params = targets
            grad_towards(outs, params if towards_params else ins)

        _timed(clock, warmup, run, prepare)
        return statistics.median(_timed(clock, repeats, run, prepare))

    return min(max(0.0, backward - median_pass(False)), median_pass(True))


def split_times(
    fn, inp: Any, backward: float, repeats: int, warmup: int, clock=WALL_CLOCK
) -> tuple[float, float] | None:
    """(I, W), medians, of the layer's backward split as a zero-bubble stage runs it
    (:mod:`hippie_ds.adapter.gradients.split_backward`: I one ``autograd.grad`` towards the input, keeping the
    gradients at the parameter ops; W one ``autograd.grad`` per parameter group). None: no input
    gradient (the engine runs the whole backward as W); no parameters: (backward, 0). The
    parameters' ``.grad`` and the inputs' are restored afterwards (measuring inside a running job)."""
    from ..gradients.split_backward import backward_input, backward_weight

    outs, ins, params = grad_targets(fn(inp), inp)
    if not outs or not ins:
        return None
    if not params:
        return backward, 0.0
    kept = [(t, t.grad) for t in list(params) + ins]

    def forward():  # W adds into a .grad in place: never into one the caller holds
        for t, _ in kept:
            t.grad = None
        outs_, ins_, params_ = grad_targets(fn(inp), inp)
        return outs_, ins_, params_, [torch.ones_like(t) for t in outs_]

    def input_pass(targets):
        outs_, ins_, params_, grads = targets
        return backward_input(outs_, grads, ins_, params_), params_

    def weight_pass(pending):
        backward_weight(*pending)

    try:
        _timed(clock, warmup, lambda t: weight_pass(input_pass(t)), forward)
        i = statistics.median(_timed(clock, repeats, input_pass, forward))
        w = statistics.median(_timed(clock, repeats, weight_pass, lambda: input_pass(forward())))
    finally:
        for t, g in kept:
            t.grad = g
    return i, w


def saved_storages(fn, x: Any) -> tuple[dict[tuple, int], Any]:
    """({storage: bytes} autograd saves during one forward of ``fn`` on ``x``, output)."""
    packed: dict[tuple, int] = {}

    def pack(t):
        if t.layout == torch.strided:
            key = storage_key(t)
            packed[key] = key[2]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return packed, out


def _cuda_device(obj: Any) -> torch.device | None:
    return next((t.device for t in _tensors(obj) if t.is_cuda), None)


def peak_above(run: Callable[[], Any], device: torch.device | None) -> float | None:
    """Bytes the CUDA allocator's peak rises above what was allocated before ``run()`` (None: not
    a CUDA device). Resets the device's peak statistic."""
    if device is None:
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - before)


def _keys(obj: Any) -> set[tuple]:
    return {storage_key(t) for t in _tensors(obj)}


def _no_guard(fn, phase):
    return fn


@dataclass
class LayerMeasure:
    """One layer on one input: ``fields`` (``LayerProfile`` fields but ``name`` and the saved
    bytes), ``record`` (picklable: ``fields`` plus the saved-tensor accounting that
    :func:`attribute_saved` needs) and ``output`` (the layer's output without a graph)."""

    record: dict
    output: Any


def measure_layer(
    fn,
    inp: Any,
    params: Sequence[torch.Tensor],
    param_bytes: float,
    *,
    repeats: int,
    warmup: int,
    clock=WALL_CLOCK,
    accumulate: bool = True,
    guard=_no_guard,
) -> LayerMeasure:
    """Measure ``fn`` on ``inp`` (a stage input, :func:`as_stage_input`): medians over ``repeats``
    timed runs after ``warmup`` runs, then one forward+backward for the working memory on CUDA
    (module docstring; None elsewhere). ``params``: the tensors the layer uses as parameters (their
    storages are not activations); ``param_bytes``: what the profile records for them.
    ``accumulate``: the backward is ``torch.autograd.backward`` (gradients accumulate into the
    leaves' ``.grad``), else ``torch.autograd.grad`` towards the inputs and every leaf of the graph
    (no ``.grad`` is written and no hook on a parameter's gradient accumulation runs: measuring
    inside a running job). ``guard(callable, phase)`` wraps the layer's code ('forward',
    'backward') to report its errors."""
    forward_fn = guard(fn, "forward")
    if accumulate:
        backward_fn = guard(backward_ones, "backward")
    else:

        def all_grads(out):
            outs, ins, leaves = grad_targets(out, inp)
            grad_towards(outs, ins + leaves)

        backward_fn = guard(all_grads, "backward")
    for _ in range(warmup):
        backward_fn(forward_fn(inp))
    forward_runs = _timed(clock, repeats, lambda _: forward_fn(inp))
    backward_runs = _timed(clock, repeats, backward_fn, lambda: forward_fn(inp))
    forward, backward = statistics.median(forward_runs), statistics.median(backward_runs)
    split = guard(split_times, "backward")(forward_fn, inp, backward, repeats, warmup, clock)
    if split is None:  # no input gradient: the whole backward is W (no parameters: 0), no split_extra
        weight, extra = guard(weight_time, "backward")(forward_fn, inp, backward, repeats, warmup, clock), None
        all_weight = weight == backward > 0  # noise.pool keeps W equal to the pooled backward, not to this median
    else:  # the split as the engine runs it: W, and what I + W cost beyond the whole backward
        weight = min(split[1], backward)
        extra = max(0.0, split[0] + split[1] - backward)
        all_weight = False
    peak = peak_above(lambda: backward_fn(forward_fn(inp)), _cuda_device(inp))
    packed, out = saved_storages(forward_fn, inp)
    ins, outs, excluded = _keys(inp), _keys(out), _keys(list(params))
    own = {k: v for k, v in packed.items() if k not in ins and k not in excluded}
    output = {k: k[2] for k in outs - ins}
    kept = sum({**own, **output}.values())  # held until the backward: the planner counts it as activations
    record = dict(
        forward=forward,
        backward=backward,
        backward_weight=weight,
        split_extra=extra,
        recompute=forward,
        weight_is_backward=all_weight,
        forward_runs=list(forward_runs),
        backward_runs=list(backward_runs),
        working_bytes=None if peak is None else max(0.0, peak - kept),
        output_bytes=float(nbytes(out)),
        param_bytes=float(param_bytes),
        own_saved=float(sum(own.values())),
        output_extra=float(sum(v for k, v in output.items() if k not in own)),
        saves_output=bool(output.keys() & own.keys()),
        saves_input=bool(ins & packed.keys()),
        passes_input=bool(outs) and outs <= ins,
    )
    with torch.no_grad():
        result = forward_fn(inp)
    return LayerMeasure(record=record, output=detach(result))


ACCOUNTING = (
    "own_saved",
    "output_extra",
    "saves_output",
    "saves_input",
    "passes_input",
    "forward_runs",
    "backward_runs",
    "weight_is_backward",
)  # noise.pool reads it; never a LayerProfile field


def work_key(name: str, params: Sequence[torch.Tensor], inp: Any, tied: bool = False) -> str | None:
    """What makes two layers the same work (:mod:`hippie_ds.planner.noise`): the name (class), the
    parameters' shapes and dtypes, the input's shapes and dtypes. None (never grouped): a tied layer
    or a lambda (one name, any work)."""
    if tied or name == "<lambda>":
        return None

    def shapes(ts):
        return ";".join(f"{tuple(torch.Tensor.size(t))}:{t.dtype}" for t in ts)

    return f"{name}|{shapes(params)}|{shapes(_tensors(inp))}"


def attribute_saved(records: Sequence[dict]) -> list[dict]:
    """The layers' ``LayerProfile`` fields in model order (records of :func:`measure_layer` with
    ``name`` and any other field added): saved bytes attributed to the producer, its output
    counted when it or the layer that consumes it saves it (the last layer's: the loss holds it).
    A layer whose output is a view of its input (a flatten, an emulated or in-place activation)
    passes its input on: the consumer is the first layer after the run of such layers, and a
    save anywhere along it keeps the producer's storage."""
    out = []
    for i, record in enumerate(records):
        fields = {k: v for k, v in record.items() if k not in ACCOUNTING}
        output_saved = record["saves_output"] or _consumer_saves(records, i + 1)
        fields["saved_bytes"] = record["own_saved"] + (record["output_extra"] if output_saved else 0.0)
        fields["output_saved"] = bool(output_saved)
        out.append(fields)
    return out


def _consumer_saves(records: Sequence[dict], j: int) -> bool:
    """Whether what layer ``j`` receives is kept for backward: by ``j`` itself, or, through layers
    that pass it on as a view, by a later one (past the last layer: the loss holds it)."""
    while j < len(records):
        if records[j]["saves_input"]:
            return True
        if not records[j].get("passes_input", False):  # records of an older profiler: no pass-through
            return False
        j += 1
    return True


DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def param_dtype(params: Sequence[torch.Tensor]) -> str | None:
    """The profile's name of the dtype holding most of ``params``' elements (None: no floating
    parameters, or a dtype the planner has no state factor for)."""
    counts: dict[torch.dtype, int] = {}
    for p in params:
        if torch.Tensor.is_floating_point(p):
            counts[p.dtype] = counts.get(p.dtype, 0) + torch.Tensor.numel(p)
    return DTYPES.get(max(counts, key=counts.get)) if counts else None


def bytes_dtype(trained: str | None, recorded: float, measured: float) -> str | None:
    """The dtype a profile's ``param_bytes`` count when they were taken from elsewhere (the layer
    specs built on the meta device: ``recorded`` bytes) than the measured parameters of dtype
    ``trained`` (``measured`` bytes): float32 when they are twice a 2-byte dtype's."""
    if trained is None or measured <= 0:
        return trained
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[trained]
    per = size * recorded / measured  # bytes a parameter in the recorded figures
    if abs(per - 4) < 0.5:
        return "float32"
    return trained if abs(per - size) < 0.5 else None


def loadavg() -> float | None:
    """The machine's 1-minute load average (None where the platform has none): what both profilers
    record beside their times."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
