"""Rank worker of ``tools/bench.py`` and ``tools/bench_hidden_comm.py`` (not meant to be started by hand).

One process per rank, started by DeepSpeed's launcher once per emulated node. It builds, for
every schedule label asked for, a fresh GPT-like model from the same seed and an engine, warms
each up, then runs the timed steps in rounds, interleaving the labels so that machine noise hits
them all alike. Nothing here adds a barrier inside or between timed steps. Labels:

* ``stock``: stock DeepSpeed 1F1B (``deepspeed.initialize`` on a ``PipelineModule``);
* ``dp``: plain DeepSpeed data parallelism over every rank (``deepspeed.initialize`` on an
  ``nn.Module`` holding the whole model), ``--global-batch`` samples a step, micro-batches of
  ``--micro-batch-size`` with gradient accumulation; the gradient all-reduce is DeepSpeed's own
  ``allreduce_gradients`` after the last backward (called by this worker so it can be timed,
  exactly where ``engine.backward`` would call it), then ``engine.step()``;
* any other name: ``hippie_ds.initialize`` with that schedule (``NAME-auto``: ``deferred_stages:
  auto`` with a cost file measured on the stock engine's warm-up). With ``--schedule-configs
  DIR``, ``DIR/NAME.json``'s ``pipeline.schedule`` and ``hippie`` section are used (so schedules
  added later, e.g. ``2bw``, need only their config file), with ``--costs`` for ``auto``.

With ``--memory`` every step also records the peak bytes held for backward
(``hippie_ds.memory.ActivationMeter``: saved tensors counted once per storage until the autograd
graph releases them, parameters excluded, plus the stage's input and output that the engine
keeps until the backward), and each rank its resident memory
(VmRSS before the model is built, VmHWM at the end). Run one label per process for a
meaningful peak RSS.

Per schedule and rank it writes, under ``--out``/raw/<label>/:

* ``rank{R}.steps.json``: every ``train_batch`` call with its absolute ``time.perf_counter``
  start and end (CLOCK_MONOTONIC, one clock for all processes of the machine, namespaces
  included), round, index, warm-up flag and loss;
* ``timeline/rank{R}.json``: the executed instructions (the engine's timeline format, times
  relative to ``t0`` saved in the steps file). hippie-ds engines record it themselves
  (``"hippie": {"timeline_dir": ...}``); the stock engine gets a per-instance copy of its class's
  ``_INSTRUCTION_MAP`` whose functions time the original handlers (``_exec_schedule`` looks
  the map up on ``self``, so the class and every other engine are left untouched).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule

import hippie_ds
from hippie_ds.memory import ActivationMeter, hold_stage_io

BASE_SEED = 4321


# ---------------------------------------------------------------------------------- model
class Embedding(nn.Module):
    def __init__(self, vocab, seq, d):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-LN GPT block: causal self-attention and a 4x MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)  # untied: hippie schedules refuse tied modules

    def forward(self, x):
        return self.out(self.ln(x))


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(a):
    return ([LayerSpec(Embedding, a.vocab, a.seq, a.d_model)]
            + [LayerSpec(Block, a.d_model, a.heads) for _ in range(a.layers)]
            + [LayerSpec(Head, a.d_model, a.vocab)])


def data_iter(a, replica):
    """Learnable synthetic sequences (arithmetic progressions mod vocab), identical for every
    schedule: micro-batch m of step s of replica r is seeded by (s, r, m)."""
    step = 0
    while True:
        for m in range(a.micro_batches):
            g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * replica + m)
            start = torch.randint(0, a.vocab, (a.micro_batch_size, 1), generator=g)
            stride = torch.randint(1, 9, (a.micro_batch_size, 1), generator=g)
            seq = (start + stride * torch.arange(a.seq + 1)) % a.vocab
            yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        step += 1


# ---------------------------------------------------------------------------------- memory
# Bytes held for backward: hippie_ds.memory.ActivationMeter (saved-tensor hooks, storage-
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


def state_bytes(engine):
    """Bytes of this rank's parameters, gradients and optimizer state tensors (and the peak of
    stashed weight versions for 2bw / pipedream)."""
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
        elif p.requires_grad:  # released after the step; it exists at the step's peak
            total += p.numel() * p.element_size()
    add(getattr(engine, "_grad_buffer", None))  # hippie-ds deferred stages' gradient buffer
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
def ds_config(a, label, schedule, dp, out, costs=None, hippie_section=None):
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro_batch_size,
        "train_batch_size": a.micro_batch_size * a.micro_batches * dp,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "torch_adam": True}},
        "steps_per_print": 10 ** 9,
        "pipeline": {},
    }
    if schedule == "dp":
        cfg.pop("pipeline")
        cfg["train_batch_size"] = a.global_batch or a.micro_batch_size * a.micro_batches * dp
    elif schedule != "stock":
        cfg["pipeline"]["schedule"] = schedule
        cfg["hippie"] = dict(hippie_section or {})
        cfg["hippie"]["timeline_dir"] = os.path.join(out, "raw", label, "timeline")
        if costs is not None:
            cfg["hippie"].update({"deferred_stages": "auto", "costs": costs})
        elif cfg["hippie"].get("deferred_stages") == "auto" and a.costs:
            cfg["hippie"]["costs"] = a.costs
    return cfg


def schedule_config(a, label):
    """(schedule name, hippie section) from ``--schedule-configs``/LABEL.json, if there is one.
    A label NAME@L is NAME with ``hippie.deferred_layers`` = L (partial deferral; NAME@all: the
    whole deferred stage)."""
    name, at, layers = label.partition("@")
    extra = {"deferred_layers": None if layers == "all" else int(layers)} if at else {}
    if not a.schedule_configs:
        return name, extra
    path = os.path.join(a.schedule_configs, f"{name}.json")
    if not os.path.exists(path):
        return name, extra
    with open(path) as f:
        cfg = json.load(f)
    hippie = {k: v for k, v in (cfg.get("hippie") or {}).items() if k not in ("timeline_dir", "costs")}
    return (cfg.get("pipeline") or {}).get("schedule", name), {**hippie, **extra}


def time_stock_instructions(engine):
    """Give this engine its own ``_INSTRUCTION_MAP`` whose handlers record start/end."""
    engine._bench_t0 = time.perf_counter()
    engine._bench_events = []

    def timed(cls, fn):
        def run(self, **kwargs):
            start = time.perf_counter()
            fn(self, **kwargs)
            end = time.perf_counter()
            self._bench_events.append({"name": repr(cls(**kwargs)), "kind": cls.__name__,
                                       "start": start - self._bench_t0, "end": end - self._bench_t0,
                                       "step": self.global_steps, "buffer": kwargs.get("buffer_id")})
        return run

    engine._INSTRUCTION_MAP = {cls: timed(cls, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}


def timeline_of(engine):
    """(t0, events) in the engine's timeline format."""
    if hasattr(engine, "_bench_events"):
        return engine._bench_t0, engine._bench_events
    return getattr(engine, "_t0", None), list(engine._timeline)


