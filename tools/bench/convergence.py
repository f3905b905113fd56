"""Convergence: train each example to a fixed budget under data parallelism (the baseline) and
under pipeline schedules, and compare the learning curves and the final held-out loss/accuracy.

    python -m tools.bench convergence                       # (make convergence) both examples, all schedules
    python -m tools.bench convergence --examples vgg --schedules dp,1f1b,hippie
    python -m tools.bench convergence --plot-only           # redraw from the runs' metrics files

Every run is a `deepspeed --num_gpus 4` job, one after another: `dp` is plain DeepSpeed data
parallelism on 4 replicas (`--data-parallel-only`), a schedule name is 2 pipeline stages x 2
replicas with that schedule. All runs of an example share the global batch, the initial weights,
the data order, the optimizer and the learning-rate schedule: the config is configs/NAME.json
where it exists (configs/1f1b.json with "pipeline.schedule" set to NAME otherwise; configs/1f1b.json
for dp), with the learning rate and schedule given here. So a schedule not shipped with a config
(e.g. `2bw`, `pipedream`) is compared by adding its name to --schedules.

Writes under --out (default out/convergence): EXAMPLE/NAME/{config.json,log.txt,metrics.json,
timeline.png} per run, EXAMPLE.png (loss, and accuracy for vgg, against steps), results.json and
results.md (final held-out loss/accuracy per schedule and the difference to dp: targets within
1% loss and 0.5 points accuracy; time to accuracy, tools/bench/time_to_accuracy.py: the steps
to reach dp's final loss + 1% and, with --step-times, the wall time on the emulated two-node
cluster); --publish DIR copies those to DIR. The tables and pictures are
tools/bench/convergence_report.py.

A name NAME:METHOD[=C] runs schedule NAME with hippie.staleness {"method": METHOD, "coefficient":
C}, e.g. hippie:none (no correction), hippie:extrapolate=1.5 or 2bw:adam (Adam's predicted update);
its runs go to NAME_METHODC.
NAME@L sets hippie.deferred_layers = L (partial deferral: a deferred stage delays only its first
L layers), e.g. hippie@1 or hippie@1:none; NAME@all sets it to "all" (the whole deferred stage is
delayed: the paper's rule); its runs go to NAME@L. NAME@auto sets it to "auto" (chosen per deferred
stage from costs, as the engine does): it needs --costs EXAMPLE=FILE, the example's cost file
(`python -m tools.bench example-costs`, or a python -m tools.bench run's measured costs), given to the run as
hippie.costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.bench import REPO
from tools.bench import time_to_accuracy as tta
from tools.bench.cluster import LocalJob

# The results (tables, pictures) of the runs; summarize, markdown and plot are also this module's API.
from tools.bench.convergence_report import BASELINE, markdown, plot, summarize
from tools.bench.labels import split_layers, split_name  # noqa: F401 (split_*: this module's API too)
from tools.bench.publish import publish

# Per example: the script, the budget and the evaluation cadence. Budgets are chosen so that the
# whole comparison (2 examples x 4 runs) takes about 10-20 minutes on a 2-core machine.
EXAMPLES = {
    "gpt": {
        "script": "tools/examples/train_gpt.py",
        "steps": 800,
        "eval_every": 50,
        "lr": 1e-3,
        "extra": ["--eval-batches", "16"],
        "metrics": ["loss"],
    },
    "vgg": {
        "script": "tools/examples/train_vgg.py",
        "steps": 500,
        "eval_every": 25,
        "lr": 1e-3,
        "extra": [],
        "metrics": ["loss", "accuracy"],
    },
}


def _defaults(key):
    return ",".join(f"{name}={spec[key]:g}" for name, spec in EXAMPLES.items())


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench convergence",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--examples", default="gpt,vgg", help="comma-separated: gpt, vgg")
    p.add_argument(
        "--schedules",
        default=f"{BASELINE},1f1b,hippie,hippie-1f1b",
        help=f"comma-separated: {BASELINE} (data parallelism, the baseline) and schedule names or files",
    )
    p.add_argument(
        "--steps",
        default=None,
        help=f"training steps, one number or per example, e.g. gpt=600,vgg=400 (default: {_defaults('steps')})",
    )
    p.add_argument(
        "--eval-every", default=None, help=f"evaluation cadence, like --steps (default: {_defaults('eval_every')})"
    )
    p.add_argument("--lr", default=None, help=f"peak learning rate, like --steps (default: {_defaults('lr')})")
    p.add_argument(
        "--lr-schedule",
        choices=["decay", "constant"],
        default="decay",
        help="decay: DeepSpeed's WarmupDecayLR, linear warm-up over 5%% of the steps, then linear "
        "decay to 0 at the last step (the end point is then not a random point of an SGD "
        "walk); constant: the config's learning rate throughout",
    )
    p.add_argument(
        "--optimizer",
        choices=["config", "muon"],
        default="config",
        help="config: the config's (AdamW); muon: DeepSpeed's Muon optimizer type (Muon with momentum "
        "0.95 on the parameters DeepSpeed tags use_muon, AdamW at --lr on the rest; weight decay "
        "0.01), the LR schedule scaling both",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help='bf16: every run (dp too) with "bf16": {"enabled": true} (DeepSpeed\'s BF16_Optimizer: bf16 '
        "model, fp32 master weights)",
    )
    p.add_argument(
        "--comm-dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="DeepSpeed's communication_data_type of every run (the all-reduce's wire; default: the precision's)",
    )
    p.add_argument(
        "--muon-lr", type=float, default=0.02, help="peak learning rate of Muon's matrices (--optimizer muon)"
    )
    p.add_argument(
        "--gradient-clipping",
        default="0",
        metavar="NORM|config",
        help="gradient_clipping of every run (default 0: off); 'config' keeps the config's (1.0 in "
        "configs/). The engines clip differently: data parallelism by the whole model's norm, "
        "per-stage updates (hippie, hippie-1f1b) by each stage's own norm, and DeepSpeed 0.19's "
        "pipeline step (1f1b, gpipe; fp32) by stage 0's norm only (its clip_grad_norm_ counts the "
        "parameters of model-parallel rank 0, which in a pipeline grid is stage 0). Off, the "
        "comparison isolates the schedules' update rules",
    )
    p.add_argument("--ranks", type=int, default=4, help="deepspeed --num_gpus")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages of the schedule runs")
    p.add_argument(
        "--seeds",
        default="0",
        help="comma-separated data-order seeds; with several, every run is repeated per seed and the "
        "table and curves show the mean (the table also the spread)",
    )
    p.add_argument("--configs", default=str(REPO / "configs"), help="where NAME.json configs are looked up")
    p.add_argument("--out", default="out/convergence")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--reuse", action="store_true", help="skip runs whose metrics.json is already there")
    p.add_argument("--plot-only", action="store_true", help="run nothing; draw and tabulate the existing runs")
    p.add_argument(
        "--step-times",
        default=None,
        metavar="EXAMPLE=FILE[+FILE...][,...]",
        help="python -m tools.bench results.json measured at an example's shape: the median step times that "
        "turn steps to target into wall time on the emulated two-node cluster; files of "
        "different link speeds give one column group each, a file's rounds give the spread "
        "of the ratio to stock 1F1B",
    )
    p.add_argument(
        "--costs",
        default=None,
        metavar="EXAMPLE=FILE[,...]",
        help="hippie.costs of an example's NAME@auto runs (what 'auto' chooses from): a cost file, "
        "e.g. from python -m tools.bench example-costs",
    )
    p.add_argument(
        "--publish",
        default=None,
        metavar="DIR",
        help="also copy the pictures, results.json and results.md to DIR (e.g. docs/convergence)",
    )
    return p.parse_args(argv)


def per_example(value, examples, key, cast):
    """'600' or 'gpt=600,vgg=400' -> {example: value}, defaults from EXAMPLES."""
    result = {e: EXAMPLES[e][key] for e in examples}
    if value is None:
        return result
    if "=" not in value:
        return {e: cast(value) for e in examples}
    for item in value.split(","):
        name, _, v = item.partition("=")
        if name not in EXAMPLES:
            raise SystemExit(f"--{key.replace('_', '-')}: unknown example {name!r}")
        result[name] = cast(v)
    return {e: result[e] for e in examples}


def example_files(value: str | None, option: str) -> dict[str, str]:
    """'gpt=A,vgg=B' -> {example: value} (--step-times, --costs)."""
    files = dict(item.split("=", 1) for item in (value or "").split(",") if item)
    unknown = sorted(set(files) - set(EXAMPLES))
    if unknown:
        raise SystemExit(f"{option}: unknown example(s) {unknown} (known: {', '.join(EXAMPLES)})")
    return files


def make_config(
    name: str,
    configs: Path,
    lr: float,
    lr_schedule: str,
    steps: int,
    clipping: str = "config",
    muon_lr: float | None = None,
    precision: str = "fp32",
    costs: str | None = None,
    comm_dtype: str | None = None,
) -> dict:
    label = name
    name, layers = split_layers(name)
    name, staleness = split_name(name)
    base = configs / f"{name}.json"
    if name == BASELINE or not base.exists():
        config = json.loads((configs / "1f1b.json").read_text())
        if name != BASELINE:
            config.setdefault("pipeline", {})["schedule"] = name
    else:
        config = json.loads(base.read_text())
    config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
    peak = lr
    if muon_lr is not None:  # DeepSpeed's groups: the Muon half, then the AdamW half
        config["optimizer"] = {
            "type": "Muon",
            "params": {
                "lr": lr,
                "muon_lr": muon_lr,
                "adam_lr": lr,
                "momentum": 0.95,
                "weight_decay": 0.01,
                "torch_adam": True,
            },
        }
        peak = [muon_lr, lr]
    if lr_schedule == "decay":
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": steps,
                "warmup_min_lr": 0.0,
                "warmup_max_lr": peak,
                "warmup_num_steps": max(1, steps // 20),
                "warmup_type": "linear",
            },
        }
    if clipping != "config":
        config["gradient_clipping"] = float(clipping)
    if staleness is not None:
        config.setdefault("hippie", {})["staleness"] = staleness
    if layers is not None:  # "all": the whole deferred stage delayed (the paper's rule)
        config.setdefault("hippie", {})["deferred_layers"] = layers
    if layers == "auto":
        if costs is None:
            raise SystemExit(
                f"{label!r}: 'auto' chooses from costs: give the example's cost file with --costs "
                "EXAMPLE=FILE (python -m tools.bench example-costs writes one)"
            )
        config["hippie"]["costs"] = str(Path(costs).resolve())
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if comm_dtype is not None:
        config["communication_data_type"] = comm_dtype
    config["steps_per_print"] = 10**9  # the scripts print their own progress
    return config


def run_dir(out: Path, example: str, name: str, seed: int, seeds: list[int]) -> Path:
    """out/EXAMPLE/NAME (out/EXAMPLE/NAME/seedS with several seeds); a schedule file's runs are
    named by the file's stem."""
    name = name.replace(":", "_").replace("=", "")
    path = out / example / (Path(name).stem if "/" in name or name.endswith((".yaml", ".yml")) else name)
    return path if len(seeds) == 1 else path / f"seed{seed}"


