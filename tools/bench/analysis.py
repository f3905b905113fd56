"""The benchmark's analysis of one run: the worker's per-rank files (tools/bench/workers/bench_worker.py) ->
step times, throughput, memory, stage timings, and the simulator's prediction of the step from
the run's own measured costs; one schedule's runs over rounds combined into one record."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from hippie_ds.schedules.measured_costs import forward_share, stage_fields
from tools.bench.cluster import parse_rate
from tools.bench.figures import mean_or_none, median_or_none


def wire_bytes(a) -> float:
    """Bytes per gradient element on the all-reduce's wire (``--comm-dtype``; the model is fp32)."""
    return 2.0 if getattr(a, "comm_dtype", None) in ("bf16", "fp16") else 4.0


def load_run(run_dir: Path, label: str):
    """{rank: (steps record, timeline)} of one job."""
    ranks = {}
    for f in sorted((run_dir / "raw" / label).glob("rank*.steps.json")):
        steps = json.loads(f.read_text())
        tl_path = run_dir / "raw" / label / "timeline" / f"rank{steps['rank']}.json"
        tl = json.loads(tl_path.read_text()) if tl_path.exists() else {"events": []}
        ranks[steps["rank"]] = (steps, tl)
    return ranks


# The instructions a stage spends blocked on its data-parallel all-reduces (the exposed part).
ALLREDUCE_KINDS = ("ReduceGrads", "ReduceTiedGrads", "StartAllReduce", "WaitAllReduce")


def stage_timings(ranks: dict) -> dict:
    """Per stage: median durations (s) of its instructions over its ranks' timed steps, and
    ``exposed_allreduce``: the median over timed steps of the time blocked in all-reduce
    instructions in that step (summed first: hippie waits twice a step, for its in-step part and
    its buffer, and a median of the pooled waits would mix the two), averaged over its ranks."""
    out = {}
    arrivals = _collective_arrivals(ranks)
    for r, (steps, tl) in ranks.items():
        st = out.setdefault(
            steps["stage"],
            {"ranks": [], "params": steps["params"], "parts": steps.get("parts"), "_d": {}, "_exposed": []},
        )
        st["ranks"].append(r)
        per_step = [0.0] * sum(1 for s in steps["steps"] if not s["warmup"])
        for e, start, end, i in _timed_events(steps, tl):
            if e.get("category") == "comm":
                continue
            st["_d"].setdefault(e["kind"], []).append(work_after_arrivals(start, end, arrivals.get((e["kind"], i))))
            if e["kind"] in ALLREDUCE_KINDS:
                per_step[i] += end - start
        if per_step:
            st["_exposed"].append(statistics.median(per_step))
    for st in out.values():
        d, exposed = st.pop("_d"), st.pop("_exposed")
        st["median"] = {k: statistics.median(v) for k, v in d.items()}
        st["count"] = {k: len(v) for k, v in d.items()}
        st["exposed_allreduce"] = statistics.mean(exposed) if exposed else 0.0
    return out


# Instructions that synchronise every stage before their own work (stock DeepSpeed's optimizer step
# computes the global gradient norm across the pipeline first: gradient_clipping defaults to 1.0).
PIPELINE_COLLECTIVES = ("OptimizerStep",)


def work_after_arrivals(start: float, end: float, last_arrival: float | None) -> float:
    """A pipeline-wide collective's own work on a rank: what it did after the last rank arrived
    (the simulator makes every stage wait for the others itself). Pure."""
    return max(0.0, end - (start if last_arrival is None else max(start, last_arrival)))


def last_arrivals(starts) -> dict:
    """{collective: its latest start} from ``(collective, start)`` pairs, one per rank that ran it. Pure."""
    latest = {}
    for key, start in starts:
        latest[key] = max(latest.get(key, start), start)
    return latest


