"""The scaling bench's link calibration: how much of the shaped rate a lone gloo all-reduce gets on
the emulated cluster, measured for the two shapes the runs all-reduce in.

The simulator's link is a fluid: an all-reduce of W bytes over r ranks takes 2(r-1)/r x W / bandwidth,
bandwidth = the shaped rate x a link efficiency. On tbf's FIFO with TCP that efficiency depends on
the collective's shape and size: a 0.5 MB ring of 2 ranks got 0.84-0.90 of 10mbit here, DP's
0.55 MB over 8 ranks on 2 nodes 0.85-0.91 (docs/bench/scaling). So after the runs, per node count, the
bench times (tools/bench/workers/link_worker.py), alone on the link:

* ``stage``: the largest pipeline stage's gradient over its data-parallel group (one rank per node);
* ``stages``: every stage's gradient over its data-parallel group, all at once (what a pipeline's
  step ends with: the stages' all-reduces share each node's link);
* ``all``: DP's whole-model gradient over every rank;

and the analysis gives the simulator the pipeline runs' efficiency from ``stages`` (``stage`` in
calibrations made before it), DP's from ``all`` (``--link-efficiency`` given: that value everywhere
instead). Why ``stages``: a lone flow loses more of tbf's deep queue than several sharing it
(VGG-16, 4 nodes: 0.57 against DP's 0.86), and the simulator already splits the link between
concurrent all-reduces, so it needs the efficiency the link gets when they overlap. Writes
OUT/link.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tools.bench import WORKERS
from tools.bench.analysis import wire_bytes
from tools.bench.cluster import WorkerJob, parse_rate

WORKER = WORKERS / "link_worker.py"
REPEATS = 9


def _params(run_dir: Path, label: str) -> dict[int, int]:
    """{stage: parameters} from a job's step records of ``label``."""
    out = {}
    for f in sorted((run_dir / "raw" / label).glob("rank*.steps.json")):
        rec = json.loads(f.read_text())
        out[rec["stage"]] = rec["params"]
    return out


def plan(out: Path, jobs: list[dict], a) -> list[dict]:
    """Per node count > 1 with runs: what to time (the largest stage, and the bytes of both shapes)
    from the runs' records. Pure but for reading them."""
    by_nodes = {}
    for job in jobs:
        if job["nodes"] < 2 or job["config"] == "one_device":
            continue
        run_dir = out / "runs" / job["dir"]
        entry = by_nodes.setdefault(job["nodes"], {"nodes": job["nodes"], "config": job["config"], "rpn": job["rpn"]})
        for label in job["labels"].split(","):
            params = _params(run_dir, label)
            if not params:
                continue
            if label == "dp":
                entry["all_bytes"] = int(wire_bytes(a) * params[0])
            elif "stage_bytes" not in entry:
                stage = max(params, key=params.get)
                entry.update(stage=stage, stage_bytes=int(wire_bytes(a) * params[stage]))
                entry["stages_bytes"] = [int(wire_bytes(a) * params.get(s, 0)) for s in range(max(params) + 1)]
    return [e for e in by_nodes.values() if "stage_bytes" in e or "all_bytes" in e]


def ring_seconds(nbytes: float, ranks: int, rate_bytes: float) -> float:
    """The simulator's ring all-reduce at the full shaped rate (``Costs.allreduce_time``:
    2(r-1)/r x bytes / rate). Pure."""
    from hippie_ds.schedules.costs import Costs

    comm = {"allreduce_bandwidth": rate_bytes, "data_parallel": ranks}
    return Costs.uniform(1, param_bytes=nbytes, comm=comm).allreduce_time(0)


def summarize(records: list[dict], rate_bytes: float) -> dict:
    """{shape: {ranks, bytes, repeats_s, median_s, efficiency}} from the ranks' records: a repeat
    lasts as long as its slowest rank; efficiency = the fluid ring time / the median. ``stages``:
    the rings of one rank a node share each node's link, so the fluid time is one ring of every
    stage's bytes together over the nodes (``ranks``: the ring's, one a node). Pure."""
    out = {}
    for shape in ("stage", "stages", "all"):
        times = [r[shape] for r in records if r.get(shape)]
        if not times:
            continue
        repeats = [max(t) for t in zip(*times)]
        nbytes = records[0][f"{shape}_bytes"]
        ranks = len(times)
        if shape == "stages":
            nbytes, ranks = sum(nbytes), len(records[0]["stage_ranks"])
        median = statistics.median(repeats)
        ideal = ring_seconds(nbytes, ranks, rate_bytes)
        out[shape] = {
            "ranks": ranks,
            "bytes": nbytes,
            "repeats_s": repeats,
            "median_s": median,
            "efficiency": ideal / median if median > 0 else None,
        }
    return out


def measure(a, out: Path, net, jobs: list[dict], port: int, t0: float) -> dict:
    """Time both shapes per node count on ``net`` (up); writes and returns OUT/link.json's content."""
    result = {
        "rate": a.rate,
        "burst": a.burst,
        "repeats": REPEATS,
        "measured_by": getattr(a, "command", None),
        "by_nodes": {},
    }
    for i, entry in enumerate(plan(out, jobs, a)):
        n, rpn = entry["nodes"], entry["rpn"]
        run_dir = out / "runs" / "link" / entry["config"]
        args = [
            "--out",
            str(run_dir),
            "--rpn",
            str(rpn),
            "--stage",
            str(entry.get("stage", 0)),
            "--stage-bytes",
            str(entry.get("stage_bytes", 4)),
            "--all-bytes",
            str(entry.get("all_bytes", 4)),
            "--stages-bytes",
            ",".join(str(b) for b in entry.get("stages_bytes", [])),
            "--repeats",
            str(REPEATS),
        ]
        cores = [a.core_list[k % len(a.core_list)] for k in range(n)]
        WorkerJob(
            net,
            WORKER,
            args,
            run_dir / "logs",
            n,
            rpn,
            cores,
            port + i,
            t0=t0,
            tag=f"link {n}",
            accelerator=a.accelerator,
            device_count=a.device_count,
        ).run(a.timeout)
        records = [json.loads(f.read_text()) for f in sorted(run_dir.glob("rank*.json"))]
        shapes = summarize(records, parse_rate(a.rate))
        if "stage_bytes" not in entry:
            shapes.pop("stage", None)
            shapes.pop("stages", None)
        if "all_bytes" not in entry:
            shapes.pop("all", None)
        result["by_nodes"][str(n)] = {"stage_index": entry.get("stage"), **shapes}
    (out / "link.json").write_text(json.dumps(result, indent=1))
    return result


def load(out: Path) -> dict | None:
    path = out / "link.json"
    return json.loads(path.read_text()) if path.exists() else None


def efficiency(link: dict | None, nodes: int, schedule: str) -> float | None:
    """The measured efficiency for a run: DP's from ``all``, a pipeline's from ``stages`` (``stage``
    where a calibration has no ``stages``); None when not measured. Pure."""
    entry = (link or {}).get("by_nodes", {}).get(str(nodes)) or {}
    shapes = ("all",) if schedule == "dp" else ("stages", "stage")
    for shape in shapes:
        if (entry.get(shape) or {}).get("efficiency") is not None:
            return entry[shape]["efficiency"]
    return None
