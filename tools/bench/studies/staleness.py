"""Staleness study: which correction lets a one-step-delayed stage (hippie's deferred stages,
PipeDream-2BW) reach data parallelism's held-out loss at data parallelism's learning rate.

A single process trains the two examples exactly as tools/bench/convergence.py has them trained (the
layers of tools/examples/gpt.py and vgg.py built under DeepSpeed's seed_layers rule, base_seed
1234; the data order of --seed; global batch 32; AdamW lr 1e-3, weight decay 0.01, DeepSpeed's
WarmupDecayLR with 5% linear warm-up and linear decay to 0 at the last step; no clipping; GPT 800
steps, VGG 500 steps; the same held-out evaluation) with the layers cut into 2 stages as
DeepSpeed's PipelineModule cuts them (partition_method "uniform"), one AdamW per stage (with
--optimizer muon: DeepSpeed's Muon, as tools/bench/convergence.py --optimizer muon has it). The
gradient of the whole global batch is computed in one pass: data parallelism's update, without
the processes. A rule says, per stage, whether it applies its gradient one step late and how it
corrects for that:

    sync                        every stage synchronous (= dp)
    hippie:METHOD               stage 0 delayed (hippie's deferred stage), stage 1 synchronous
    hippie@L:METHOD             partial deferral (hippie.deferred_layers = L): only stage 0's first L
                                layers delayed, the rest of stage 0 synchronous
    2bw:METHOD                  every stage delayed (PipeDream-2BW's rule)
    2bw-made:METHOD             every stage but the last delayed: with weights=1, 2bw under
                                extrapolate-made, whose last stage computes on the weights it has
                                already made (synchronous)
    stage=K:METHOD              only stage K delayed (where the delay costs, one stage at a time)

A delayed stage follows W(t+1) = W(t) - lr * g(W(t-1)) with AdamW fed g(W(t-1)) at step t; nothing
is applied at t = 0 (the LR schedule still advances); the last gradient is applied after the last
step (flush, at the optimizer's learning rate then). METHOD (several joined by '+'):

    none                        no correction
    extrapolate=C               forward and backward on W + C * (W(t) - W(t-1)); the update applies
                                to W (SpecTrain/PipeMare weight prediction; hippie.staleness)
    pipeoptim=S                 forward and backward on W - S * lr * (m_hat / (sqrt(v_hat) + eps)
                                + wd * W), AdamW's next step predicted from its state (PipeOptim)
    ef=G                        error feedback on the update: apply u(t) + G * (u(t) - u(t-1)), u
                                the AdamW step of the stale gradient (the error of applying u(t-1)
                                instead of u(t), fed back one step later)
    dcasgd=L                    DC-ASGD-a delay compensation with Adam's second moment as the mean
                                square: g + L * g * g * (W(t) - W_g) / (sqrt(v_hat) + eps)
    beta1=B                     the delayed stages' AdamW uses beta1 = B (default 0.9)
    weights=1                   2bw's own pairing: step t computes on the stage's weights one update
                                old, W(t-1) (extrapolated with extrapolate=C), beside the other stages'
                                current ones, and its gradient updates W(t) at once; without it a
                                delayed stage applies step t-1's gradient at step t (hippie's pairing,
                                which 2bw-made approximates 2bw with unless weights=1 is given)
    nadam=B                     the delayed stages use NAdamW (torch NAdam, decoupled weight decay)
                                with beta1 = B: the Nesterov method's recipe (Ajanthan et al.,
                                ICML 2025, run with beta1 0.99)
    lrscale=F                   the delayed stages' learning rate times F

    python -m tools.bench staleness --examples gpt,vgg --seeds 0 \\
        --rules sync,hippie:none,hippie:extrapolate=1 --out out/staleness
    python -m tools.bench staleness --report-only --out out/staleness   # tables of what is there

Every run is saved as OUT/runs/EXAMPLE/RULE/seedS.json (--reuse skips those already there) and
the tables of all saved runs (held-out loss at the budget, mean and min-max over seeds, % vs
sync of the same seeds, VGG accuracy, seconds) go to OUT/tables.md, and each run's final figures
(no curves) to OUT/summary.json, the file a results page cites.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from tools.bench import time_to_accuracy as tta
from tools.bench.labels import split_layers
from tools.bench.studies.staleness_stage import Stage

GLOBAL_BATCH = 32
BASE_SEED = 1234  # tools/examples/harness.py: pipeline_module(seed_layers=True, base_seed=1234)
EXAMPLES = {  # tools/bench/convergence.py's budgets; GPT evaluates 16 held-out batches (--eval-batches 16)
    "gpt": {"steps": 800, "eval_every": 100, "eval_batches": 16},
    "vgg": {"steps": 500, "eval_every": 50},
}
METHODS = ("none", "extrapolate", "pipeoptim", "ef", "dcasgd", "beta1", "lrscale", "nadam", "weights")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.bench staleness",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--examples", default="gpt,vgg", help="comma-separated: gpt, vgg")
    p.add_argument("--rules", default="sync,hippie:none,hippie:extrapolate=1", help="comma-separated rules (see below)")
    p.add_argument("--seeds", default="0", help="comma-separated data-order seeds (the examples' --seed)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: DeepSpeed's Muon (MuonWithAuxAdam) on the matrices DeepSpeed gives it (every "
        "parameter of 2 or more dims not named embed or lm_head), AdamW (--lr) on the rest",
    )
    p.add_argument("--muon-lr", type=float, default=0.02, help="peak learning rate of Muon's matrices")
    p.add_argument("--steps", default=None, help="override the budgets, e.g. gpt=800,vgg=500 (default)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages the layers are cut into")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda (TF32 off)")
    p.add_argument("--out", default="out/staleness")
    p.add_argument("--reuse", action="store_true", help="skip runs whose json is already under --out")
    p.add_argument("--report-only", action="store_true", help="train nothing; tabulate the saved runs")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- rules
def parse_rule(text: str, stages: int) -> dict:
    """'sync' | 'hippie:M[=x][+M[=x]...]' | '2bw:...' -> {'name', 'delayed': [stage ids], 'methods'}."""
    if text == "sync":
        return {"name": text, "layout": "sync", "delayed": [], "methods": {}}
    rest, leading = split_layers(text)
    layout, _, spec = rest.partition(":")
    only = layout[len("stage=") :] if layout.startswith("stage=") else None
    if (
        (only is not None and not (only.isdigit() and int(only) < stages))
        or (only is None and layout not in ("hippie", "2bw", "2bw-made"))
        or not spec
        or (leading is not None and (layout != "hippie" or leading == "all"))
    ):
        raise SystemExit(
            f"rule {text!r}: expected sync, hippie[@L]:METHOD, 2bw:METHOD, 2bw-made:METHOD or "
            f"stage=K:METHOD (K < {stages})"
        )
    methods = {}
    for item in spec.split("+"):
        name, _, value = item.partition("=")
        if name not in METHODS:
            raise SystemExit(f"rule {text!r}: unknown method {name!r} (known: {', '.join(METHODS)})")
        if name != "none":
            if not value:
                raise SystemExit(f"rule {text!r}: {name} needs a value ({name}=X)")
            methods[name] = float(value)
    delayed = (
        [0]
        if layout == "hippie"
        else [int(only)]
        if only is not None
        else list(range(stages - 1))
        if layout == "2bw-made"
        else list(range(stages))
    )
    return {"name": text, "layout": layout, "delayed": delayed, "methods": methods, "delayed_layers": leading}


# ----------------------------------------------------------------------------------------- examples
def load_example(name: str):
    """(layer specs, loss_fn, metrics, train batches fn(seed), eval batches fn(seed) -> (iterable, n))."""
    if name == "gpt":
        from tools.examples import gpt

        data = gpt.CharData(64)  # tools/examples/train_gpt.py defaults: dim 128, 4 layers, 4 heads, seq_len 64
        specs = gpt.layer_specs(len(data.vocab), dim=128, layers=4, seq_len=64)
        n = EXAMPLES["gpt"]["eval_batches"]
        return (
            specs,
            gpt.lm_loss,
            {"loss": gpt.lm_loss},
            lambda seed: data.global_batches("train", GLOBAL_BATCH, seed),
            lambda seed: (data.global_batches("heldout", GLOBAL_BATCH, 10_000 + seed), n),
        )
    if name == "vgg":
        from tools.examples import vgg

        data = vgg.Digits()
        return (
            vgg.layer_specs(32, 128),
            vgg.loss_fn,
            {"loss": vgg.loss_fn, "accuracy": vgg.accuracy},
            lambda seed: data.global_batches(GLOBAL_BATCH, seed),
            lambda seed: (data.test_batches(GLOBAL_BATCH), data.num_test_batches(GLOBAL_BATCH)),
        )
    raise SystemExit(f"unknown example {name!r}")


def build_layers(specs, device):
    """The layers as DeepSpeed's PipelineModule builds them with seed_layers=True: layer i under
    ds_utils.set_random_seed(base_seed + i), whatever stage holds it."""
    from hippie_ds.adapter.ds.module import set_random_seed

    layers = []
    for i, spec in enumerate(specs):
        set_random_seed(BASE_SEED + i)
        layers.append(spec.build().to(device))
    return layers


def stage_bounds(num_layers: int, stages: int) -> list[int]:
    """PipelineModule(partition_method='uniform')'s cut (the examples' default)."""
    from hippie_ds.adapter.ds.module import partition_uniform

    return [int(b) for b in partition_uniform(num_layers, stages)]


# -------------------------------------------------------------------------------------------- runs
def evaluate(layers, batches, n, metrics, device):
    import torch

    sums = {k: 0.0 for k in metrics}
    with torch.no_grad():
        for i, (x, y) in enumerate(batches):
            if i == n:
                break
            h = x.to(device)
            for layer in layers:
                h = layer(h)
            for k, fn in metrics.items():
                sums[k] += float(fn(h, y.to(device)))
    return {k: v / n for k, v in sums.items()}


def muon_parameters(layers) -> set[int]:
    """Ids of the parameters DeepSpeed's "Muon" type gives to Muon (the rest go to its AdamW):
    deepspeed.set_optimizer_flags itself, on the layers named as a PipelineModule names them
    ("<layer>.<name>")."""
    from types import SimpleNamespace

    import deepspeed
    import torch

    model = torch.nn.Sequential(*layers)
    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params={}), model)
    return {id(p) for p in model.parameters() if p.requires_grad and p.use_muon}


def build_stages(layers, rule: dict, args, steps: int) -> tuple[list[Stage], list[int]]:
    """The rule's stages (a partially deferred stage as two parts) and the stage boundaries."""
    bounds = stage_bounds(len(layers), args.stages)
    stages = []

    def params_of(lo, hi):
        return [p for layer in layers[lo:hi] for p in layer.parameters() if p.requires_grad]

    muon = None if args.optimizer == "adamw" else muon_parameters(layers)
    for s in range(args.stages):
        lo, hi = bounds[s], bounds[s + 1]
        cut = lo + rule["delayed_layers"] if s in rule["delayed"] and rule.get("delayed_layers") is not None else hi
        # AdamW and Muon act per parameter (no clipping): one optimizer per part equals one per stage
        if cut > lo:
            stages.append(
                Stage(
                    params_of(lo, min(cut, hi)),
                    s in rule["delayed"],
                    rule["methods"],
                    args.lr,
                    steps,
                    muon,
                    args.muon_lr,
                )
            )
        if cut < hi:
            stages.append(Stage(params_of(cut, hi), False, rule["methods"], args.lr, steps, muon, args.muon_lr))
    return stages, bounds