def _timed_events(steps: dict, tl: dict):
    """A rank's timeline events inside its timed steps: (event, absolute start, absolute end, the
    step's index among the timed ones)."""
    timed = [(s["start"], s["end"]) for s in steps["steps"] if not s["warmup"]]
    t0 = steps.get("t0") or 0.0
    for e in tl.get("events", []):
        start = e["start"] + t0
        i = next((i for i, (a, b) in enumerate(timed) if a <= start < b), None)
        if i is not None:
            yield e, start, e["end"] + t0, i


def _collective_arrivals(ranks: dict) -> dict:
    """{(kind, timed step index): the latest absolute start over all ranks} of PIPELINE_COLLECTIVES."""
    return last_arrivals(
        ((e["kind"], i), start)
        for steps, tl in ranks.values()
        if (steps.get("stages") or 1) > 1  # data parallelism has no pipeline to wait for
        for e, start, _, i in _timed_events(steps, tl)
        if e["kind"] in PIPELINE_COLLECTIVES
    )


def measured_costs(
    timings: dict, a, data_parallel: int, allreduce_bandwidth: float, p2p_bandwidth: float, p2p_latency: float
) -> dict:
    """A hippie-ds cost dict from measured stage timings (``Costs.from_dict`` format): the
    instructions' times as ``hippie_ds.schedules.measured_costs`` maps them (moving gradients into
    the deferred buffer counts as update time: the simulator's copy_grads_to_buffer is free, the
    engine's takes 10-20 ms a step on the bench model; issuing a send or starting an all-reduce
    costs the caller its measured median), plus the bench's sizes and the all-reduce's CPU share."""
    from tools.bench.model import stage_output_bytes  # torch: not for the rest of this module

    share = forward_share(st["median"] for st in timings.values())
    stages = []
    for s in sorted(timings):
        stages.append(
            {
                **stage_fields(timings[s]["median"], share),
                "allreduce_cpu_time": a.allreduce_cpu_per_mb * wire_bytes(a) * timings[s]["params"] / 1e6,
                "param_bytes": 4.0 * timings[s]["params"],
                "activation_bytes": stage_output_bytes(a, s, timings[s].get("parts")),
                "saved_bytes": 0.0,
            }
        )
    return {
        "stages": stages,
        "comm": {
            "allreduce_bandwidth": allreduce_bandwidth,
            "data_parallel": data_parallel,
            "wire_ratio": wire_bytes(a) / 4.0,
            "p2p_bandwidth": p2p_bandwidth,
            "p2p_latency": p2p_latency,
            "shared_link": True,
        },
    }


def predict(
    schedule: str, params: dict, stages: int, micro_batches: int, costs: dict, delayed_fraction: dict | None = None
) -> dict:
    """Simulated step time of a schedule under measured costs (hippie-ds simulator);
    ``delayed_fraction``: {stage: share of its gradient applied one step late} (partial deferral)."""
    from hippie_ds.schedules import compile as compile_schedule
    from hippie_ds.schedules.costs import Costs
    from hippie_ds.schedules.simulator import simulate

    try:
        compiled = compile_schedule(schedule, stages, micro_batches, validate=False, **(params or {}))
        res = simulate(
            compiled, Costs.from_dict(costs), iterations=3, critical_path=False, delayed_fraction=delayed_fraction
        )
        return {"step_time": res.step_time, "bubble_fraction": res.bubble_fraction}
    except Exception as exc:  # a schedule the simulator does not know (yet): no prediction
        return {"step_time": None, "error": f"{type(exc).__name__}: {exc}"}


def step_periods(steps_by_rank: dict) -> list[float]:
    """Each timed step's time: from the moment the last rank entered that ``train_batch`` call to
    the moment the last rank left it. A rank that starts call k early (a schedule without an
    end-of-step barrier lets it leave k-1 first) waits inside k for the others: its own duration
    overstates the step; and what the harness does between calls (``gc.collect``, records) is
    in neither. Pure."""
    spans = {}
    for steps in steps_by_rank.values():
        for s in steps:
            if s["warmup"]:
                continue
            first, last = spans.get((s["round"], s["index"]), (s["start"], s["end"]))
            spans[(s["round"], s["index"])] = (max(first, s["start"]), max(last, s["end"]))
    return [last - first for _, (first, last) in sorted(spans.items())]


