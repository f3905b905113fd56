"""The analysis of ``tools/bench.py hidden-comm``'s run: per schedule the step times, the time each
rank's instruction stream spends per instruction group (compute, p2p, exposed all-reduce,
optimizer, ...), how long the all-reduce was outstanding, the CPU other processes used per step;
Chrome traces and Gantt charts; results.json and results.md."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from cluster import foreign_cpu_between
from ..analysis import load_run

GROUPS = {
    "compute": {"ForwardPass", "BackwardPass", "ForwardBackwardPass"},
    "p2p": {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ISendActivation", "ISendGrad", "WaitSends"},
    "allreduce": {"ReduceGrads", "ReduceTiedGrads", "StartAllReduce", "WaitAllReduce"},
    "optimizer": {"OptimizerStep", "StageOptimizerStep", "ApplyBufferedUpdate"},
    "buffer_copy": {"CopyGradsToBuffer"},
    "load": {"LoadMicroBatch"},
}
TRACE_CATEGORY = {"ForwardPass": "forward", "BackwardPass": "backward", "ForwardBackwardPass": "forward_backward",
                  "CopyGradsToBuffer": "buffer", "LoadMicroBatch": "load"}
for _g, _cat in (("p2p", "p2p"), ("allreduce", "allreduce"), ("optimizer", "optimizer")):
    TRACE_CATEGORY.update({k: _cat for k in GROUPS[_g]})


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def load_raw(out: Path):
    """(done.json, {label: {rank: (steps record, timeline)}}) of the worker's files under ``out/raw``."""
    done = json.loads((out / "raw" / "done.json").read_text())
    return done, {label: load_run(out, label) for label in done["labels"]}


def _target(name):
    """'grads' or 'buffer' from an instruction's name: DeepSpeed-style repr
    ``StartAllReduce(target='buffer')`` or the engine's op name ``start_allreduce(buffer)``."""
    m = re.search(r"target='(\w+)'|\((grads|buffer)\)", name)
    return (m.group(1) or m.group(2)) if m else "grads"


def analyse_rank(steps, tl):
    """Per timed step of one rank: duration, time per instruction group, all-reduce spans;
    plus the rank's events on the absolute clock (for traces)."""
    t0 = steps["t0"]
    if t0 is None:
        raise RuntimeError(f"rank {steps['rank']} ({steps['label']}): no timeline origin recorded")
    # The rank's instruction stream only: the engine also writes comm-track events of its own
    # ("AllReduceInFlight", category 'comm'); the spans are recomputed below for every engine alike.
    events = sorted(({**e, "start": e["start"] + t0, "end": e["end"] + t0} for e in tl["events"]
                     if e.get("category") != "comm" and e["kind"] != "AllReduceInFlight"), key=lambda e: e["start"])
    spans, open_ = [], {}
    for e in events:  # all-reduce outstanding: StartAllReduce start -> matching WaitAllReduce end
        if e["kind"] == "StartAllReduce":
            open_[_target(e["name"])] = e
        elif e["kind"] == "WaitAllReduce" and _target(e["name"]) in open_:
            s = open_.pop(_target(e["name"]))
            spans.append({"target": _target(e["name"]), "start": s["start"], "end": e["end"]})
        elif e["kind"] in ("ReduceGrads", "ReduceTiedGrads"):
            spans.append({"target": "grads", "start": e["start"], "end": e["end"]})
    per_step = []
    for st in steps["steps"]:
        mine = [e for e in events if st["start"] <= e["start"] < st["end"]]
        groups = {g: sum(e["end"] - e["start"] for e in mine if e["kind"] in kinds) for g, kinds in GROUPS.items()}
        busy = sum(e["end"] - e["start"] for e in mine)
        last_end = max((e["end"] for e in mine), default=st["start"])
        per_step.append({**st, "duration": st["end"] - st["start"], **groups,
                         "other": st["end"] - st["start"] - busy, "after_schedule": st["end"] - last_end,
                         "allreduce_span": sum(s["end"] - s["start"] for s in spans
                                               if st["start"] <= s["start"] < st["end"]),
                         "events": mine,
                         "spans": [s for s in spans if st["start"] <= s["start"] < st["end"]]})
    return per_step