def run_one(example: str, rule: dict, seed: int, args, steps: int, bar) -> dict:
    import torch

    specs, loss_fn, metrics, train_fn, eval_fn = load_example(example)
    device = torch.device(args.device)
    torch.manual_seed(seed)  # as the examples' Trainer (nothing random is drawn after the build)
    layers = build_layers(specs, device)
    stages, bounds = build_stages(layers, rule, args, steps)
    eval_every = EXAMPLES[example]["eval_every"]
    train = train_fn(seed)
    record = {
        "example": example,
        "rule": rule["name"],
        "layout": rule["layout"],
        "delayed_stages": rule["delayed"],
        "methods": rule["methods"],
        "seed": seed,
        "steps": steps,
        "lr": args.lr,
        "stage_bounds": bounds,
        "optimizer": args.optimizer,
        "muon_lr": args.muon_lr if args.optimizer == "muon" else None,
        "stage_params": [sum(p.numel() for p in st.params) for st in stages],
        "delayed_layers": rule.get("delayed_layers"),
        "delayed_params": sum(p.numel() for st in stages if st.delayed for p in st.params),
        "device": args.device,
        "threads": args.threads,
        "torch": torch.__version__,
        "train_loss": [],
        "eval": [],
    }
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = next(train)
        x, y = x.to(device), y.to(device)
        for st in stages:
            st.before_compute()
        h = x
        for layer in layers:
            h = layer(h)
        loss = loss_fn(h, y)
        loss.backward()
        for st in stages:
            st.after_backward()
        for st in stages:
            st.end_step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise SystemExit(f"{example} {rule['name']} seed {seed}: loss {value} at step {step}")
        record["train_loss"].append(value)
        if step % eval_every == 0 and step < steps:
            record["eval"].append({"step": step, **evaluate(layers, *eval_fn(seed), metrics, device)})
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
    for st in stages:
        st.flush()
    final = evaluate(layers, *eval_fn(seed), metrics, device)
    record["eval"].append({"step": steps, **final})
    record["final"] = final
    record["seconds"] = time.perf_counter() - start
    record["correction_seconds"] = sum(st.correction_seconds for st in stages)
    ratios = [r for st in stages for r in st.dc_ratio]
    if ratios:
        record["dcasgd_correction_ratio"] = {"mean": sum(ratios) / len(ratios), "max": max(ratios)}
    return record


