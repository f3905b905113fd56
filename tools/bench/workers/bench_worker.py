"""Rank worker of ``python -m tools.bench`` and its studies (not meant to be started by hand).

One process per rank, started by DeepSpeed's launcher once per emulated node. It builds, for
every schedule label asked for, a fresh GPT-like model from the same seed and an engine, warms
each up, then runs the timed steps in rounds, interleaving the labels so that machine noise hits
them all alike. Nothing here adds a barrier inside or between timed steps of a label; with several
labels, a barrier (untimed) precedes each label's steps in a round, so that no rank starts them
while another still finishes the previous label's. Labels:

* ``stock``: stock DeepSpeed 1F1B (``deepspeed.initialize`` on a ``PipelineModule``);
* ``dp``: plain DeepSpeed data parallelism over every rank (``deepspeed.initialize`` on an
  ``nn.Module`` holding the whole model), ``--global-batch`` samples a step, micro-batches of
  ``--micro-batch-size`` with gradient accumulation; the gradient all-reduce is DeepSpeed's own
  ``allreduce_gradients`` after the last backward (called by this worker so it can be timed,
  exactly where ``engine.backward`` would call it), then ``engine.step()``;
* any other name: ``hippie_ds.initialize`` with that schedule (the grammar of labels.py). With
  ``--schedule-configs DIR``, ``DIR/NAME.json``'s ``pipeline.schedule`` and ``hippie`` section are
  used (so schedules added later, e.g. ``2bw``, need only their config file), with ``--costs`` for
  ``deferred_stages: auto``; ``--costs measured``: a cost file measured on the stock engine's
  warm-up in this job (``stock`` is then built first).

With ``--memory`` every step also records the peak bytes held for backward
(``hippie_ds.adapter.profiling.memory.ActivationMeter``: saved tensors counted once per storage until the autograd
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

The model and its data are in tools/bench/model.py, the engines and the memory figures in
tools/bench/engines.py; this module runs them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from datetime import timedelta

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import hippie_ds
from hippie_ds.adapter.ds.module import stage_of_rank
from hippie_ds.adapter.profiling.memory import ActivationMeter, hold_stage_io
from tools.bench.analysis import last_arrivals, wire_bytes, work_after_arrivals
from tools.bench.cluster import core_ticks
from tools.bench.config import add_model_choice
from tools.bench.engines import (
    DPEngine,
    build_pipeline_module,
    ds_config,
    peak_rss_bytes,
    proc_status_bytes,
    schedule_config,
    stage_costs,
    state_bytes,
    time_stock_instructions,
    timeline_of,
)
from tools.bench.labels import DATA_PARALLEL, STOCK
from tools.bench.model import data_iter
from tools.bench.workers.instruction_cpu import InstructionCpu


def backend_name() -> str:
    """The accelerator's collective backend (nccl on CUDA); gloo on the CPU, whose DeepSpeed
    accelerator names oneCCL, which the bench does not use."""
    acc = get_accelerator()
    return "gloo" if acc.device_name() == "cpu" else acc.communication_backend_name()


def order_labels(schedules: str, measured_costs: bool = False) -> list[str]:
    """The labels in build order: with ``measured_costs`` (``--costs measured``) stock first, its
    warm-up measures the cost file the others read. DP cannot share the processes of a pipeline
    engine: DeepSpeed's plain engine looks its data-parallel group up at each all-reduce in a global
    (``groups.mpu``) that a pipeline engine sets to its grid, so DP would average over one stage's
    replicas (and took 2x its time alone, four such all-reduces of the whole model sharing each
    link). Pure."""
    labels = [s for s in schedules.split(",") if s]
    if DATA_PARALLEL in labels and len(labels) > 1:
        raise SystemExit(
            f"bench_worker: --schedules {schedules!r}: dp must run alone (a pipeline engine in the "
            "same process changes DeepSpeed's data-parallel group for it); give it a job of its own"
        )
    if measured_costs:
        labels = [STOCK] + [label for label in labels if label != STOCK]
    return labels


def log(rank, msg):
    if rank == 0:
        print(f"[bench] {msg}", flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--schedules",
        required=True,
        help="comma list of engine labels (labels.py): stock, dp, or a hippie-ds schedule (1f1b, gpipe, hippie, ...)",
    )
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="samples a step for 'dp' (default: micro-batch size x micro-batches x pipeline replicas)",
    )
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    add_model_choice(p)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--comm-dtype", default=None, help="DeepSpeed's communication_data_type (every schedule)")
    p.add_argument("--allreduce-bandwidth", type=float, default=1.25e8, help="bytes/s, for the 'auto' cost file")
    p.add_argument("--timeout-s", type=int, default=600)
    p.add_argument("--memory", action="store_true", help="record bytes saved for backward and resident memory")
    p.add_argument(
        "--schedule-configs", default=None, help="directory of NAME.json configs (pipeline.schedule, hippie)"
    )
    p.add_argument(
        "--costs",
        default=None,
        help="cost file for 'deferred_stages: auto' in those configs; "
        "'measured': measured on the stock engine's warm-up in this job",
    )
    p.add_argument("--plan", action="append", default=[], help="LABEL=PLAN_FILE (needs hippie_ds.PipelineModule)")
    p.add_argument(
        "--plan-config",
        default=None,
        metavar="PLAN_FILE",
        help="every hippie-ds label runs this plan as a user does: its DeepSpeed config sets only the "
        "optimizer and hippie.plan (the plan's schedule, boundaries, re-computed layers, deferral and "
        "batch keys), the module built from that config; --stages and the micro-batch size and count "
        "are the plan's (the label should be the plan's schedule)",
    )
    p.add_argument("--partition-method", default="uniform", help="PipelineModule partition_method")
    p.add_argument(
        "--core-per-rank",
        action="store_true",
        help="pin each local rank to its own core (a bubble is then idle time, not another rank's)",
    )
    return p.parse_args()


def write_auto_costs(a, stock, world: int, rank: int, dp: int) -> str:
    """The cost file for 'deferred_stages: auto': each rank's measured costs on the stock engine's
    warm-up, gathered, averaged over the replicas of each stage (rank 0 writes it). Its path."""
    mine = stage_costs(a, stock, steps_from=1)
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    costs_path = os.path.join(a.out, "raw", "costs.json")
    if rank == 0:
        os.makedirs(os.path.dirname(costs_path), exist_ok=True)
        # stock's optimizer step waits for every stage (the gradient norm): count its own work
        latest = last_arrivals((step, start) for c in every for step, start, _ in c["optimizer_spans"])
        per_stage = {}
        for c in every:  # mean over the replicas of each stage
            own = [work_after_arrivals(b, e, latest[k]) for k, b, e in c.pop("optimizer_spans")]
            c["optimizer_time"] = sum(own) / len(own) if own else c["optimizer_time"]
            per_stage.setdefault(c["stage"], []).append(c)
        stages = [
            {k: sum(c[k] for c in cs) / len(cs) for k in cs[0] if k != "stage"} for _, cs in sorted(per_stage.items())
        ]
        with open(costs_path, "w") as f:
            json.dump(
                {
                    "stages": stages,
                    "comm": {
                        "allreduce_bandwidth": a.allreduce_bandwidth,
                        "data_parallel": dp,
                        "wire_ratio": wire_bytes(a) / 4.0,
                    },
                },
                f,
                indent=1,
            )
    torch.distributed.barrier()  # setup only, before any timed step
    return costs_path


def build_engine(a, label: str, world: int, rank: int):
    """(engine, module, its stage, its replica, partition, the schedule it runs) of one label."""
    dp = world // a.stages
    schedule = label
    if schedule == DATA_PARALLEL:
        log(rank, f"building {label} (deepspeed.initialize, data parallel over {world} rank(s))")
        engine = DPEngine(a, world)
        return engine, engine.module, 0, rank, [], schedule
    if a.plan_config and schedule != STOCK:
        return build_planned_engine(a, label, world, rank)
    hippie_section = {}
    if schedule != STOCK:
        schedule, hippie_section = schedule_config(a, schedule)
    log(
        rank,
        f"building {label} ({'deepspeed.initialize' if schedule == STOCK else 'hippie_ds.initialize'}"
        f"{', schedule ' + schedule if schedule != label else ''})",
    )
    module = build_pipeline_module(a, label, world)
    cfg = ds_config(a, label, schedule, dp, a.out, hippie_section)
    init = deepspeed.initialize if schedule == STOCK else hippie_ds.initialize
    engine, *_ = init(model=module, model_parameters=[q for q in module.parameters() if q.requires_grad], config=cfg)
    if schedule == STOCK:
        time_stock_instructions(engine)
    return engine, module, engine.stage_id, engine.grid.data_parallel_id, list(module.parts), schedule


def take_plan_shape(a) -> None:
    """--plan-config: the run's stages, micro-batch size and count are the plan's (the data and
    the records follow them)."""
    from hippie_ds.planner import load_plan

    plan = load_plan(a.plan_config)
    a.stages, a.micro_batch_size, a.micro_batches = plan.pipeline_depth, plan.micro_batch_size, plan.micro_batches


def build_planned_engine(a, label: str, world: int, rank: int):
    """A label run as a user runs a plan: the DeepSpeed config names the plan under ``hippie.plan``
    and sets nothing the plan sets (schedule, batch keys, deferral: the plan fills them in), the
    module is hippie_ds.PipelineModule built from that config (boundaries and re-computed layers)."""
    from tools.bench.model import BASE_SEED, layer_specs, loss_of

    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "torch_adam": True}},
        "steps_per_print": 10**9,
        "hippie": {
            "plan": os.path.abspath(a.plan_config),
            "timeline_dir": os.path.join(a.out, "raw", label, "timeline"),
        },
    }
    if a.comm_dtype:
        cfg["communication_data_type"] = a.comm_dtype
    log(rank, f"building {label} (hippie_ds.initialize, config hippie.plan = {a.plan_config})")
    module = hippie_ds.PipelineModule(
        layers=layer_specs(a),
        loss_fn=loss_of(a),
        config=cfg,
        topology=hippie_ds.make_topology(a.stages, world, "pipeline_in_node"),
        seed_layers=True,
        base_seed=BASE_SEED,
    )
    engine, *_ = hippie_ds.initialize(
        model=module, model_parameters=[q for q in module.parameters() if q.requires_grad], config=cfg
    )
    schedule = engine.compiled_schedule.name  # the plan's
    return engine, module, engine.stage_id, engine.grid.data_parallel_id, list(module.parts), schedule


def engine_meta(a, engine, module, label, schedule, stage, replica, parts, world, rank) -> dict:
    """What the steps file says of a label's engine on this rank."""
    return {
        "rank": rank,
        "stage": stage,
        "data_parallel_id": replica,
        "world": world,
        "stages": 1 if schedule == DATA_PARALLEL else a.stages,
        "schedule": schedule,
        "label": label,
        "params": sum(q.numel() for q in module.parameters() if q.requires_grad),
        "schedule_params": getattr(getattr(engine, "compiled_schedule", None), "params", {}),
        # share of this stage's gradient applied one step late (hippie.deferred_layers)
        "delayed_fraction": engine.delayed_fraction() if hasattr(engine, "delayed_fraction") else None,
        "parts": parts,
        "checkpointed_layers": list(getattr(module, "checkpointed_layers", None) or []),
        "plan": a.plan_config,
        # the stages holding each tied module (TiedLayerSpec) this rank holds: what its
        # ReduceTiedGrads waits for (the simulator's Costs.tied_groups)
        "tied_stages": {
            key: sorted({stage_of_rank(module, r) for r in comm["ranks"]})
            for key, comm in sorted(getattr(module, "tied_comms", {}).items())
        },
        "micro_batches": (
            engine.engine.gradient_accumulation_steps() if schedule == DATA_PARALLEL else a.micro_batches
        ),
        "micro_batch_size": a.micro_batch_size,
    }