def analyse_job(run_dir: Path, job: dict, a, link_bw: float, only_round: int | None = None) -> dict | None:
    """One run's record from the worker's files under ``run_dir``: per-step times (the slowest
    rank's), median and throughput, memory per rank, stage timings, exposed all-reduce, and the
    simulator's prediction from the run's own measured costs. None where the run left no files.
    ``only_round``: the timed steps of that worker round only (a worker that ran several labels in
    rounds; the warm-up, which other labels' followed, is left out)."""
    ranks = load_run(run_dir, job["label"])
    if not ranks:
        return None
    if only_round is not None:
        for steps, _ in ranks.values():
            steps["steps"] = [s for s in steps["steps"] if not s["warmup"] and s["round"] == only_round]
    meta = next(iter(ranks.values()))[0]
    keys = sorted({(s["round"], s["index"]) for s in meta["steps"] if not s["warmup"]})
    per_step = step_periods({r: st["steps"] for r, (st, _) in ranks.items()})
    by_rank = {r: {(s["round"], s["index"]): s for s in st["steps"] if not s["warmup"]} for r, (st, _) in ranks.items()}
    median = median_or_none(per_step)
    world = meta["world"]
    if job["schedule"] == "dp":
        samples = meta["micro_batch_size"] * meta["micro_batches"] * world
    else:
        samples = meta["micro_batch_size"] * meta["micro_batches"] * (world // meta["stages"])
    mem = memory_per_rank(ranks)
    cpu = cpu_figures(ranks)
    timings = stage_timings(ranks)
    costs, pred = job_prediction(ranks, job, a, link_bw, timings)
    err = (pred["step_time"] - median) / median if pred.get("step_time") and median else None
    exposed = {str(s): st["exposed_allreduce"] for s, st in timings.items()}
    return {
        "config": job["config"],
        "schedule": job["schedule"],
        "engine_schedule": meta["schedule"],
        "schedule_params": meta.get("schedule_params") or {},
        "world": world,
        "stages": meta["stages"],
        "micro_batches": meta["micro_batches"],
        "micro_batch_size": meta["micro_batch_size"],
        "parts": meta.get("parts"),
        "checkpointed_layers": meta.get("checkpointed_layers"),
        "plan": meta.get("plan"),
        **cpu,
        "timed_steps": len(keys),
        "step_times_s": per_step,
        "median_step_s": median,
        "samples_per_step": samples,
        "throughput_samples_s": samples / median if median else None,
        "loss_last": by_rank[0][keys[-1]]["loss"] if keys and 0 in by_rank else None,
        "memory_per_rank": {str(r): v for r, v in mem.items()},
        "mean_peak_saved_bytes": mean_or_none([v["peak_saved_bytes"] for v in mem.values()]),
        "max_peak_saved_bytes": max((v["peak_saved_bytes"] for v in mem.values()), default=None),
        "mean_peak_rss_bytes": mean_or_none([v["peak_rss_bytes"] for v in mem.values() if v["peak_rss_bytes"]]),
        "mean_peak_training_rss_bytes": mean_or_none(
            [v["peak_training_rss_bytes"] for v in mem.values() if v["peak_training_rss_bytes"]]
        ),
        "max_peak_training_rss_bytes": max((v["peak_training_rss_bytes"] or 0 for v in mem.values()), default=None),
        "mean_state_bytes": mean_or_none([v["state_bytes"] for v in mem.values() if v["state_bytes"]]),
        "core_busy": median_or_none(
            [
                s["core_busy"]
                for st, _ in ranks.values()
                for s in st["steps"]
                if not s["warmup"] and s.get("core_busy") is not None
            ]
        ),
        "stage_timings_s": {str(s): st["median"] for s, st in timings.items()},
        "exposed_allreduce_s_per_step": exposed,
        "delayed_fraction": {str(s): f for s, f in delayed_fractions(ranks).items()},
        "prediction": {**pred, "costs": costs, "error": err},
    }


def cpu_figures(ranks: dict) -> dict:
    """This run's CPU per timed step, from the ranks' step records (``cpu_s``: the rank's CPU time,
    all threads; ``runqueue_wait_s``: the time its threads were runnable but waited for a core):
    per rank the medians over timed steps, their sum over ranks (the CPU a step asks of the
    machine), the median share of the step's wall a rank computed, and the largest share of the
    step a rank's main thread (which runs the instructions) waited for a core. Empty where the
    records predate them. Pure."""
    cpu, wait, share_cpu, share_wait = {}, {}, [], []
    for r, (st, _) in sorted(ranks.items()):
        timed = [s for s in st["steps"] if not s["warmup"] and s.get("cpu_s") is not None]
        if not timed:
            continue
        cpu[str(r)] = statistics.median(s["cpu_s"] for s in timed)
        share_cpu.append(statistics.median(s["cpu_s"] / (s["end"] - s["start"]) for s in timed))
        waits = [s for s in timed if s.get("runqueue_wait_s") is not None]
        if waits:
            wait[str(r)] = statistics.median(s["runqueue_wait_s"] for s in waits)
            share_wait.append(statistics.median(s["runqueue_wait_s"] / (s["end"] - s["start"]) for s in waits))
    if not cpu:
        return {}
    return {
        "cpu_s_per_step": cpu,
        "cpu_s_per_step_all_ranks": sum(cpu.values()),
        "cpu_share_median": statistics.median(share_cpu),
        "runqueue_wait_s_per_step": wait or None,
        "runqueue_wait_share_max": max(share_wait) if share_wait else None,
    }


def memory_per_rank(ranks: dict) -> dict:
    """{rank: peak bytes saved for backward, peak RSS, RSS before the model, training RSS (the
    difference), parameter/gradient/optimizer state bytes} from the ranks' step records."""
    mem = {}
    for r, (st, _) in sorted(ranks.items()):
        m = st.get("memory") or {}
        saved = max((s.get("saved_peak_bytes", 0) for s in st["steps"]), default=0)
        base, hwm = m.get("rss_baseline_bytes"), m.get("peak_rss_bytes")
        mem[r] = {
            "stage": st["stage"],
            "peak_saved_bytes": saved,
            "peak_rss_bytes": hwm,
            "rss_baseline_bytes": base,
            "peak_training_rss_bytes": (hwm - base) if hwm and base else None,
            "state_bytes": m.get("state_bytes"),
        }
    return mem


def job_prediction(ranks: dict, job: dict, a, link_bw: float, timings: dict) -> tuple[dict, dict]:
    """(measured costs, simulated step) of a run: the run's own measured per-stage times +
    parameter bytes + the link (the shaped one across nodes, ``--intra-allreduce-bandwidth`` inside)."""
    meta = next(iter(ranks.values()))[0]
    world = meta["world"]
    dp_width = world if job["schedule"] == "dp" else world // meta["stages"]
    if job.get("nodes", 1) > 1:  # data parallelism across the shaped links
        ar_bw = link_bw * a.link_efficiency
    else:
        ar_bw = a.intra_allreduce_bandwidth
    costs = {
        **measured_costs(timings, a, dp_width, ar_bw, a.p2p_bandwidth, a.p2p_latency),
        "tied_groups": tied_groups(ranks),
    }
    sched_name = {"dp": "1f1b", "1f1b": "1f1b"}.get(job["schedule"], meta["schedule"])
    if job["schedule"] == "dp":
        stages, params = 1, {}
    else:
        stages, params = meta["stages"], meta.get("schedule_params") or {}
    return costs, predict(sched_name, params, stages, meta["micro_batches"], costs, delayed_fractions(ranks))


def tied_groups(ranks: dict) -> list[list[int]]:
    """The stages of each tied module, from the ranks' records (each lists the tied modules it
    holds). Runs recorded before the field existed had none: every bench model is untied."""
    groups = {}
    for st, _ in ranks.values():
        groups.update(st.get("tied_stages") or {})
    return [groups[key] for key in sorted(groups)]


def delayed_fractions(ranks: dict) -> dict[int, float]:
    """{stage: share of its gradient applied one step late} where the engine reports one
    (``engine.delayed_fraction()``, hippie.deferred_layers), from the ranks' step records."""
    return {st["stage"]: st["delayed_fraction"] for st, _ in ranks.values() if st.get("delayed_fraction") is not None}


def round_dirs(base: Path) -> list[tuple[int, Path]]:
    """[(round, directory)] of one schedule's runs in one config: ``base/round<R>/`` when the runs
    came in rounds (--rounds > 1), else ``[(0, base)]`` (a single run, today's layout)."""
    rounds = sorted((int(d.name[5:]), d) for d in base.glob("round*") if d.is_dir() and d.name[5:].isdigit())
    return rounds or [(0, base)]


def combine_rounds(per_round: list[dict | None]) -> dict | None:
    """One schedule's record from its runs' records (``analyse_job``), one per round (None: the
    round's run left no data). Pure.

    * ``median_step_s``: the median over rounds of each round's median step (with one round:
      that round's median, as before rounds existed); ``throughput_samples_s`` from it;
    * ``round_median_step_s`` / ``round_throughput_samples_s``: per round (None where missing);
      ``median_step_s_min``/``_max`` and ``throughput_samples_s_min``/``_max``: over rounds;
    * ``step_times_s``/``timed_steps``: every round's timed steps, in round order;
    * the other figures (memory, stage timings, prediction, loss) are those of ``detail_round``,
      the round whose median is the lower median over rounds; the prediction error is
      recomputed against the median over rounds."""
    valid = [(i, r) for i, r in enumerate(per_round) if r and r.get("median_step_s")]
    if not valid:
        return next((r for r in per_round if r), None)
    meds = [r["median_step_s"] for _, r in valid]
    median = statistics.median(meds)
    detail_i, detail = next((i, r) for i, r in valid if r["median_step_s"] == statistics.median_low(meds))
    samples = detail["samples_per_step"]
    out = dict(detail)
    pred = dict(detail.get("prediction") or {})
    if pred.get("step_time"):
        pred["error"] = (pred["step_time"] - median) / median
    thr = [samples / m for m in meds]
    out.update(
        {
            "median_step_s": median,
            "throughput_samples_s": samples / median,
            "rounds": len(per_round),
            "detail_round": detail_i,
            "round_median_step_s": [r.get("median_step_s") if r else None for r in per_round],
            "round_throughput_samples_s": [r.get("throughput_samples_s") if r else None for r in per_round],
            "round_runqueue_wait_share_max": [r.get("runqueue_wait_share_max") if r else None for r in per_round],
            "round_cpu_s_per_step_all_ranks": [r.get("cpu_s_per_step_all_ranks") if r else None for r in per_round],
            "median_step_s_min": min(meds),
            "median_step_s_max": max(meds),
            "throughput_samples_s_min": min(thr),
            "throughput_samples_s_max": max(thr),
            "step_times_s": [t for _, r in valid for t in r["step_times_s"]],
            "timed_steps": sum(r["timed_steps"] for _, r in valid),
            "prediction": pred,
        }
    )
    return out


def analyse_all(out: Path, a, jobs: list[dict]) -> dict:
    """runs[config][schedule]: each schedule's runs in a config, one per round as found on disk
    (``round_dirs``: so --analyze-only reads either layout whatever --rounds says), combined."""
    link_bw = 1.25e9 if a.no_shape else parse_rate(a.rate)
    runs = {}
    for job in {(j["config"], j["schedule"]): j for j in jobs}.values():
        found = round_dirs(out / "runs" / job["config"] / job["schedule"])
        per_round = [None] * (found[-1][0] + 1)
        for rnd, d in found:
            per_round[rnd] = analyse_job(d, job, a, link_bw)
        r = combine_rounds(per_round)
        if r is not None:
            runs.setdefault(job["config"], {})[job["schedule"]] = r
    return runs