def analyse(out: Path, args_record: dict | None = None, wall_s: float | None = None, quiet_below: float = 0.1):
    """results.json and results.md (returned) of a run under ``out``, traces in ``out/traces``."""
    done, runs = load_raw(out)
    noise = out / "raw" / "foreign_cpu.json"
    cpu_samples = json.loads(noise.read_text())["samples"] if noise.exists() else []
    results = {"schedules": {}, "config": args_record or {}, "wall_s": wall_s, "quiet_below_cores": quiet_below,
               "counted_as_exposed_allreduce": sorted(GROUPS["allreduce"]),
               "not_counted": sorted(GROUPS["optimizer"] | GROUPS["buffer_copy"]) + ["loss all-reduce/broadcast "
                                                                                      "after the schedule"]}
    (out / "traces").mkdir(parents=True, exist_ok=True)
    for label, ranks in runs.items():
        results["schedules"][label] = analyse_label(out, label, ranks, results["config"], cpu_samples, quiet_below)
    stock = results["schedules"].get("stock")
    for r in results["schedules"].values():
        r["ratio_to_stock_1f1b"] = r["median_step_s"] / stock["median_step_s"] if stock else None
        r["ratio_rank0_to_stock_1f1b"] = r["median_step_rank0_s"] / stock["median_step_rank0_s"] if stock else None
        r["ratio_quiet_to_stock_1f1b"] = (r["median_step_quiet_s"] / stock["median_step_quiet_s"]
                                          if stock and r["median_step_quiet_s"] and stock["median_step_quiet_s"]
                                          else None)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "results.md").write_text(md)
    return results, md


def analyse_label(out: Path, label: str, ranks: dict, cfg: dict, cpu_samples: list, quiet_below: float) -> dict:
    """One schedule's figures: step times (slowest rank's and rank 0's), throughput, per-stage
    breakdown, foreign CPU per step and the quiet steps; writes its traces."""
    per_rank = {r: analyse_rank(s, tl) for r, (s, tl) in ranks.items()}
    meta = {r: s for r, (s, _) in ranks.items()}
    timed = {r: [x for x in ps if not x["warmup"]] for r, ps in per_rank.items()}
    keys = sorted({(x["round"], x["index"]) for x in timed[0]})
    by_key = {r: {(x["round"], x["index"]): x for x in xs} for r, xs in timed.items()}
    per_step_max = [max(by_key[r][k]["duration"] for r in by_key) for k in keys]
    rank0 = [by_key[0][k]["duration"] for k in keys]
    dp = len({m["data_parallel_id"] for m in meta.values()})
    samples = cfg.get("micro_batch_size", 0) * cfg.get("micro_batches", 0) * dp
    med = statistics.median(per_step_max) if per_step_max else float("nan")
    spans = [(min(by_key[r][k]["start"] for r in by_key), max(by_key[r][k]["end"] for r in by_key)) for k in keys]
    foreign = [foreign_cpu_between(cpu_samples, a, b) / (b - a) for a, b in spans] if cpu_samples else []
    record = {
        "schedule": meta[0]["schedule"], "params": meta[0]["schedule_params"],
        "timed_steps": len(keys), "step_time_max_over_ranks_s": per_step_max, "step_time_rank0_s": rank0,
        "median_step_s": med, "median_step_rank0_s": statistics.median(rank0) if rank0 else float("nan"),
        "mean_step_s": _mean(per_step_max), "min_step_s": min(per_step_max, default=float("nan")),
        "max_step_s": max(per_step_max, default=float("nan")),
        "samples_per_step": samples, "throughput_samples_s": samples / med if med else None,
        "loss_first_timed": by_key[0][keys[0]]["loss"] if keys else None,
        "loss_last_timed": by_key[0][keys[-1]]["loss"] if keys else None,
        "per_stage": {str(s): st for s, st in sorted(per_stage(meta, timed).items())},
        # Cores' worth of CPU used by other processes during each timed step (0 = quiet machine).
        "foreign_cpu_cores_per_step": foreign,
        "foreign_cpu_cores_mean": _mean(foreign) if foreign else None,
    }
    quiet = [d for d, f in zip(per_step_max, foreign) if f < quiet_below]
    record.update({"quiet_steps": len(quiet), "median_step_quiet_s": statistics.median(quiet) if quiet else None})
    write_traces(out, label, meta, timed, keys)
    return record


