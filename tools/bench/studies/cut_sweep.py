"""Measure, then choose: train a plan's top candidates on the real job and rank them by measured step:
the check on the planner's ranking that a prediction alone cannot give.

    python -m tools.bench cut-sweep --out out/cut-sweep                       # profile, plan, sweep
    python -m tools.bench cut-sweep --out DIR --plan plan.json --profile profile.yaml

The job is the GPT example (tools/examples/train_gpt.py) on ``--ranks`` local ranks, launched by
:class:`tools.bench.cluster.LocalJob`. Without ``--plan`` the sweep first makes one: the job profiles
itself in place (``hippie.profile``, ``--stages`` x ranks/stages, ``--micro-batch``,
``--global-batch``) into DIR/profile.yaml and ``hippie-ds plan`` plans it for ``--cluster`` (keeping the
job's shape) into DIR/plan.json. The candidates are the plan (candidate 0) and its first ``--top``
- 1 runner-ups (``Plan.candidates``: other cuts, other configurations; ``--only cut``: the other
cuts of the plan's configuration, each boundary moved by up to 2 layers, by predicted step; ``--only
job``: the plan and the job as it is, the profiled job's own config without a plan), each
written as a plan file of its own (DIR/candidates/cN.json: ``make_plan`` with the candidate's depth, micro-batch size,
schedule and boundaries). Then ``--rounds`` rounds train every candidate once, ``--steps`` steps from
the same seed, the order rotated from round to round (round r starts at candidate r), so the
machine's drift lands on every candidate alike; a run's measured step is the median of its steps
after the first ``--skip``. DIR/sweep.json and DIR/report.md hold measured against predicted ranking
(:mod:`tools.bench.studies.cut_sweep_report`; beside the medians, each candidate's lower quartile
of all its timed steps: on a busy machine, the steps the job had the cores). When the measured best is not the plan,
DIR/measured_best_plan.json is the measured best's plan file (train with it: ``"hippie": {"plan":
...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from tools.bench.studies.cut_sweep_report import report, summarize

WORKER = "tools/examples/train_gpt.py"
JOB_SCHEDULE = "1f1b"  # the schedule the job profiles itself with (profile_and_plan), the job as it is
BASE_CONFIG = {
    "steps_per_print": 10**6,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01, "torch_adam": True}},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench cut-sweep",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--out", required=True, help="profile, plan, candidates, runs, sweep.json and report.md go here")
    p.add_argument("--plan", help="a plan file to sweep (with --profile, the profile it was made from)")
    p.add_argument("--profile", help="the profile the plan was made from")
    p.add_argument("--ranks", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages of the profiled job (default 2)")
    p.add_argument("--micro-batch", type=int, default=4, help="the profiled job's micro-batch size (default 4)")
    p.add_argument("--global-batch", type=int, default=16, help="the profiled job's global batch (default 16)")
    p.add_argument("--profile-steps", type=int, default=3, help="hippie.profile steps (default 3)")
    p.add_argument("--cluster", default=None, help="hippie-ds plan's --cluster (default 1xRANKS,16GB,10Gbit)")
    p.add_argument(
        "--top", type=int, default=4, help="candidates trained: the plan and its best runner-ups (default 4)"
    )
    p.add_argument(
        "--only",
        choices=["all", "cut", "every-cut", "job"],
        default="all",
        help="the candidates: the plan's runner-ups as it lists them (all), or only other cuts of its "
        "configuration: every boundary moved by up to 2 layers, planned and ranked by predicted step "
        "(cut), or every position of each boundary, the others kept (every-cut: at 2 stages every "
        "single-boundary cut; --top does not cap it), or the job as it is: the profiled job's own "
        "config, no plan (job: the plan against what it would replace)",
    )
    p.add_argument(
        "--schedules", default=None, help="hippie-ds plan's --schedules (e.g. zb-h1 or 1f1b; default: its own)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, order rotated (default 3)")
    p.add_argument("--steps", type=int, default=25, help="training steps per run (default 25)")
    p.add_argument("--skip", type=int, default=5, help="untimed first steps of a run (default 5)")
    p.add_argument("--model-args", default="--layers 8", help="train_gpt.py's model options (default: %(default)s)")
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="the model's vocabulary (train_gpt.py --vocab, added to --model-args), e.g. 32000",
    )
    p.add_argument(
        "--launcher",
        choices=["deepspeed", "fork"],
        default="deepspeed",
        help="how the ranks start (LocalJob; default: DeepSpeed's launcher, as a user runs it)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    args = p.parse_args(argv)
    if args.vocab is not None:
        args.model_args = f"{args.model_args} --vocab {args.vocab}"
    if (args.plan is None) != (args.profile is None):
        p.error("--plan and --profile come together (the candidates' plans are made from the profile)")
    if args.top < 1 or args.rounds < 1 or args.steps <= args.skip or args.skip < 0:
        p.error(
            f"--top {args.top}, --rounds {args.rounds}, --steps {args.steps}, --skip {args.skip}: need --top >= 1, "
            "--rounds >= 1 and 0 <= --skip < --steps"
        )
    return args


def _job(args, argv: list, log: Path):
    from tools.bench.cluster import LocalJob

    log.parent.mkdir(parents=True, exist_ok=True)
    run = LocalJob(WORKER, args.ranks, argv, launcher=args.launcher).run(args.timeout, log=log)
    if run.returncode != 0:
        tail = log.read_text().splitlines()[-30:] if log.exists() else []
        raise SystemExit(
            f"cut-sweep: {WORKER} {' '.join(map(str, argv))} exited {run.returncode}"
            f"{' (timed out)' if run.timed_out else ''}; log {log}:\n" + "\n".join(tail)
        )
    return run


def profile_and_plan(args, out: Path) -> tuple[Path, Path]:
    """The job profiles itself in place; hippie-ds plan plans it (keeping its shape)."""
    config = dict(
        BASE_CONFIG,
        train_batch_size=args.global_batch,
        train_micro_batch_size_per_gpu=args.micro_batch,
        pipeline={"schedule": JOB_SCHEDULE},
        hippie={"profile": {"out": str(out / "profile.yaml"), "steps": args.profile_steps, "name": "gpt-example"}},
    )
    (out / "profile_config.json").write_text(json.dumps(config, indent=1))
    _job(
        args,
        [
            "--deepspeed_config",
            out / "profile_config.json",
            "--stages",
            args.stages,
            "--steps",
            args.profile_steps + 1,
            "--out",
            out / "runs" / "profile",
            "--eval-batches",
            1,
            "--timeline-steps",
            1,
            *shlex.split(args.model_args),
        ],
        out / "profile.log",
    )
    cluster = args.cluster or f"1x{args.ranks},16GB,10Gbit"
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "hippie_ds.cli",
            "plan",
            "--profile",
            str(out / "profile.yaml"),
            "--cluster",
            cluster,
            "--out",
            str(out / "plan.json"),
            *(["--schedules", args.schedules] if args.schedules else []),
        ],
        capture_output=True,
        text=True,
    )
    (out / "plan.txt").write_text(plan.stdout + plan.stderr)
    if plan.returncode != 0:
        raise SystemExit(f"cut-sweep: hippie-ds plan failed:\n{plan.stderr}")
    print(plan.stdout + plan.stderr, flush=True)
    return out / "plan.json", out / "profile.yaml"


def every_cut(parts: list[int]) -> list[list[int]]:
    """Every partition with one interior boundary of ``parts`` at another position between its
    neighbours, the others kept (at 2 stages: every single-boundary cut but the plan's)."""
    out = []
    for i in range(1, len(parts) - 1):
        for position in range(parts[i - 1] + 1, parts[i + 1]):
            if position != parts[i]:
                out.append(parts[:i] + [position] + parts[i + 1 :])
    return out


def candidate_plans(
    plan_path: Path, profile_path: Path, top: int, out: Path, only: str = "all", job: tuple[int, int] | None = None
) -> list[dict]:
    """The plan and its first ``top`` - 1 runner-ups (``only='cut'``: its configuration's neighbouring
    cuts by predicted step), each as a plan file: [{label, kind, ..., path}]; ``only='job'``: the plan
    and the job as it is (``job``: its stages and micro-batch size; no plan file, path None)."""
    from hippie_ds.planner import load_plan, load_profile, make_plan, save_plan
    from hippie_ds.planner.candidates import neighbour_cuts

    plan, profile = load_plan(plan_path), load_profile(profile_path)
    plan.check_matches(profile)
    (out / "candidates").mkdir(parents=True, exist_ok=True)
    if only == "job":
        return [plan_row(plan, plan_path), job_row(plan, out, *job)]

    def planned(schedule, depth, micro_batch_size, boundaries):
        return make_plan(
            profile,
            plan.cluster,
            plan.global_batch,
            objective=plan.objective,
            memory_cap=plan.memory_cap,
            schedules=[schedule],
            depths=[depth],
            micro_batch_sizes=[micro_batch_size],
            boundaries=boundaries,
            state_factor=plan.assumptions.get("state_factor"),
            memory_metric=plan.memory_metric,
            staleness_price=plan.assumptions.get("staleness_price"),
            baselines=False,
            candidates=0,
        )

    def step(p):
        return p.ranked_step(p.prediction.step_time, p.prediction.steps_factor)

    if only in ("cut", "every-cut"):
        cuts = neighbour_cuts(plan.boundaries) if only == "cut" else every_cut(plan.boundaries)
        made = [
            ("cut", planned(plan.schedule, plan.pipeline_depth, plan.micro_batch_size, parts))
            for parts in (cuts if plan.virtual_stages == 1 else [])
        ]
        made.sort(key=lambda x: (step(x[1]), x[1].boundaries))
        top = len(made) + 1 if only == "every-cut" else top
    else:
        made = [
            (c.kind, planned(c.schedule, c.pipeline_depth, c.micro_batch_size, c.boundaries))
            for c in plan.candidates[: top - 1]
        ]
    rows = [plan_row(plan, plan_path)]
    for i, (kind, p) in enumerate(made[: top - 1], 1):
        path = out / "candidates" / f"c{i}.json"
        save_plan(p, path)
        rows.append(
            dict(
                label=f"{kind} {i}",
                kind=kind,
                schedule=p.schedule,
                boundaries=p.boundaries,
                micro_batch_size=p.micro_batch_size,
                pipeline_depth=p.pipeline_depth,
                predicted_step=step(p),
                path=str(path),
            )
        )
    return rows


def plan_row(plan, path: Path) -> dict:
    """The plan as candidate 0."""
    return dict(
        label="plan",
        kind="plan",
        schedule=plan.schedule,
        boundaries=plan.boundaries,
        micro_batch_size=plan.micro_batch_size,
        pipeline_depth=plan.pipeline_depth,
        predicted_step=plan.ranked_step(plan.prediction.step_time, plan.prediction.steps_factor),
        path=str(path),
    )


def job_row(plan, out: Path, stages: int, micro: int, schedule: str = JOB_SCHEDULE) -> dict:
    """The job as it is: the profiled job's own config (``--stages``, ``--micro-batch``, the profile
    run's schedule, the example's uniform partition, no plan), written as OUT/job_config.json, with
    the plan's prediction of it (its ``job:uniform`` row under that schedule)."""
    row = next(
        (
            b
            for b in plan.baselines
            if (b.name, b.schedule, b.pipeline_depth, b.micro_batch_size) == ("job:uniform", schedule, stages, micro)
            and b.prediction is not None
        ),
        None,
    )
    if row is None:
        raise SystemExit(
            f"cut-sweep --only job: the plan has no job:uniform row under {schedule!r} at {stages} stages, "
            f"micro-batch {micro} (plan it from the job's in-place profile)"
        )
    config = dict(
        BASE_CONFIG,
        train_batch_size=plan.global_batch,
        train_micro_batch_size_per_gpu=micro,
        pipeline={"schedule": schedule},
    )
    (out / "job_config.json").write_text(json.dumps(config, indent=1))
    return dict(
        label="job as it is",
        kind="job",
        schedule=schedule,
        boundaries=list(row.boundaries),
        micro_batch_size=micro,
        pipeline_depth=stages,
        predicted_step=row.prediction.step_time,
        path=None,
        config=str(out / "job_config.json"),
    )


def measure(args, candidates: list[dict], out: Path) -> tuple[list[list[float]], list[list[float]]]:
    """``--rounds`` rounds of every candidate, order rotated: per candidate its measured step per round,
    and every timed step of its runs."""
    import statistics

    (out / "config.json").write_text(json.dumps(BASE_CONFIG, indent=1))
    measured: list[list[float]] = [[] for _ in candidates]
    timed: list[list[float]] = [[] for _ in candidates]
    n = len(candidates)
    for r in range(args.rounds):
        for c in [(r + k) % n for k in range(n)]:
            run_dir = out / "runs" / f"round{r}" / f"c{c}"
            cand = candidates[c]
            how = (
                ["--deepspeed_config", out / "config.json", "--plan", cand["path"]]
                if cand["path"]
                else ["--deepspeed_config", cand["config"], "--stages", cand["pipeline_depth"]]
            )
            _job(
                args,
                [
                    *how,
                    "--steps",
                    args.steps,
                    "--out",
                    run_dir,
                    "--eval-batches",
                    1,
                    "--timeline-steps",
                    1,
                    *shlex.split(args.model_args),
                ],
                run_dir.with_suffix(".log"),
            )
            steps = json.loads((run_dir / "metrics.json").read_text())["step_seconds"][args.skip :]
            measured[c].append(statistics.median(steps))
            timed[c].extend(steps)
            print(
                f"cut-sweep: round {r + 1}/{args.rounds}, {candidates[c]['label']} {candidates[c]['boundaries']}: "
                f"{measured[c][-1] * 1e3:.1f} ms a step",
                flush=True,
            )
    return measured, timed


def machine() -> str:
    try:
        load = ", load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = ""
    return f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}{load}"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()  # the ranks run from the repository root
    out.mkdir(parents=True, exist_ok=True)
    if args.plan is None:
        plan_path, profile_path = profile_and_plan(args, out)
    else:
        plan_path, profile_path = Path(args.plan).resolve(), Path(args.profile).resolve()
    candidates = candidate_plans(plan_path, profile_path, args.top, out, args.only, job=(args.stages, args.micro_batch))
    start_machine = machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    measured, timed = measure(args, candidates, out)
    summary = summarize(candidates, measured, timed)
    summary.update(
        command="python -m tools.bench cut-sweep " + " ".join(map(shlex.quote, argv or sys.argv[1:])),
        machine=start_machine,
        machine_after=machine(),
        commit=commit,
        steps=args.steps,
        skip=args.skip,
        ranks=args.ranks,
        model_args=args.model_args,
    )
    best = summary["best"]
    if best != 0 and candidates[best]["path"]:
        from hippie_ds.planner import load_plan, save_plan

        save_plan(load_plan(candidates[best]["path"]), out / "measured_best_plan.json")
        summary["measured_best_plan"] = str(out / "measured_best_plan.json")
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    text = report(
        summary,
        [
            f"Cut sweep: `{summary['command']}` at commit {commit}",
            "",
            f"Machine: {start_machine} (after: {summary['machine_after']}); {args.ranks} ranks, "
            f"{args.steps} steps a run, the median of steps {args.skip + 1}-{args.steps}",
        ],
    )
    if best != 0 and candidates[best]["path"]:
        text += f"\nThe measured best differs from the plan: wrote {out / 'measured_best_plan.json'}.\n"
    elif best != 0:
        text += "\nThe measured best is the job as it is: keep it (no plan file).\n"
    (out / "report.md").write_text(text)
    print(text, flush=True)
    return 0