def stage_costs(a, engine, steps_from):
    """This rank's measured per-micro-batch costs (from the stock engine's warm-up timeline)."""
    _, events = timeline_of(engine)

    def mean(kinds):
        ds = [e["end"] - e["start"] for e in events if e["kind"] in kinds and e["step"] >= steps_from]
        return sum(ds) / len(ds) if ds else 0.0

    params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return {"stage": engine.stage_id, "forward": mean({"ForwardPass"}), "backward": mean({"BackwardPass"}),
            "optimizer_time": mean({"OptimizerStep"}), "param_bytes": 4.0 * params,
            "activation_bytes": 4.0 * a.micro_batch_size * a.seq * a.d_model}


class DPModel(nn.Module):
    """The whole model on one rank (for data parallelism): the same layers, seeded as
    ``PipelineModule(seed_layers=True, base_seed=BASE_SEED)`` seeds them."""

    def __init__(self, a):
        super().__init__()
        layers = []
        for i, spec in enumerate(layer_specs(a)):
            torch.manual_seed(BASE_SEED + i)
            layers.append(spec.build())
        self.layers = nn.Sequential(*layers)

    def forward(self, ids, labels):
        return loss_fn(self.layers(ids), labels)


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
        self._bench_t0, self._bench_events = time.perf_counter(), []
        self.data_parallel_id = torch.distributed.get_rank()
        self.optimizer = self.engine.optimizer

    def _ev(self, kind, start, name=None):
        self._bench_events.append({"name": name or kind, "kind": kind, "start": start - self._bench_t0,
                                   "end": time.perf_counter() - self._bench_t0, "step": self.global_steps})

    def train_batch(self, it):
        e, gas = self.engine, self.engine.gradient_accumulation_steps()
        total = 0.0
        for m in range(gas):
            ids, labels = next(it)
            t = time.perf_counter()
            loss = e(ids, labels)
            self._ev("ForwardPass", t, f"ForwardPass(micro_batch={m})")
            t = time.perf_counter()
            e.backward(loss)
            self._ev("BackwardPass", t, f"BackwardPass(micro_batch={m})")
            if m == gas - 1:
                t = time.perf_counter()
                e.allreduce_gradients()
                self._ev("ReduceGrads", t)
            t = time.perf_counter()
            e.step()
            if m == gas - 1:
                self._ev("OptimizerStep", t)
            total += float(loss.detach())
        self.global_steps += 1
        return torch.tensor(total / gas)