def run_one(
    example: str, name: str, seed: int, args, steps: int, eval_every: int, lr: float, costs: str | None = None
) -> dict:
    spec = EXAMPLES[example]
    out = run_dir(Path(args.out), example, name, seed, args.seed_list)
    metrics_file = out / "metrics.json"
    if args.reuse and metrics_file.exists():
        print(f"[convergence] {example} {name} seed {seed}: reusing {metrics_file}", flush=True)
        return json.loads(metrics_file.read_text())
    out.mkdir(parents=True, exist_ok=True)
    metrics_file.unlink(missing_ok=True)
    config_file = out / "config.json"
    muon_lr = args.muon_lr if args.optimizer == "muon" else None
    config_file.write_text(
        json.dumps(
            make_config(
                name,
                Path(args.configs),
                lr,
                args.lr_schedule,
                steps,
                args.gradient_clipping,
                muon_lr,
                args.precision,
                costs,
                args.comm_dtype,
            ),
            indent=1,
        )
    )
    job = LocalJob(
        spec["script"],
        args.ranks,
        [
            "--deepspeed_config",
            config_file,
            "--steps",
            steps,
            "--eval-every",
            eval_every,
            "--seed",
            seed,
            "--out",
            out,
            *spec["extra"],
        ]
        + (["--data-parallel-only"] if name == BASELINE else ["--stages", args.stages]),
    )
    print(f"[convergence] {example} {name} seed {seed}: {' '.join(job.command[2:])}", flush=True)
    run = job.run(args.timeout, log=out / "log.txt")
    seconds = run.seconds
    if run.returncode != 0 or not metrics_file.exists():
        tail = (out / "log.txt").read_text(errors="replace")[-3000:]
        raise SystemExit(
            f"[convergence] {example} {name} failed "
            f"({'timeout' if run.timed_out else f'exit {run.returncode}'}); "
            f"log {out / 'log.txt'}:\n{tail}"
        )
    metrics = json.loads(metrics_file.read_text())
    metrics["job_seconds"] = seconds
    metrics_file.write_text(json.dumps(metrics, indent=1))
    final = metrics["final"]
    print(
        f"[convergence] {example} {name} seed {seed}: {seconds:.0f} s, held-out "
        + ", ".join(f"{k} {v:.4f}" for k, v in final.items()),
        flush=True,
    )
    return metrics


