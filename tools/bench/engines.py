"""The benchmark worker's engines and what it measures of them: DeepSpeed configs per schedule
label, the pipeline module (with a planner layout where given), stock DeepSpeed's instructions
timed, plain data parallelism with the same timeline, the measured per-stage costs for
'deferred_stages: auto', and the memory figures (resident memory, parameter/gradient/optimizer
state)."""

from __future__ import annotations

import json
import os
import time
import weakref

import deepspeed
import torch

import hippie_ds
from hippie_ds.adapter.ds.module import PipelineModule
from hippie_ds.adapter.profiling.timeline import compute_clock, time_stock_handlers
from tools.bench.labels import DATA_PARALLEL, STOCK, split_layers, split_name
from tools.bench.model import BASE_SEED, DPModel, layer_specs, loss_of, stage_output_bytes

# ---------------------------------------------------------------------------------- memory
# Bytes held for backward: hippie_ds.adapter.profiling.memory.ActivationMeter (saved-tensor hooks, storage-
# deduplicated, parameters excluded) plus the stage's input and output, which the engine keeps in
# its pipe buffers until the backward (what the planner's activation memory predicts).


def proc_status_bytes(field):
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes():
    """Peak resident set size of this process: VmHWM, else getrusage's ru_maxrss (kB on Linux)."""
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def state_bytes(engine, released_grads: bool = True):
    """Bytes of this rank's parameters, gradients and optimizer state tensors, hippie-ds's in-flight
    state (a deferred stage's gradient buffer, the staleness correction's state, lagged tie sums:
    ``engine.held_tensors()``) and the peak of stashed weight versions for 2bw / pipedream.
    ``released_grads``: also the gradients the step released (they exist at the step's peak); False:
    only what is alive now."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel():
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()

    for p in engine.module.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
        elif p.requires_grad and released_grads:  # released after the step; it exists at the step's peak
            total += p.numel() * p.element_size()
    held = engine.held_tensors() if hasattr(engine, "held_tensors") else {}  # hippie-ds's in-flight state
    for kind, tensors in held.items():
        if kind != "weight_versions":  # counted at their peak below
            for t in tensors:
                add(t)
    if hasattr(engine, "weight_versions"):  # 2bw / pipedream: stashed weight copies at their peak
        params = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad)
        total += max(engine.weight_versions()["peak"] - 1, 0) * params
    opt = getattr(engine, "optimizer", None)
    opt = getattr(opt, "optimizer", opt)  # DeepSpeed wrappers keep the torch optimizer inside
    for st in getattr(opt, "state", {}).values():
        for v in st.values():
            add(v)
    return total


# ---------------------------------------------------------------------------------- engines
def ds_config(a, label, schedule, dp, out, hippie_section=None):
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro_batch_size,
        "train_batch_size": a.micro_batch_size * a.micro_batches * dp,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "torch_adam": True}},
        "steps_per_print": 10**9,
        "pipeline": {},
    }
    if getattr(a, "comm_dtype", None):
        cfg["communication_data_type"] = a.comm_dtype
    if schedule == DATA_PARALLEL:
        cfg.pop("pipeline")
        cfg["train_batch_size"] = a.global_batch or a.micro_batch_size * a.micro_batches * dp
    elif schedule != STOCK:
        cfg["pipeline"]["schedule"] = schedule
        cfg["hippie"] = dict(hippie_section or {})
        cfg["hippie"]["timeline_dir"] = os.path.join(out, "raw", label, "timeline")
        if cfg["hippie"].get("deferred_stages") == "auto" and a.costs:
            cfg["hippie"]["costs"] = a.costs
    return cfg


def schedule_config(a, label):
    """(schedule name, hippie section) from ``--schedule-configs``/LABEL.json, if there is one.
    A label NAME@L is NAME with ``hippie.deferred_layers`` = L (partial deferral; NAME@all: the
    whole deferred stage); NAME:METHOD[=C][+ef=G] sets ``hippie.staleness`` (tools/bench/labels.py)."""
    name, layers = split_layers(label)
    name, staleness = split_name(name)
    extra = {"deferred_layers": layers} if layers is not None else {}
    if staleness is not None:
        extra["staleness"] = staleness
    if not a.schedule_configs:
        return name, extra
    path = os.path.join(a.schedule_configs, f"{name}.json")
    if not os.path.exists(path):
        return name, extra
    with open(path) as f:
        cfg = json.load(f)
    hippie = {k: v for k, v in (cfg.get("hippie") or {}).items() if k not in ("timeline_dir", "costs")}
    return (cfg.get("pipeline") or {}).get("schedule", name), {**hippie, **extra}


class StockTimeline:
    """The stock engine's instructions as events in hippie-ds's timeline format
    (hippie_ds.adapter.profiling.timeline.time_stock_handlers), and callbacks (class name) after each
    instruction (instruction_cpu.py). Kept here, by engine, not on the engine."""

    def __init__(self, engine):
        self.t0, self.events, self.on_instruction = time.perf_counter(), [], []

        def record(cls, kwargs, start, end):
            for callback in self.on_instruction:
                callback(cls.__name__)
            self.events.append(
                {
                    "name": repr(cls(**kwargs)),
                    "kind": cls.__name__,
                    "start": start - self.t0,
                    "end": end - self.t0,
                    "step": engine.global_steps,
                    "buffer": kwargs.get("buffer_id"),
                }
            )

        time_stock_handlers(engine, record)


_STOCK_TIMELINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def time_stock_instructions(engine) -> StockTimeline:
    """Record the stock engine's instructions (:class:`StockTimeline`)."""
    _STOCK_TIMELINES[engine] = timeline = StockTimeline(engine)
    return timeline