def per_stage(meta: dict, timed: dict) -> dict:
    """{stage: its ranks, parameters, mean seconds per step of each instruction group, exposed
    all-reduce (mean, median, per rank)} over the timed steps of the stage's ranks."""
    stages = {}
    for r, xs in timed.items():
        st = stages.setdefault(meta[r]["stage"], {"ranks": [], "params": meta[r]["params"], "_xs": []})
        st["ranks"].append(r)
        st["_xs"].extend(xs)
    for s, st in stages.items():
        xs = st.pop("_xs")
        for g in list(GROUPS) + ["other", "after_schedule", "allreduce_span"]:
            st[f"{g}_s"] = _mean([x[g] for x in xs])
        st["exposed_allreduce_s"] = st.pop("allreduce_s")
        st["exposed_allreduce_median_s"] = statistics.median([x["allreduce"] for x in xs]) if xs else 0.0
        st["exposed_allreduce_per_rank_s"] = {r: _mean([x["allreduce"] for x in timed[r]]) for r in st["ranks"]}
    return stages


def _trace_events(meta, steps):
    evs = []
    for r, xs in steps.items():
        for x in xs:
            for e in x["events"]:
                evs.append({"rank": r, "stage": meta[r]["stage"], "name": e["name"],
                            "category": TRACE_CATEGORY.get(e["kind"], "other"), "start": e["start"], "end": e["end"]})
            for s in x["spans"]:
                evs.append({"rank": r, "stage": meta[r]["stage"], "name": f"allreduce {s['target']} (outstanding)",
                            "category": "comm", "start": s["start"], "end": s["end"]})
            last = max((e["end"] for e in x["events"]), default=x["start"])
            evs.append({"rank": r, "stage": meta[r]["stage"], "name": "after schedule (loss all-reduce + broadcast)",
                        "category": "sync", "start": last, "end": x["end"]})
    return evs


def _from_zero(evs: list[dict]) -> list[dict]:
    """The events, shifted in place so that the first starts at 0 (the trace's time axis)."""
    origin = min(e["start"] for e in evs)
    for e in evs:
        e["start"] -= origin
        e["end"] -= origin
    return evs


def write_traces(out: Path, label, meta, timed, keys):
    from hippie_ds.schedules.trace import chrome_trace, timeline_png
    names = {r: f"rank {r}: node {r // 2}, stage {meta[r]['stage']}, replica {meta[r]['data_parallel_id']}"
             for r in meta}
    evs = _trace_events(meta, timed)
    if not evs:
        return
    chrome_trace(_from_zero(evs), out / "traces" / f"{label}.json", process_names=names)
    last = set(keys[-2:])
    tail = {r: [x for x in xs if (x["round"], x["index"]) in last] for r, xs in timed.items()}
    evs = _from_zero(_trace_events(meta, tail))
    try:
        timeline_png(evs, out / "traces" / f"{label}.png", title=f"{label}: last two timed steps (s)")
    except ImportError:  # matplotlib missing: the Chrome trace is enough
        pass