# ---------------------------------------------------------------------------------- main
def log(rank, msg):
    if rank == 0:
        print(f"[bench] {msg}", flush=True)


def parse_plans(items):
    plans = {}
    for item in items or []:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--plan {item!r}: expected LABEL=PATH")
        plans[label] = path
    return plans


def build_pipeline_module(a, label, world):
    """A PipelineModule: hippie_ds.PipelineModule (which takes a plan file) where it exists,
    else DeepSpeed's; a plan file for this label needs the former."""
    plan = parse_plans(a.plan).get(label)
    cls = getattr(hippie_ds, "PipelineModule", None)
    kwargs = dict(layers=layer_specs(a), num_stages=a.stages, loss_fn=loss_fn,
                  topology=hippie_ds.make_topology(a.stages, world, "pipeline_in_node"),
                  partition_method=a.partition_method, seed_layers=True, base_seed=BASE_SEED)
    if plan is not None:
        if cls is None:
            raise SystemExit(f"--plan {label}={plan}: this hippie_ds has no PipelineModule to read plan files")
        return cls(plan=plan, **kwargs)
    return (cls or PipelineModule)(**kwargs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--schedules", required=True, help="comma list of labels: stock, dp, 1f1b, gpipe, hippie, "
                                                       "hippie-1f1b, hippie-auto, hippie-1f1b-auto, or any "
                                                       "schedule name")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=0,
                   help="samples a step for 'dp' (default: micro-batch size x micro-batches x pipeline replicas)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--allreduce-bandwidth", type=float, default=1.25e8, help="bytes/s, for the 'auto' cost file")
    p.add_argument("--timeout-s", type=int, default=600)
    p.add_argument("--memory", action="store_true", help="record bytes saved for backward and resident memory")
    p.add_argument("--schedule-configs", default=None, help="directory of NAME.json configs (pipeline.schedule, hippie)")
    p.add_argument("--costs", default=None, help="cost file for 'deferred_stages: auto' in those configs")
    p.add_argument("--plan", action="append", default=[], help="LABEL=PLAN_FILE (needs hippie_ds.PipelineModule)")
    p.add_argument("--partition-method", default="uniform", help="PipelineModule partition_method")
    a = p.parse_args()

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=a.timeout_s))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dp = world // a.stages
    labels = [s for s in a.schedules.split(",") if s]
    if any(l.endswith("-auto") for l in labels) and "stock" not in labels:
        labels.insert(0, "stock")  # the 'auto' cost file is measured on the stock engine
    labels.sort(key=lambda l: l.endswith("-auto"))  # the cost file must exist before an auto engine is built
    engines, iters, records, meta = {}, {}, {}, {}
    costs_path = None
    tracker = ActivationMeter() if a.memory else None
    rss_baseline = proc_status_bytes("VmRSS") if a.memory else None  # after imports and init, before any model

    def run_step(label, rnd, index, warmup):
        engine = engines[label]
        start = time.perf_counter()
        if tracker is not None:
            tracker.reset_peak()
            with tracker:
                loss = engine.train_batch(iters[label])
        else:
            loss = engine.train_batch(iters[label])
        end = time.perf_counter()
        rec = {"round": rnd, "index": index, "warmup": warmup, "start": start, "end": end, "loss": float(loss)}
        if tracker is not None:
            rec["saved_peak_bytes"], rec["saved_after_bytes"] = tracker.peak, tracker.current
        records[label].append(rec)
        return end - start

    for label in labels:
        schedule = label[:-len("-auto")] if label.endswith("-auto") else label
        if label.endswith("-auto") and costs_path is None:
            mine = stage_costs(a, engines["stock"], steps_from=1)
            every = [None] * world
            torch.distributed.all_gather_object(every, mine)
            costs_path = os.path.join(a.out, "raw", "costs.json")
            if rank == 0:
                os.makedirs(os.path.dirname(costs_path), exist_ok=True)
                per_stage = {}
                for c in every:  # mean over the replicas of each stage
                    per_stage.setdefault(c["stage"], []).append(c)
                stages = [{k: sum(c[k] for c in cs) / len(cs) for k in cs[0] if k != "stage"}
                          for _, cs in sorted(per_stage.items())]
                with open(costs_path, "w") as f:
                    json.dump({"stages": stages, "comm": {"allreduce_bandwidth": a.allreduce_bandwidth,
                                                          "data_parallel": dp}}, f, indent=1)
            torch.distributed.barrier()  # setup only, before any timed step
        if schedule == "dp":
            log(rank, f"building {label} (deepspeed.initialize, data parallel over {world} rank(s))")
            engine = DPEngine(a, world)
            module, stage, replica = engine.module, 0, rank
            parts = []
        else:
            hippie_section = {}
            if schedule != "stock":
                schedule, hippie_section = schedule_config(a, schedule)
            log(rank, f"building {label} ({'deepspeed.initialize' if schedule == 'stock' else 'hippie_ds.initialize'}"
                      f"{', schedule ' + schedule if schedule != label else ''})")
            module = build_pipeline_module(a, label, world)
            cfg = ds_config(a, label, schedule, dp, a.out, costs_path if label.endswith("-auto") else None,
                            hippie_section)
            init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
            engine, *_ = init(model=module, model_parameters=[q for q in module.parameters() if q.requires_grad],
                              config=cfg)
            if schedule == "stock":
                time_stock_instructions(engine)
            stage, replica, parts = engine.stage_id, engine.grid.data_parallel_id, list(module.parts)
        if tracker is not None:
            tracker.ignore(module.parameters())
            hold_stage_io(module, tracker)
        engines[label], iters[label], records[label] = engine, data_iter(a, replica), []
        params = sum(q.numel() for q in module.parameters() if q.requires_grad)
        meta[label] = {"rank": rank, "stage": stage, "data_parallel_id": replica, "world": world,
                       "stages": 1 if schedule == "dp" else a.stages, "schedule": schedule, "label": label,
                       "params": params,
                       "schedule_params": getattr(getattr(engine, "compiled_schedule", None), "params", {}),
                       # share of this stage's gradient applied one step late (hippie.deferred_layers)
                       "delayed_fraction": engine.delayed_fraction() if hasattr(engine, "delayed_fraction") else None,
                       "parts": parts,
                       "micro_batches": (engine.engine.gradient_accumulation_steps() if schedule == "dp"
                                         else a.micro_batches),
                       "micro_batch_size": a.micro_batch_size}
        for w in range(a.warmup):
            dt = run_step(label, -1, w, True)
            log(rank, f"{label}: warm-up step {w + 1}/{a.warmup}: {dt:.3f} s (rank 0)")

    for rnd in range(a.rounds):
        order = labels[rnd % len(labels):] + labels[:rnd % len(labels)]  # rotate: no fixed position
        for label in order:
            for i in range(a.steps):
                dt = run_step(label, rnd, i, False)
                log(rank, f"round {rnd + 1}/{a.rounds} {label}: step {i + 1}/{a.steps}: {dt:.3f} s (rank 0)")

    for label, engine in engines.items():
        if hasattr(engine, "flush_deferred_update"):
            engine.flush_deferred_update()  # outside the timed steps: leave no collective pending
        t0, events = timeline_of(engine)
        d = os.path.join(a.out, "raw", label)
        os.makedirs(os.path.join(d, "timeline"), exist_ok=True)
        if a.memory:
            meta[label]["memory"] = {"rss_baseline_bytes": rss_baseline, "peak_rss_bytes": peak_rss_bytes(),
                                     "rss_end_bytes": proc_status_bytes("VmRSS"),
                                     "state_bytes": state_bytes(engine),
                                     "labels_in_process": len(engines)}
        with open(os.path.join(d, f"rank{rank}.steps.json"), "w") as f:
            json.dump({**meta[label], "t0": t0, "steps": records[label]}, f)
        if hasattr(engine, "write_timeline"):
            engine.write_timeline()  # -> raw/<label>/timeline/rank{R}.json (config "hippie.timeline_dir")
        else:
            with open(os.path.join(d, "timeline", f"rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "stage": meta[label]["stage"],
                           "data_parallel_id": meta[label]["data_parallel_id"],
                           "schedule": meta[label]["schedule"], "events": events}, f)
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(a.out, "raw", "done.json"), "w") as f:
            json.dump({"labels": labels, "world": world}, f)
    log(rank, "worker done")


if __name__ == "__main__":
    main()