def stock_timeline(engine) -> StockTimeline | None:
    """The :class:`StockTimeline` recording ``engine``, if any."""
    return _STOCK_TIMELINES.get(engine)


def timeline_of(engine):
    """(t0, events) in the engine's timeline format: a stock engine's recording, or a hippie-ds
    engine's own timeline (its public ``timeline()``)."""
    stock = stock_timeline(engine)
    if stock is not None:
        return stock.t0, stock.events
    return engine.timeline()


def stage_costs(a, engine, steps_from):
    """This rank's measured per-micro-batch costs (from the stock engine's warm-up timeline)."""
    t0, events = timeline_of(engine)

    def mean(kinds):
        ds = [e["end"] - e["start"] for e in events if e["kind"] in kinds and e["step"] >= steps_from]
        return sum(ds) / len(ds) if ds else 0.0

    params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return {
        "stage": engine.stage_id,
        "forward": mean({"ForwardPass"}),
        "backward": mean({"BackwardPass"}),
        "optimizer_time": mean({"OptimizerStep"}),
        "param_bytes": 4.0 * params,
        # absolute (step, start, end) of the pipeline-wide optimizer steps: write_auto_costs
        # keeps only each one's work after the last stage arrived
        "optimizer_spans": [
            (e["step"], e["start"] + t0, e["end"] + t0)
            for e in events
            if e["kind"] == "OptimizerStep" and e["step"] >= steps_from
        ],
        "activation_bytes": stage_output_bytes(a, engine.stage_id, getattr(engine.module, "parts", None)),
    }


class DPEngine:
    """A plain DeepSpeed data-parallel engine with the bench's step and timeline: per step
    ``gradient_accumulation_steps`` forward/backward pairs, DeepSpeed's gradient all-reduce after
    the last backward, then the optimizer step; each part recorded like a pipeline instruction."""

    def __init__(self, a, world):
        module = DPModel(a)
        cfg = ds_config(a, "dp", "dp", world, a.out)
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        # The same all-reduce engine.backward would run at the boundary; called below to be timed.
        self.engine.enable_backward_allreduce = False
        self.module, self.stage_id, self.global_steps = self.engine.module, 0, 0
        self._t0, self._events = time.perf_counter(), []
        self.now = compute_clock(self.engine.device)  # on CUDA: after the compute stream's kernels
        self.data_parallel_id = torch.distributed.get_rank()
        self.optimizer = self.engine.optimizer

    def timeline(self) -> tuple[float, list[dict]]:
        """(t0, events), as a hippie-ds engine's ``timeline()``."""
        return self._t0, list(self._events)

    def _ev(self, kind, start, name=None):
        self._events.append(
            {
                "name": name or kind,
                "kind": kind,
                "start": start - self._t0,
                "end": self.now() - self._t0,
                "step": self.global_steps,
            }
        )

    def train_batch(self, it):
        e, gas = self.engine, self.engine.gradient_accumulation_steps()
        total = 0.0
        for m in range(gas):
            ids, labels = (t.to(e.device) for t in next(it))
            t = self.now()
            loss = e(ids, labels)
            self._ev("ForwardPass", t, f"ForwardPass(micro_batch={m})")
            t = self.now()
            e.backward(loss)
            self._ev("BackwardPass", t, f"BackwardPass(micro_batch={m})")
            if m == gas - 1:
                t = self.now()
                e.allreduce_gradients()
                self._ev("ReduceGrads", t)
            t = self.now()
            e.step()
            if m == gas - 1:
                self._ev("OptimizerStep", t)
            total += float(loss.detach())
        self.global_steps += 1
        return torch.tensor(total / gas)


def parse_plans(items):
    plans = {}
    for item in items or []:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--plan {item!r}: expected LABEL=PATH")
        plans[label] = path
    return plans


def virtual_stages_of(schedule: str, stages: int) -> tuple[int, str] | None:
    """(chunks per stage, layout) of a schedule with virtual stages; None for the others (and for
    labels that are not schedules: stock, dp)."""
    from hippie_ds.schedules import ScheduleError, load_spec
    from hippie_ds.schedules.compiler import resolve_virtual_stages

    try:
        spec = load_spec(schedule)
    except ScheduleError:
        return None
    v = resolve_virtual_stages(spec, stages, 1)
    return (v, spec.layout) if v > 1 else None


def build_pipeline_module(a, label, world):
    """A PipelineModule: hippie_ds.PipelineModule (which takes a plan file) where it exists,
    else DeepSpeed's; a plan file for this label needs the former."""
    plan = parse_plans(a.plan).get(label)
    cls = getattr(hippie_ds, "PipelineModule", None)
    kwargs = dict(
        layers=layer_specs(a),
        num_stages=a.stages,
        loss_fn=loss_of(a),
        topology=hippie_ds.make_topology(a.stages, world, "pipeline_in_node"),
        partition_method=a.partition_method,
        seed_layers=True,
        base_seed=BASE_SEED,
    )
    chunks = virtual_stages_of(schedule_config(a, label)[0], a.stages)
    if chunks is not None:  # a schedule with virtual stages: the module builds its chunks
        kwargs.update(virtual_stages=chunks[0], layout=chunks[1])
    if plan is not None:
        if cls is None:
            raise SystemExit(f"--plan {label}={plan}: this hippie_ds has no PipelineModule to read plan files")
        return cls(plan=plan, **kwargs)
    return (cls or PipelineModule)(**kwargs)