def markdown(results):
    sch = results["schedules"]
    stage_ids = sorted({s for r in sch.values() for s in r["per_stage"]}, key=int)
    cfg = results["config"]
    lines = []
    first = next(iter(sch.values()), None)
    params = ", ".join(f"stage {s}: {st['params'] / 1e6:.2f}M" for s, st in first["per_stage"].items()) if first else "?"
    if cfg:
        lines += [f"Emulated 2 nodes x 2 ranks, link {cfg.get('link')}, {cfg.get('micro_batches')} micro-batches of "
                  f"{cfg.get('micro_batch_size')} x {cfg.get('seq')} tokens, parameters {params} "
                  f"per stage (fp32 AdamW), {cfg.get('warmup')} warm-up + {cfg.get('rounds')} rounds x "
                  f"{cfg.get('steps')} timed steps per schedule.", ""]
    head = ["schedule", "deferred", "median step (s)", "rank 0 median (s)", "vs stock 1F1B", "samples/s"]
    head += [f"exposed all-reduce stage {s} (s/step)" for s in stage_ids] + ["foreign CPU (cores)",
                                                                             "quiet steps: median (s) [n]",
                                                                             "quiet: vs stock"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in sch.items():
        deferred = r["params"].get("deferred_stages", "-") if r["params"] else "-"
        ratio = f"{r['ratio_to_stock_1f1b']:.3f}x" if r.get("ratio_to_stock_1f1b") is not None else "-"
        row = [label if label != "stock" else "stock DeepSpeed 1F1B", str(deferred), f"{r['median_step_s']:.3f}",
               f"{r['median_step_rank0_s']:.3f}", ratio, f"{r['throughput_samples_s']:.2f}"]
        row += [f"{r['per_stage'][s]['exposed_allreduce_s']:.3f}" if s in r["per_stage"] else "-" for s in stage_ids]
        fc = r.get("foreign_cpu_cores_mean")
        row.append("-" if fc is None else f"{fc:.2f}")
        mq, rq = r.get("median_step_quiet_s"), r.get("ratio_quiet_to_stock_1f1b")
        row.append("-" if mq is None else f"{mq:.3f} [{r['quiet_steps']}/{r['timed_steps']}]")
        row.append("-" if rq is None else f"{rq:.3f}x")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Per stage, seconds per step (mean over timed steps and the stage's replicas):", ""]
    head = ["schedule", "stage", "compute", "p2p", "exposed all-reduce", "all-reduce outstanding", "optimizer",
            "buffer copy", "after schedule", "step (mean)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in sch.items():
        for s in stage_ids:
            st = r["per_stage"].get(s)
            if st is None:
                continue
            lines.append("| " + " | ".join([label, s] + [f"{st[k]:.3f}" for k in (
                "compute_s", "p2p_s", "exposed_allreduce_s", "allreduce_span_s", "optimizer_s", "buffer_copy_s",
                "after_schedule_s")] + [f"{r['mean_step_s']:.3f}"]) + " |")
    lines += ["", "median step = median over timed steps of the slowest rank's train_batch time; exposed all-reduce = "
              "time in ReduceGrads/StartAllReduce/WaitAllReduce; all-reduce outstanding = StartAllReduce start to "
              "WaitAllReduce end (ReduceGrads: its duration); after schedule = train_batch's loss all-reduce and "
              "pipeline broadcast after the last instruction (waiting for the last stage); foreign CPU = cores' "
              "worth of CPU used by processes outside the benchmark during the schedule's timed steps (mean; "
              f"anything above ~0.05 slows the 4 ranks on 2 cores and makes the comparison noisy); quiet steps = "
              f"timed steps with foreign CPU below {results.get('quiet_below_cores', 0.1)} cores."]
    noisy = {l: r["foreign_cpu_cores_mean"] for l, r in sch.items() if (r.get("foreign_cpu_cores_mean") or 0) > 0.05}
    if noisy:
        lines.append("WARNING: other processes competed for the CPU during " + ", ".join(
            f"{l} ({v:.2f} cores)" for l, v in noisy.items()) + "; rerun on a quiet machine.")
    if results.get("wall_s") is not None:
        lines.append(f"Wall time of the benchmark: {results['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"