def run_path(out: Path, example: str, rule: str, seed: int) -> Path:
    name = rule.replace(":", "_").replace("=", "").replace("+", "_")
    return out / "runs" / example / name / f"seed{seed}.json"


# ------------------------------------------------------------------------------------------- report
def load_runs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/*/seed*.json"))]


def tables(runs: list[dict]) -> str:
    """Per example: one row per rule and seed set, held-out loss mean (min-max), % vs sync (the
    mean over the same seeds), accuracy, seconds per run."""
    lines = []
    by = {}
    for r in runs:
        by.setdefault(r["example"], {}).setdefault(r["rule"], {})[r["seed"]] = r
    for example in sorted(by):
        rules = by[example]
        sync = rules.get("sync", {})
        seed_sets = sorted({tuple(sorted(s)) for s in (set(v) for v in rules.values())}, key=lambda s: (-len(s), s))
        for seeds in seed_sets:
            if not all(s in sync for s in seeds):
                continue
            base = sum(sync[s]["final"]["loss"] for s in seeds) / len(seeds)
            base_acc = (
                None
                if "accuracy" not in sync[seeds[0]]["final"]
                else sum(sync[s]["final"]["accuracy"] for s in seeds) / len(seeds)
            )
            names = [n for n in rules if all(s in rules[n] for s in seeds)]
            names.sort(key=lambda n: (n != "sync", n.split(":")[0] != "hippie", n))
            targets = {s: tta.target_loss([sync[s]["final"]["loss"]]) for s in seeds}
            lines += [
                f"**{example}**, seeds {','.join(map(str, seeds))} (held-out loss at step "
                f"{sync[seeds[0]]['steps']}; % vs `sync` over the same seeds; steps to target per seed: first "
                f"evaluation at or below that seed's sync final + {tta.TARGET_MARGIN_PCT:g}%)",
                "",
                "| rule | held-out loss | min-max | vs sync (per-seed range) | accuracy | vs sync | steps to "
                "target | s/run |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for n in names:
                rs = [rules[n][s] for s in seeds]
                losses = [r["final"]["loss"] for r in rs]
                mean = sum(losses) / len(losses)
                spread = f"{min(losses):.4f}-{max(losses):.4f}" if len(losses) > 1 else ""
                paired = [100 * (r["final"]["loss"] / sync[r["seed"]]["final"]["loss"] - 1) for r in rs]
                diff = (
                    ""
                    if n == "sync"
                    else f"{100 * (mean - base) / base:+.2f}%"
                    + (f" ({min(paired):+.1f} to {max(paired):+.1f})" if len(paired) > 1 else "")
                )
                acc = dacc = ""
                if base_acc is not None:
                    a = sum(r["final"]["accuracy"] for r in rs) / len(rs)
                    acc = f"{100 * a:.2f}%"
                    dacc = "" if n == "sync" else f"{100 * (a - base_acc):+.2f} pt"
                secs = sum(r["seconds"] for r in rs) / len(rs)
                reached = [tta.steps_to_target(r["eval"], targets[r["seed"]]) for r in rs]
                to_target = ", ".join("not reached" if x is None else str(x) for x in reached)
                lines.append(f"| `{n}` | {mean:.4f} | {spread} | {diff} | {acc} | {dacc} | {to_target} | {secs:.0f} |")
            lines.append("")
    return "\n".join(lines)


def summary(runs: list[dict]) -> dict:
    """{example: {rule: {seed: final figures, seconds, correction seconds per step, stages}}}."""
    out: dict = {}
    for r in runs:
        out.setdefault(r["example"], {}).setdefault(r["rule"], {})[str(r["seed"])] = {
            **r["final"],
            "seconds": r["seconds"],
            "steps": r["steps"],
            "stages": len(r["stage_bounds"]) - 1,
            "correction_seconds_per_step": r.get("correction_seconds", 0.0) / r["steps"],
            "delayed_params": r["delayed_params"],
        }
    return out


def write_reports(out: Path) -> str:
    runs = load_runs(out)
    text = tables(runs)
    (out / "tables.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary(runs), indent=1, sort_keys=True))
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        print(write_reports(out))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    examples = [e for e in args.examples.split(",") if e]
    for e in examples:
        if e not in EXAMPLES:
            raise SystemExit(f"--examples: unknown example {e!r} (known: {', '.join(EXAMPLES)})")
    steps = {e: EXAMPLES[e]["steps"] for e in examples}
    if args.steps:
        for item in args.steps.split(","):
            name, _, v = item.partition("=")
            if name in steps:
                steps[name] = int(v)
    rules = [parse_rule(r, args.stages) for r in args.rules.split(",") if r]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    todo = [
        (e, r, s)
        for s in seeds
        for e in examples
        for r in rules
        if not (args.reuse and run_path(out, e, r["name"], s).exists())
    ]
    total = sum(steps[e] for e, _, _ in todo)
    print(f"[staleness] {len(todo)} runs, {total} steps; threads {args.threads}, device {args.device}", flush=True)
    with tqdm(total=total, unit="step", dynamic_ncols=True) as bar:
        for example, rule, seed in todo:
            bar.set_description(f"{example} {rule['name']} s{seed}")
            record = run_one(example, rule, seed, args, steps[example], bar)
            path = run_path(out, example, rule["name"], seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1))
            final = ", ".join(f"{k} {v:.4f}" for k, v in record["final"].items())
            bar.write(f"[staleness] {example} {rule['name']} seed {seed}: {record['seconds']:.0f} s, held-out {final}")
    print(write_reports(out))
    return 0