def runqueue_wait_s() -> dict[int, float] | None:
    """{thread id: seconds it has waited on a run queue} for every thread of this process
    (/proc/self/task/*/schedstat, second field, ns); None where the kernel keeps no schedstat."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return out or None


def wait_between(before: dict | None, after: dict | None, tid: int | None = None) -> float | None:
    """Run-queue wait between two :func:`runqueue_wait_s` readings: of thread ``tid`` (the main
    thread, which runs the schedule's instructions), or summed over every thread (a thread born in
    between counts from 0; one that ended in between is lost; concurrent waits add up). Pure."""
    if before is None or after is None:
        return None
    if tid is not None:
        return after[tid] - before[tid] if tid in after and tid in before else None
    return sum(v - before.get(t, 0.0) for t, v in after.items())


class Steps:
    """The engines by label and their step records: ``run`` times one ``train_batch`` (and, with
    ``--memory``, the peak bytes held for backward during it), and how busy this rank's cores were
    over it (all processes and the kernel: the idle time hidden communication could use)."""

    def __init__(self, memory: bool):
        # One meter per engine: the engines share this process, and what one still holds (DeepSpeed's
        # last stage keeps its outputs in its pipe buffers after the backward) is not another's memory.
        self.memory = memory
        self.trackers: dict[str, ActivationMeter] = {}
        self.engines, self.iters, self.records, self.meta = {}, {}, {}, {}
        self.cpu = InstructionCpu()  # the main thread's CPU per instruction class (host-cost samples)

    def run(self, label, rnd, index, warmup) -> float:
        engine, tracker = self.engines[label], self.trackers.get(label)
        if tracker is not None:
            # DeepSpeed's output-hook managers sit in reference cycles with the outputs they hook:
            # collect them now (untimed) so the peak is this step's, not what the collector left.
            gc.collect()
        cores = os.sched_getaffinity(0)
        ticks0 = core_ticks(cores)
        waited0, cpu0 = runqueue_wait_s(), time.process_time()
        start = time.perf_counter()
        self.cpu.start()
        if tracker is not None:
            tracker.reset_peak()
            with tracker:
                loss = engine.train_batch(self.iters[label])
        else:
            loss = engine.train_batch(self.iters[label])
        get_accelerator().synchronize()  # a GPU's queued kernels are part of the step (no-op on the CPU)
        end = time.perf_counter()
        cpu, waited = time.process_time() - cpu0, runqueue_wait_s()
        busy, total = (b - a for a, b in zip(ticks0, core_ticks(cores)))
        rec = {
            "round": rnd,
            "index": index,
            "warmup": warmup,
            "start": start,
            "end": end,
            "loss": float(loss),
            "core_busy": busy / total if total else None,
            # this rank's CPU time in the step (all its threads) and the time its threads sat runnable
            # on a run queue, waiting for a core (the kernel's schedstat; the main thread's, and all
            # threads' summed): a rank that waited for a core measures the machine's contention
            "cpu_s": cpu,
            "runqueue_wait_s": wait_between(waited0, waited, os.getpid()),
            "runqueue_wait_threads_s": wait_between(waited0, waited),
            "cpu_by_instruction": self.cpu.take(),
        }
        if tracker is not None:
            rec["saved_peak_bytes"], rec["saved_after_bytes"] = tracker.peak, tracker.current
        self.records[label].append(rec)
        return end - start


def write_records(a, steps: Steps, rank: int, rss_baseline):
    """Per label: raw/<label>/rank{R}.steps.json and the timeline (after flushing a deferred update)."""
    for label, engine in steps.engines.items():
        meta = steps.meta[label]
        if hasattr(engine, "drain"):
            engine.drain()  # outside the timed steps: leave no collective pending
        t0, events = timeline_of(engine)
        d = os.path.join(a.out, "raw", label)
        os.makedirs(os.path.join(d, "timeline"), exist_ok=True)
        if a.memory:
            meta["memory"] = {
                "rss_baseline_bytes": rss_baseline,
                "peak_rss_bytes": peak_rss_bytes(),
                "rss_end_bytes": proc_status_bytes("VmRSS"),
                "state_bytes": state_bytes(engine),
                "labels_in_process": len(steps.engines),
            }
            if get_accelerator().device_name() == "cuda":  # what the GPU held at its peak (every label's)
                meta["memory"]["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        with open(os.path.join(d, f"rank{rank}.steps.json"), "w") as f:
            json.dump({**meta, "t0": t0, "steps": steps.records[label]}, f)
        if hasattr(engine, "write_timeline"):
            engine.write_timeline()  # -> raw/<label>/timeline/rank{R}.json (config "hippie.timeline_dir")
        else:
            with open(os.path.join(d, "timeline", f"rank{rank}.json"), "w") as f:
                json.dump(
                    {
                        "rank": rank,
                        "stage": meta["stage"],
                        "data_parallel_id": meta["data_parallel_id"],
                        "schedule": meta["schedule"],
                        "events": events,
                    },
                    f,
                )


def main():
    a = parse_args()
    if a.core_per_rank:
        os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", a.local_rank)) % os.cpu_count()})
    torch.set_num_threads(1)
    if a.plan_config:
        take_plan_shape(a)
    deepspeed.init_distributed(dist_backend=backend_name(), timeout=timedelta(seconds=a.timeout_s))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    labels = order_labels(a.schedules, measured_costs=a.costs == "measured")
    steps = Steps(memory=a.memory)
    rss_baseline = proc_status_bytes("VmRSS") if a.memory else None  # after imports and init, before any model

    for label in labels:
        if a.costs == "measured" and label != STOCK:  # after stock's warm-up, before the first reader
            a.costs = write_auto_costs(a, steps.engines[STOCK], world, rank, world // a.stages)
        engine, module, stage, replica, parts, schedule = build_engine(a, label, world, rank)
        if steps.memory:
            tracker = steps.trackers[label] = ActivationMeter(module)  # ignores the module's parameters
            hold_stage_io(module, tracker)
            if hasattr(engine, "count_split_state_in"):  # zero-bubble: gradients kept from I until W
                engine.count_split_state_in(tracker)
        steps.cpu.attach(engine)
        steps.engines[label], steps.iters[label], steps.records[label] = engine, data_iter(a, replica), []
        steps.meta[label] = engine_meta(a, engine, module, label, schedule, stage, replica, parts, world, rank)
        for w in range(a.warmup):
            dt = steps.run(label, -1, w, True)
            log(rank, f"{label}: warm-up step {w + 1}/{a.warmup}: {dt:.3f} s (rank 0)")

    for rnd in range(a.rounds):
        order = labels[rnd % len(labels) :] + labels[: rnd % len(labels)]  # rotate: no fixed position
        for label in order:
            if len(labels) > 1:  # untimed: the previous label's last step ends on each rank at its own time
                torch.distributed.barrier()
            for i in range(a.steps):
                dt = steps.run(label, rnd, i, False)
                log(rank, f"round {rnd + 1}/{a.rounds} {label}: step {i + 1}/{a.steps}: {dt:.3f} s (rank 0)")

    write_records(a, steps, rank, rss_baseline)
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(a.out, "raw", "done.json"), "w") as f:
            json.dump({"labels": labels, "world": world}, f)
    log(rank, "worker done")


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
