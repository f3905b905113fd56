"""Rank worker of ``tools/bench_hidden_comm.py`` (not meant to be started by hand).

One process per rank, started by DeepSpeed's launcher once per emulated node. It builds, for
every schedule asked for, a fresh GPT-like ``PipelineModule`` from the same seed and an engine
(stock ``deepspeed.initialize`` for ``stock``, ``hippie_ds.initialize`` otherwise), warms each
up, then runs the timed steps in rounds, interleaving the schedules so that machine noise hits
them all alike. Nothing here adds a barrier inside or between timed steps.

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
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import hippie_ds  # noqa: E402

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


# ---------------------------------------------------------------------------------- engines
def ds_config(a, label, schedule, dp, out, costs=None):
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro_batch_size,
        "train_batch_size": a.micro_batch_size * a.micro_batches * dp,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "torch_adam": True}},
        "steps_per_print": 10 ** 9,
        "pipeline": {},
    }
    if schedule != "stock":
        cfg["pipeline"]["schedule"] = schedule
        cfg["hippie"] = {"timeline_dir": os.path.join(out, "raw", label, "timeline")}
        if costs is not None:
            cfg["hippie"].update({"deferred_stages": "auto", "costs": costs})
    return cfg


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


# ---------------------------------------------------------------------------------- main
def log(rank, msg):
    if rank == 0:
        print(f"[bench] {msg}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--schedules", required=True, help="comma list of labels: stock, 1f1b, gpipe, hippie, "
                                                       "hippie-1f1b, hippie-auto, hippie-1f1b-auto")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
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

    def run_step(label, rnd, index, warmup):
        engine = engines[label]
        start = time.perf_counter()
        loss = engine.train_batch(iters[label])
        end = time.perf_counter()
        records[label].append({"round": rnd, "index": index, "warmup": warmup, "start": start, "end": end,
                               "loss": float(loss)})
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
        log(rank, f"building {label} ({'deepspeed.initialize' if schedule == 'stock' else 'hippie_ds.initialize'})")
        module = PipelineModule(layers=layer_specs(a), num_stages=a.stages, loss_fn=loss_fn,
                                topology=hippie_ds.make_topology(a.stages, world, "pipeline_in_node"),
                                partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
        cfg = ds_config(a, label, schedule, dp, a.out, costs_path if label.endswith("-auto") else None)
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, model_parameters=[q for q in module.parameters() if q.requires_grad],
                          config=cfg)
        if schedule == "stock":
            time_stock_instructions(engine)
        engines[label], iters[label], records[label] = engine, data_iter(a, engine.grid.data_parallel_id), []
        params = sum(q.numel() for q in module.parameters() if q.requires_grad)
        meta[label] = {"rank": rank, "stage": engine.stage_id, "data_parallel_id": engine.grid.data_parallel_id,
                       "schedule": schedule, "label": label, "params": params,
                       "schedule_params": getattr(getattr(engine, "compiled_schedule", None), "params", {}),
                       "parts": list(module.parts)}
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
        with open(os.path.join(d, f"rank{rank}.steps.json"), "w") as f:
            json.dump({**meta[label], "t0": t0, "steps": records[label]}, f)
        if hasattr(engine, "write_timeline"):
            engine.write_timeline()  # -> raw/<label>/timeline/rank{R}.json (config "hippie.timeline_dir")
        else:
            with open(os.path.join(d, "timeline", f"rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "stage": engine.stage_id, "data_parallel_id": engine.grid.data_parallel_id,
                           "schedule": "stock", "events": events}, f)
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(a.out, "raw", "done.json"), "w") as f:
            json.dump({"labels": labels, "world": world}, f)
    log(rank, "worker done")


if __name__ == "__main__":
    main()
