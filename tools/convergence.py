"""Convergence: train each example to a fixed budget under data parallelism (the baseline) and
under pipeline schedules, and compare the learning curves and the final held-out loss/accuracy.

    python tools/convergence.py                       # (make convergence) both examples, all schedules
    python tools/convergence.py --examples vgg --schedules dp,1f1b,hippie
    python tools/convergence.py --plot-only           # redraw from the runs' metrics files

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
1% loss and 0.5 points accuracy; time to accuracy, tools/time_to_accuracy.py: the steps to reach
dp's final loss + 1% and, with --step-times, the wall time on the emulated two-node cluster);
--publish DIR copies those to DIR.

A name NAME:METHOD[=C] runs schedule NAME with hippie.staleness {"method": METHOD, "coefficient":
C}, e.g. hippie:none (no correction) or hippie:extrapolate=1.5; its runs go to NAME_METHODC.
NAME@L sets hippie.deferred_layers = L (partial deferral: a deferred stage delays only its first
L layers), e.g. hippie@1 or hippie@1:none; NAME@all removes the key (the whole deferred stage is
delayed: the paper's rule); its runs go to NAME@L.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import time_to_accuracy as tta
from cluster import LocalJob

REPO = Path(__file__).resolve().parents[1]

BASELINE = "dp"
LOSS_TARGET_PCT, ACCURACY_TARGET_POINTS = 1.0, 0.5

# Per example: the script, the budget and the evaluation cadence. Budgets are chosen so that the
# whole comparison (2 examples x 4 runs) takes about 10-20 minutes on a 2-core machine.
EXAMPLES = {
    "gpt": {"script": "tools/train_gpt.py", "steps": 800, "eval_every": 50, "lr": 1e-3,
            "extra": ["--eval-batches", "16"], "metrics": ["loss"]},
    "vgg": {"script": "tools/train_vgg.py", "steps": 500, "eval_every": 25, "lr": 1e-3,
            "extra": [], "metrics": ["loss", "accuracy"]},
}


def _defaults(key):
    return ",".join(f"{name}={spec[key]:g}" for name, spec in EXAMPLES.items())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--examples", default="gpt,vgg", help="comma-separated: gpt, vgg")
    p.add_argument("--schedules", default=f"{BASELINE},1f1b,hippie,hippie-1f1b",
                   help=f"comma-separated: {BASELINE} (data parallelism, the baseline) and schedule names or files")
    p.add_argument("--steps", default=None,
                   help="training steps, one number or per example, e.g. gpt=600,vgg=400 "
                        f"(default: {_defaults('steps')})")
    p.add_argument("--eval-every", default=None, help="evaluation cadence, like --steps "
                   f"(default: {_defaults('eval_every')})")
    p.add_argument("--lr", default=None, help="peak learning rate, like --steps "
                   f"(default: {_defaults('lr')})")
    p.add_argument("--lr-schedule", choices=["decay", "constant"], default="decay",
                   help="decay: DeepSpeed's WarmupDecayLR, linear warm-up over 5%% of the steps, then linear "
                        "decay to 0 at the last step (the end point is then not a random point of an SGD "
                        "walk); constant: the config's learning rate throughout")
    p.add_argument("--gradient-clipping", default="0", metavar="NORM|config",
                   help="gradient_clipping of every run (default 0: off); 'config' keeps the config's (1.0 in "
                        "configs/). The engines clip differently: data parallelism by the whole model's norm, "
                        "per-stage updates (hippie, hippie-1f1b) by each stage's own norm, and DeepSpeed 0.19's "
                        "pipeline step (1f1b, gpipe; fp32) by stage 0's norm only (its clip_grad_norm_ counts the "
                        "parameters of model-parallel rank 0, which in a pipeline grid is stage 0). Off, the "
                        "comparison isolates the schedules' update rules")
    p.add_argument("--ranks", type=int, default=4, help="deepspeed --num_gpus")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages of the schedule runs")
    p.add_argument("--seeds", default="0",
                   help="comma-separated data-order seeds; with several, every run is repeated per seed and the "
                        "table and curves show the mean (the table also the spread)")
    p.add_argument("--configs", default=str(REPO / "configs"), help="where NAME.json configs are looked up")
    p.add_argument("--out", default="out/convergence")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--reuse", action="store_true", help="skip runs whose metrics.json is already there")
    p.add_argument("--plot-only", action="store_true", help="run nothing; draw and tabulate the existing runs")
    p.add_argument("--step-times", default=None, metavar="EXAMPLE=FILE[,...]",
                   help="tools/bench.py results.json measured at an example's shape: the median step times that "
                        "turn steps to target into wall time on the emulated two-node cluster")
    p.add_argument("--publish", default=None, metavar="DIR",
                   help="also copy the pictures, results.json and results.md to DIR (e.g. docs/convergence)")
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


def split_name(name: str) -> tuple[str, dict | None]:
    """'hippie:extrapolate=1.5' -> ('hippie', {'method': 'extrapolate', 'coefficient': 1.5})."""
    schedule, _, variant = name.partition(":")
    if not variant:
        return schedule, None
    method, _, value = variant.partition("=")
    return schedule, {"method": method, **({"coefficient": float(value)} if value else {})}


def split_layers(name: str) -> tuple[str, int | None]:
    """'hippie@1:none' -> ('hippie:none', 1): hippie.deferred_layers of a name, and the rest."""
    schedule, at, rest = name.partition("@")
    if not at:
        return name, None
    layers, colon, variant = rest.partition(":")
    if not (layers.isdigit() or layers == "all"):
        raise SystemExit(f"{name!r}: expected NAME@L[:METHOD[=C]] with L a layer count or 'all'")
    return schedule + colon + variant, "all" if layers == "all" else int(layers)


def make_config(name: str, configs: Path, lr: float, lr_schedule: str, steps: int, clipping: str = "config") -> dict:
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
    if lr_schedule == "decay":
        config["scheduler"] = {"type": "WarmupDecayLR",
                               "params": {"total_num_steps": steps, "warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                          "warmup_num_steps": max(1, steps // 20), "warmup_type": "linear"}}
    if clipping != "config":
        config["gradient_clipping"] = float(clipping)
    if staleness is not None:
        config.setdefault("hippie", {})["staleness"] = staleness
    if layers == "all":  # the whole deferred stage delayed (the paper's rule)
        config.setdefault("hippie", {}).pop("deferred_layers", None)
    elif layers is not None:
        config.setdefault("hippie", {})["deferred_layers"] = layers
    config["steps_per_print"] = 10 ** 9  # the scripts print their own progress
    return config


def run_dir(out: Path, example: str, name: str, seed: int, seeds: list[int]) -> Path:
    """out/EXAMPLE/NAME (out/EXAMPLE/NAME/seedS with several seeds); a schedule file's runs are
    named by the file's stem."""
    name = name.replace(":", "_").replace("=", "")
    path = out / example / (Path(name).stem if "/" in name or name.endswith((".yaml", ".yml")) else name)
    return path if len(seeds) == 1 else path / f"seed{seed}"


