"""Every row of ``python -m tools.bench scaling`` a figure: each row (one schedule of one job) at a
time dilation D where its ranks are host-free.

At D every device time and transfer is D x longer and the host's CPU per instruction is not, so a
row whose rank waited for a core more than WAITED_FOR_CORE of a step at D measured the machine: the
host it emulates (D x cores / ranks on a core) is too small for that schedule. Such a row is rerun
alone (a job of that schedule only, the same nodes, rounds and steps) at 2D, then 4D, ... up to
``--max-dilate`` (D_MAX, 64), until it is host-free; its figure is the first D's at which it was, or,
if none was up to the limit, the last D's, flagged with its wait. A planned column is rerun with the
plan made at the job's D: the row is that plan, as the others are their schedule. (Planned afresh at
2D, the planner, which sees each rank's share of the host at that D, spent the host 2D frees on more
micro-batches, and the new plan waited as much: GNMT-16's ME plan went 16 x 32, 32 x 16, 64 x 8 from
D = 16 to 64, waiting 6.7%, 5.5%, 5.8%.) Stock 1F1B is flat in D (tools/bench/studies/dilation.py),
so rows at different D compare; ratios, scaling and ME take each row's times / its own D.

The runs at the job's D stay in OUT/runs/JOB/; a rerun at D lies in OUT/runs/D<D>/ROW/ (ROW: the job's
directory, ``_SCHEDULE`` appended where the job ran several).
Which D a row took is read back from those records (:func:`chosen_run`), so ``--analyze-only`` and
``--resume`` (a rerun that finished is not run again) come to the same D as the run did.
"""

from __future__ import annotations

import copy
from pathlib import Path

from tools.bench.analysis import cpu_figures, load_run
from tools.bench.labels import engine_label
from tools.bench.studies.scaling_plan import PLANNED
from tools.bench.studies.scaling_summary import WAITED_FOR_CORE

D_MAX = 64.0


def dilations(base: float, d_max: float = D_MAX) -> list[float]:
    """The D a row may run at: ``base``, then 2 x, 4 x ... while at most ``d_max``. Pure."""
    out = [base]
    while out[-1] * 2 <= d_max:
        out.append(out[-1] * 2)
    return out


def host_free(wait: float | None) -> bool:
    """A row with no wait recorded counts as host-free: nothing says it measured the machine. Pure."""
    return wait is None or wait <= WAITED_FOR_CORE


def rerun_base(out: Path, d: float) -> Path:
    return out / "runs" / f"D{d:g}"


def row_dir(out: Path, job: dict, schedule: str, d: float, base: float) -> Path:
    """Where the row's run at ``d`` lies: the job's own directory at the job's D ``base``. Pure."""
    if d == base:
        return out / "runs" / job["dir"]
    return rerun_base(out, d) / (job["dir"] if len(job["schedules"]) == 1 else f"{job['dir']}_{schedule}")


def row_job(job: dict, schedule: str, plan: dict | None) -> dict:
    """The job that runs only ``schedule`` of ``job``, a planned column with ``plan`` (the job's). Pure."""
    one = {**job, "schedules": [schedule]}
    if schedule in PLANNED:
        return {**one, "labels": plan["schedule"] if plan else schedule, "plan": plan}
    return {**one, "labels": engine_label(schedule)}


def row_label(job: dict, schedule: str) -> str:
    """The label directory (RUN/raw/LABEL) the row's ranks wrote. Pure."""
    return job["labels"] if schedule in PLANNED or schedule == "dp" else engine_label(schedule)


def at_dilation(a, d: float):
    """The study's options with D = ``d`` (the job's others unchanged)."""
    b = copy.copy(a)
    b.dilate = d
    return b