def main(argv=None):
    args = parse_args(argv)
    examples = [e for e in args.examples.split(",") if e]
    for e in examples:
        if e not in EXAMPLES:
            raise SystemExit(f"--examples: unknown example {e!r} (known: {', '.join(EXAMPLES)})")
    names = [n for n in args.schedules.split(",") if n]
    steps = per_example(args.steps, examples, "steps", int)
    eval_every = per_example(args.eval_every, examples, "eval_every", int)
    lrs = per_example(args.lr, examples, "lr", float)
    args.seed_list = [int(x) for x in args.seeds.split(",") if x]
    cost_files = example_files(args.costs, "--costs")
    step_time_files = example_files(args.step_times, "--step-times")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, start = {}, time.monotonic()
    for example in examples:
        runs[example] = {}
        for name in names:
            found = []
            for seed in args.seed_list:
                if args.plot_only:
                    f = run_dir(out, example, name, seed, args.seed_list) / "metrics.json"
                    if f.exists():
                        found.append(json.loads(f.read_text()))
                    continue
                found.append(
                    run_one(
                        example,
                        name,
                        seed,
                        args,
                        steps[example],
                        eval_every[example],
                        lrs[example],
                        cost_files.get(example),
                    )
                )
            if found:
                runs[example][name] = found
    runs = {e: r for e, r in runs.items() if r}
    if not runs:
        raise SystemExit(f"no runs under {out}")
    step_times = {e: tta.load_step_times(f) for e, f in step_time_files.items()}
    results = summarize(runs, step_times)
    pictures = [plot(example, res, out / f"{example}.png", step_times.get(example)) for example, res in results.items()]
    meta = {
        "command": " ".join(["python -m tools.bench convergence"] + (sys.argv[1:] if argv is None else list(argv))),
        "ranks": args.ranks,
        "seeds": args.seed_list,
        "gradient_clipping": args.gradient_clipping,
        "stages": args.stages,
        "lr_schedule": args.lr_schedule,
        "step_times": args.step_times,
        "optimizer": args.optimizer,
        "precision": args.precision,
        "comm_dtype": args.comm_dtype,
        "muon_lr": args.muon_lr if args.optimizer == "muon" else None,
        "total_seconds": None if args.plot_only else time.monotonic() - start,
    }
    previous = out / "results.json"
    if args.plot_only and previous.exists():  # keep what the runs were made with
        old = json.loads(previous.read_text()).get("meta", {})
        meta.update({k: old[k] for k in ("command", "total_seconds") if k in old}, redrawn_by=meta["command"])
    (out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    clip = args.gradient_clipping
    table = markdown(
        results,
        "the configs' (1.0 in configs/)" if clip == "config" else "off" if float(clip) == 0 else f"{float(clip):g}",
    )
    (out / "results.md").write_text(table)
    print(table)
    if publish(args.publish, [*pictures, out / "results.json", out / "results.md"]):
        print(f"[convergence] published to {args.publish}")
    print(
        f"[convergence] pictures: {', '.join(map(str, pictures))}; results: {out / 'results.json'}, "
        f"{out / 'results.md'}" + ("" if args.plot_only else f"; {meta['total_seconds'] / 60:.1f} min")
    )