def run_one(example: str, name: str, seed: int, args, steps: int, eval_every: int, lr: float) -> dict:
    spec = EXAMPLES[example]
    out = run_dir(Path(args.out), example, name, seed, args.seed_list)
    metrics_file = out / "metrics.json"
    if args.reuse and metrics_file.exists():
        print(f"[convergence] {example} {name} seed {seed}: reusing {metrics_file}", flush=True)
        return json.loads(metrics_file.read_text())
    out.mkdir(parents=True, exist_ok=True)
    metrics_file.unlink(missing_ok=True)
    config_file = out / "config.json"
    config_file.write_text(json.dumps(make_config(name, Path(args.configs), lr, args.lr_schedule, steps,
                                                       args.gradient_clipping), indent=1))
    job = LocalJob(spec["script"], args.ranks,
                   ["--deepspeed_config", config_file, "--steps", steps, "--eval-every", eval_every, "--seed", seed,
                    "--out", out, *spec["extra"]]
                   + (["--data-parallel-only"] if name == BASELINE else ["--stages", args.stages]))
    print(f"[convergence] {example} {name} seed {seed}: {' '.join(job.command[2:])}", flush=True)
    run = job.run(args.timeout, log=out / "log.txt")
    seconds = run.seconds
    if run.returncode != 0 or not metrics_file.exists():
        tail = (out / "log.txt").read_text(errors="replace")[-3000:]
        raise SystemExit(f"[convergence] {example} {name} failed "
                         f"({'timeout' if run.timed_out else f'exit {run.returncode}'}); log {out / 'log.txt'}:\n{tail}")
    metrics = json.loads(metrics_file.read_text())
    metrics["job_seconds"] = seconds
    metrics_file.write_text(json.dumps(metrics, indent=1))
    final = metrics["final"]
    print(f"[convergence] {example} {name} seed {seed}: {seconds:.0f} s, held-out "
          + ", ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
    return metrics


# ------------------------------------------------------------------------------------------ results
def smooth(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _mean(values):
    return sum(values) / len(values)


def _mean_curves(runs: list[dict]) -> dict:
    """Train loss and evaluations averaged over the seeds' runs (same steps in all)."""
    train = [_mean(v) for v in zip(*(m["train_loss"] for m in runs))]
    evals = []
    for points in zip(*(m["eval"] for m in runs)):
        evals.append({"step": points[0]["step"],
                      **{k: _mean([p[k] for p in points]) for k in points[0] if k != "step"}})
    return {"train_loss": train, "eval": evals}


def summarize(runs: dict[str, dict[str, list[dict]]], step_times: dict[str, dict] | None = None) -> dict:
    """runs[example][name] = the metrics of that run, one per seed."""
    results = {}
    for example, by_name in runs.items():
        base = by_name.get(BASELINE)
        base_loss = None if base is None else _mean([m["final"]["loss"] for m in base])
        base_acc = None if base is None or base[0]["final"].get("accuracy") is None else \
            _mean([m["final"]["accuracy"] for m in base])
        rows = {}
        for name, ms in by_name.items():
            m = ms[0]
            losses = [r["final"]["loss"] for r in ms]
            accs = None if m["final"].get("accuracy") is None else [r["final"]["accuracy"] for r in ms]
            speeds = [r.get("steady_samples_per_s") or r.get("samples_per_s") for r in ms]
            row = {"loss": _mean(losses), "accuracy": None if accs is None else _mean(accs), "steps": m["steps"],
                   "seeds": [r["seed"] for r in ms], "loss_per_seed": losses, "accuracy_per_seed": accs,
                   "samples_per_s": None if None in speeds else _mean(speeds),
                   "job_seconds": [r.get("job_seconds") for r in ms], "schedule_params": m.get("schedule_params"),
                   "layout": (f"{m['replicas']} replicas" if m["mode"] == "data-parallel"
                              else f"{m['stages']} stages x {m['replicas']} replicas")}
            if base_loss is not None:
                row["loss_diff_pct"] = 100.0 * (row["loss"] - base_loss) / base_loss
                row["loss_within_target"] = row["loss_diff_pct"] <= LOSS_TARGET_PCT  # lower than dp meets it
                if accs is not None and base_acc is not None:
                    row["accuracy_diff_points"] = 100.0 * (row["accuracy"] - base_acc)
                    row["accuracy_within_target"] = row["accuracy_diff_points"] >= -ACCURACY_TARGET_POINTS
            rows[name] = row
        first = next(iter(by_name.values()))[0]
        results[example] = {"global_batch": first["global_batch"], "steps": first["steps"], "lr": first.get("lr"),
                            "seeds": [r["seed"] for r in next(iter(by_name.values()))], "runs": rows,
                            "curves": {n: _mean_curves(ms) for n, ms in by_name.items()}}
        if base is not None:
            results[example]["time_to_accuracy"] = tta.summarize(by_name, BASELINE, (step_times or {}).get(example))
    return results


def markdown(results: dict, clipping: str | None = None) -> str:
    lines = [f"Targets: held-out loss within {LOSS_TARGET_PCT:g}% and accuracy within {ACCURACY_TARGET_POINTS:g} "
             f"points of `{BASELINE}` (data parallelism). Negative differences are lower than `{BASELINE}`."
             + (f" Gradient clipping: {clipping}." if clipping else ""), ""]
    lines += ["| example | schedule | layout | steps | held-out loss | vs dp | accuracy | vs dp | samples/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for example, res in results.items():
        for name, r in res["runs"].items():
            acc = "" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%"
            dl = "" if name == BASELINE or "loss_diff_pct" not in r else \
                f"{r['loss_diff_pct']:+.2f}%{'' if r['loss_within_target'] else ' (!)'}"
            da = "" if name == BASELINE or "accuracy_diff_points" not in r else \
                f"{r['accuracy_diff_points']:+.2f} pt{'' if r['accuracy_within_target'] else ' (!)'}"
            sps = "" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}"
            loss = f"{r['loss']:.4f}"
            if len(r.get("loss_per_seed") or []) > 1:  # the spread over seeds
                loss += f" ({min(r['loss_per_seed']):.4f}-{max(r['loss_per_seed']):.4f})"
                if r["accuracy_per_seed"]:
                    acc += f" ({100 * min(r['accuracy_per_seed']):.2f}-{100 * max(r['accuracy_per_seed']):.2f})"
            lines.append(f"| {example} | `{name}` | {r['layout']} | {r['steps']} | {loss} | {dl} | {acc} | "
                         f"{da} | {sps} |")
    lines += [""]
    for example, res in results.items():
        if "time_to_accuracy" in res:
            lines += tta.markdown(example, res["time_to_accuracy"], BASELINE)
    lines += ["(!) outside the target. samples/s: steady-state training throughput of the run on this "
              "machine (all ranks share its cores), not a speed comparison."]
    if any("1f1b" in res["runs"] and BASELINE in res["runs"] for res in results.values()):
        lines += ["Without gradient clipping `1f1b` applies exactly `dp`'s update (same samples, initial weights "
                  "and optimizer); its runs then differ only by floating-point summation order, and its "
                  "difference to `dp` is the noise floor of the comparison."]
    return "\n".join(lines) + "\n"


LINES, MARKERS = ["-", "--", "-.", ":"], ["o", "s", "^", "D", "v", "P", "X"]


def plot(example: str, res: dict, path: Path, step_times: dict | None = None):
    """Identical curves (hippie and hippie-1f1b apply the same updates) stay visible: each run has its
    own line style and marker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = res["curves"]
    with_accuracy = any(e.get("accuracy") is not None for c in curves.values() for e in c["eval"])
    panels = 1 + with_accuracy + (step_times is not None and "time_to_accuracy" in res)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    for i, (name, c) in enumerate(curves.items()):
        color = f"C{i}"
        steps = range(1, len(c["train_loss"]) + 1)
        window = max(1, len(c["train_loss"]) // 40)
        ax.plot(steps, smooth(c["train_loss"], window), color=color, lw=1.2, alpha=0.8, ls=LINES[i % 4],
                label=f"{name} train (mean of {window})")
        ax.plot([e["step"] for e in c["eval"]], [e["loss"] for e in c["eval"]], color=color, ms=4, lw=1,
                ls=LINES[i % 4], marker=MARKERS[i % 7], mfc="none", label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    seeds = res["seeds"]
    ax.set_title(f"{example}: loss (global batch {res['global_batch']}, "
                 + (f"seed {seeds[0]})" if len(seeds) == 1 else f"mean of seeds {','.join(map(str, seeds))})"))
    if with_accuracy:
        ax = axes[0][1]
        for i, (name, c) in enumerate(curves.items()):
            ax.plot([e["step"] for e in c["eval"]], [100 * e["accuracy"] for e in c["eval"]], color=f"C{i}",
                    ls=LINES[i % 4], marker=MARKERS[i % 7], mfc="none", ms=4, lw=1.2, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out accuracy (%)")
        ax.set_ylim(0, 100)
        inset = ax.inset_axes([0.45, 0.12, 0.5, 0.45])
        for i, (name, c) in enumerate(curves.items()):
            late = [e for e in c["eval"] if e["step"] >= res["steps"] // 2]
            inset.plot([e["step"] for e in late], [100 * e["accuracy"] for e in late], color=f"C{i}", ls=LINES[i % 4],
                       marker=MARKERS[i % 7], mfc="none", ms=3.5, lw=1)
        inset.grid(alpha=0.3)
        inset.set_title("second half", fontsize=8)
        inset.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_title(f"{example}: held-out accuracy")
    if panels > 1 + with_accuracy:
        tta.plot_wall(axes[0][-1], curves, step_times, res["time_to_accuracy"]["target_loss"])
        axes[0][-1].set_title(f"{example}: held-out loss against emulated wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
                found.append(run_one(example, name, seed, args, steps[example], eval_every[example], lrs[example]))
            if found:
                runs[example][name] = found
    runs = {e: r for e, r in runs.items() if r}
    if not runs:
        raise SystemExit(f"no runs under {out}")
    step_times = {e: tta.load_step_times(f) for e, f in
                  (item.split("=", 1) for item in (args.step_times or "").split(",") if item)}
    results = summarize(runs, step_times)
    pictures = [plot(example, res, out / f"{example}.png", step_times.get(example)) for example, res in results.items()]
    meta = {"command": " ".join(["tools/convergence.py"] + (sys.argv[1:] if argv is None else list(argv))),
            "ranks": args.ranks, "seeds": args.seed_list, "gradient_clipping": args.gradient_clipping,
            "stages": args.stages, "lr_schedule": args.lr_schedule, "step_times": args.step_times,
            "total_seconds": None if args.plot_only else time.monotonic() - start}
    previous = out / "results.json"
    if args.plot_only and previous.exists():  # keep what the runs were made with
        old = json.loads(previous.read_text()).get("meta", {})
        meta.update({k: old[k] for k in ("command", "total_seconds") if k in old}, redrawn_by=meta["command"])
    (out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    clip = args.gradient_clipping
    table = markdown(results, "the configs' (1.0 in configs/)" if clip == "config" else
                     "off" if float(clip) == 0 else f"{float(clip):g}")
    (out / "results.md").write_text(table)
    print(table)
    if args.publish:
        import shutil
        publish = Path(args.publish)
        publish.mkdir(parents=True, exist_ok=True)
        for f in [*pictures, out / "results.json", out / "results.md"]:
            shutil.copy(f, publish / f.name)
        print(f"[convergence] published to {publish}")
    print(f"[convergence] pictures: {', '.join(map(str, pictures))}; results: {out / 'results.json'}, "
          f"{out / 'results.md'}" + ("" if args.plot_only else f"; {meta['total_seconds'] / 60:.1f} min"))


if __name__ == "__main__":
    main()