def row_wait(run_dir: Path, label: str) -> float | None:
    """The largest share of a timed step a rank's main thread waited for a core, worst round (each
    round: the worst rank's median over its timed steps, analysis.cpu_figures): the report's flag
    (scaling_summary.cpu_fields). None without records."""
    ranks = load_run(run_dir, label) if (run_dir / "raw").is_dir() else {}
    rounds = sorted({s.get("round", 0) for st, _ in ranks.values() for s in st.get("steps", []) if not s["warmup"]})
    waits = []
    for r in rounds:
        one = {
            k: ({**st, "steps": [s for s in st["steps"] if not s["warmup"] and s.get("round", 0) == r]}, tl)
            for k, (st, tl) in ranks.items()
        }
        waits.append(cpu_figures(one).get("runqueue_wait_share_max"))
    waits = [w for w in waits if w is not None]
    return max(waits) if waits else None


def done(run_dir: Path) -> bool:
    return (run_dir / "raw" / "done.json").exists()


def rerun_rows(a, out: Path, job: dict, run, log=print) -> dict:
    """After ``job`` ran at ``a.dilate``: every row whose rank waited for a core more than
    WAITED_FOR_CORE is rerun alone at 2D, 4D ... (``dilations`` up to ``a.max_dilate``) until it is
    host-free, a planned column with the job's plan. ``run(options at D, the row's job, its run
    directory)`` runs one job. With ``a.resume`` a rerun that finished (raw/done.json) is not run
    again. Returns {schedule: [(D, wait)]} (every D the row ran at, in order)."""
    tried = {}
    for s in job["schedules"]:
        steps = dilations(a.dilate, getattr(a, "max_dilate", D_MAX))
        run_dir, one = row_dir(out, job, s, a.dilate, a.dilate), job
        tried[s] = [(a.dilate, row_wait(run_dir, row_label(one, s)))]
        for d in steps[1:]:
            if host_free(tried[s][-1][1]):
                break
            log(
                f"{job['dir']} {s}: a rank waited for a core {tried[s][-1][1]:.1%} of a step at D = "
                f"{tried[s][-1][0]:g} (> {WAITED_FOR_CORE:.0%}): rerun alone at D = {d:g}",
                flush=True,
            )
            one = row_job(job, s, job.get("plan"))
            run_dir = row_dir(out, job, s, d, a.dilate)
            if a.resume and done(run_dir):
                log(f"{run_dir.relative_to(out)}: done in an earlier run (--resume)", flush=True)
            else:
                run(at_dilation(a, d), one, run_dir)
            tried[s].append((d, row_wait(run_dir, row_label(one, s))))
        if not host_free(tried[s][-1][1]):
            log(
                f"{job['dir']} {s}: still waited {tried[s][-1][1]:.1%} at D = {tried[s][-1][0]:g}, the largest "
                f"allowed: kept, flagged",
                flush=True,
            )
    return tried


def chosen_run(a, out: Path, job: dict, schedule: str) -> tuple[float, Path, dict, list]:
    """The row's figure, read back from the records: (D, run directory, the row's job (a planned
    column: with the job's plan), [(D, wait)] of every D it ran at up to that one): the first D at which
    it was host-free, else the last D it ran at. Pure but for reading the records."""
    d_max = getattr(a, "max_dilate", D_MAX)
    chosen = (a.dilate, row_dir(out, job, schedule, a.dilate, a.dilate), job)
    tried = [(a.dilate, row_wait(chosen[1], row_label(job, schedule)))]
    for d in dilations(a.dilate, d_max)[1:]:
        run_dir = row_dir(out, job, schedule, d, a.dilate)
        if host_free(tried[-1][1]) or not (run_dir / "raw").is_dir():
            break
        one = row_job(job, schedule, job.get("plan"))
        chosen = (d, run_dir, one)
        tried.append((d, row_wait(run_dir, row_label(one, schedule))))
    return (*chosen, tried)


def row_plans(a, out: Path, jobs: list[dict]) -> dict:
    """{(nodes, name): the plan record} of every planned column (the plan made at the job's D), with
    the D its figure was taken at."""
    plans = dict(getattr(a, "planned", {}) or {})
    for job in jobs:
        for s in job["schedules"]:
            if s in PLANNED:
                d, _, one, _ = chosen_run(a, out, job, s)
                if one.get("plan"):
                    plans[(job["nodes"], s)] = {**one["plan"], "dilation": d}
    return plans
