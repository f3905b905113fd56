"""What the example scripts (``tools/examples/train_gpt.py``, ``tools/examples/train_vgg.py``) share: the command
line, building the model and the engine (a hippie-ds pipeline, or plain DeepSpeed data
parallelism as the baseline), a layout-independent data order, training, evaluation, the progress
bar (tqdm), the metrics file and the timeline picture.

**Same data in every layout.** Every step draws one *global* batch of ``train_batch_size``
samples from the seed alone; a rank takes its replica's contiguous share of it and cuts that into
micro-batches (:func:`replica_micro_batches`). 2 stages x 2 replicas x 4 micro-batches of 4 and
4 data-parallel replicas x 2 micro-batches of 4 therefore train on the same 32 samples per step,
and the mean loss over them is the same quantity.

**Same initial weights.** Both modes build the same ``PipelineModule`` layer list with
``seed_layers=True`` (layer i is initialised under seed ``base_seed + i`` whatever stage holds it);
the data-parallel baseline builds it with one stage and wraps it in a plain module, so
``deepspeed.initialize`` gives DeepSpeed's ordinary ``DeepSpeedEngine``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import deepspeed
import torch
from deepspeed.runtime.pipe.module import PipelineModule as DeepSpeedPipelineModule
from torch import nn
from tqdm import tqdm

import hippie_ds


# ---------------------------------------------------------------------------------------------- CLI
def add_common_args(p: argparse.ArgumentParser, steps: int, eval_every: int = 0) -> argparse.ArgumentParser:
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages (the world size must be a multiple); default 2, or the plan's with --plan",
    )
    p.add_argument("--schedule", default=None, help="override the config's pipeline.schedule")
    p.add_argument("--steps", type=int, default=steps, help="training steps (train_batch calls)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=eval_every,
        help="evaluate the held-out split every N steps (0: only at the end)",
    )
    p.add_argument("--seed", type=int, default=0, help="data order (the initial weights use base_seed 1234)")
    p.add_argument("--lr", type=float, default=None, help="override the config's optimizer learning rate")
    p.add_argument(
        "--plan",
        default=None,
        metavar="FILE",
        help="a planner plan file (hippie-ds plan --out): the model takes its stage boundaries and "
        "re-computed layers (hippie_ds.PipelineModule(plan=FILE)) and the config its batch keys, "
        "schedule and deferred stages (\"hippie\": {\"plan\": FILE}); a config key set "
        "differently is an error",
    )
    p.add_argument(
        "--data-parallel-only",
        action="store_true",
        help="baseline: no pipeline; plain deepspeed.initialize data parallelism over all ranks "
        "with the same global batch, seed and data order (--stages and the schedule "
        "are ignored)",
    )
    p.add_argument("--timeline-steps", type=int, default=2, help="how many final steps the picture shows")
    deepspeed.add_config_arguments(p)
    return p


def load_config(args) -> dict:
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    args.deepspeed_config = None  # passed as a dict, with the overrides applied
    if args.schedule:
        config.setdefault("pipeline", {})["schedule"] = args.schedule
    if args.lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    return config


# --------------------------------------------------------------------------------------------- data
def replica_micro_batches(
    global_batches: Iterable[tuple], micro_batch: int, micro_batches: int, replica: int, replicas: int
) -> Iterator[tuple]:
    """Cut each global batch (a tuple of tensors of ``micro_batch * micro_batches * replicas`` rows)
    into this replica's ``micro_batches`` micro-batches: replica r takes rows
    ``[r * micro_batches * micro_batch, (r + 1) * micro_batches * micro_batch)``."""
    share = micro_batch * micro_batches
    for batch in global_batches:
        rows = batch[0].shape[0]
        if rows != share * replicas:
            raise ValueError(f"global batch of {rows} rows, expected {share * replicas}")
        for m in range(micro_batches):
            lo = replica * share + m * micro_batch
            yield tuple(t[lo : lo + micro_batch] for t in batch)


# -------------------------------------------------------------------------------------------- model
def pipeline_module(
    layers,
    loss_fn,
    num_stages: int,
    topology,
    plan: str | None = None,
    partition_method: str = "uniform",
    config: dict | None = None,
    **kwargs,
):
    """``hippie_ds.PipelineModule`` (planner plans; with ``config``, the model chunks its schedule
    runs) where this hippie-ds has it, else DeepSpeed's.
    ``seed_layers=True, base_seed=1234``: the initial weights do not depend on the partition."""
    kwargs = dict(topology=topology, seed_layers=True, base_seed=1234, **kwargs)
    # (DeepSpeed 0.19: partition_method="parameters" with seed_layers=True hands random.seed a
    # numpy integer, which Python 3.11 rejects.)
    cls = getattr(hippie_ds, "PipelineModule", None)
    if cls is not None:
        return cls(
            layers=layers,
            loss_fn=loss_fn,
            num_stages=num_stages,
            partition_method=partition_method,
            plan=plan,
            **({"config": config} if config is not None else {}),
            **kwargs,
        )
    if plan is not None:
        raise SystemExit(f"--plan {plan}: this hippie-ds has no hippie_ds.PipelineModule(plan=...)")
    return DeepSpeedPipelineModule(
        layers=layers, loss_fn=loss_fn, num_stages=num_stages, partition_method=partition_method, **kwargs
    )


def plan_depth(path: str) -> int:
    """The pipeline depth a plan file chose."""
    from hippie_ds.planner.plan_file import load_plan

    return load_plan(path).pipeline_depth


class DataParallelModel(nn.Module):
    """A one-stage ``PipelineModule`` as an ordinary module: ``forward(inputs, labels)`` is the loss.
    Not a ``PipelineModule`` itself, so ``deepspeed.initialize`` gives the stock ``DeepSpeedEngine``."""

    def __init__(self, pipe: nn.Module):
        super().__init__()
        self.pipe = pipe

    def forward(self, inputs, labels=None):
        outputs = self.pipe(inputs)
        return outputs if labels is None else self.pipe.loss_fn(outputs, labels)


# ------------------------------------------------------------------------------------------ running
class Trainer:
    """One engine (pipeline or data-parallel), its data share and its metrics."""

    def __init__(self, args, config: dict, layers_fn: Callable[[], list], loss_fn, example: str, out: Path):
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
        self.world, self.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        self.args, self.example, self.out = args, example, out
        self.data_parallel_only = args.data_parallel_only
        torch.manual_seed(args.seed)
        if self.data_parallel_only:
            if args.plan is not None:
                raise SystemExit("--plan partitions a pipeline; it does not go with --data-parallel-only")
            from hippie_ds.config import split_config

            ds_config, _, _ = split_config(config)  # without the "pipeline.schedule" and "hippie" keys
            ds_config.pop("pipeline", None)
            pipe = pipeline_module(layers_fn(), loss_fn, 1, hippie_ds.make_topology(1, self.world))
            model = DataParallelModel(pipe)
            self.engine, *_ = deepspeed.initialize(
                args=args,
                model=model,
                config=ds_config,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
            )
            self.replica, self.replicas = self.rank, self.world
            self.micro_batches = self.engine.gradient_accumulation_steps()
            self.schedule, self.schedule_params, self.stages = "data-parallel", {}, 1
            self.pipe, self.parts = pipe, None
        else:
            config.setdefault("hippie", {})["timeline_dir"] = str(out / "timeline")
            if args.plan is not None:
                config["hippie"]["plan"] = str(Path(args.plan).resolve())
            if args.stages is None:
                args.stages = plan_depth(args.plan) if args.plan is not None else 2
            placement = config["hippie"].get("placement", "pipeline_in_node")
            model = pipeline_module(
                layers_fn(),
                loss_fn,
                args.stages,
                hippie_ds.make_topology(args.stages, self.world, placement),
                plan=args.plan,
                config=config,
            )
            self.engine, *_ = hippie_ds.initialize(
                args=args,
                model=model,
                config=config,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
            )
            self.replica, self.replicas = self.engine.grid.data_parallel_id, self.engine.grid.data_parallel_size
            self.micro_batches = self.engine.micro_batches
            self.schedule = self.engine.compiled_schedule.name
            self.schedule_params = dict(self.engine.compiled_schedule.params)
            self.stages = model.num_stages
            self.pipe, self.parts = model, [int(b) for b in model.parts]
        self.micro_batch = self.engine.train_micro_batch_size_per_gpu()
        self.global_batch = self.engine.train_batch_size()
        self.metrics = {
            "example": example,
            "schedule": self.schedule,
            "schedule_params": self.schedule_params,
            "mode": "data-parallel" if self.data_parallel_only else "pipeline",
            "stages": self.stages,
            "replicas": self.replicas,
            "world_size": self.world,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "steps": args.steps,
            "seed": args.seed,
            "lr": config.get("optimizer", {}).get("params", {}).get("lr"),
            "plan": args.plan,
            "stage_boundaries": self.parts,
            "train_loss": [],
            "step_seconds": [],
            "eval": [],
        }

    def share(self, global_batches: Iterable[tuple]) -> Iterator[tuple]:
        """This rank's micro-batches of a stream of global batches (floating-point inputs in the
        model's dtype: bf16 under ``"bf16": {"enabled": true}``)."""
        batches = replica_micro_batches(
            global_batches, self.micro_batch, self.micro_batches, self.replica, self.replicas
        )
        if not self.engine.bfloat16_enabled():
            return batches
        return (tuple(t.bfloat16() if t.is_floating_point() else t for t in batch) for batch in batches)

    def describe(self) -> str:
        if self.data_parallel_only:
            return (
                f"data parallel (stock DeepSpeedEngine): {self.replicas} replicas, "
                f"{self.micro_batches} micro-batches of {self.micro_batch}"
            )
        return (
            f"schedule {self.schedule} {self.schedule_params}: {self.stages} stages x {self.replicas} replicas, "
            f"{self.micro_batches} micro-batches of {self.micro_batch}"
        )

    # training
    def train_step(self, data: Iterator[tuple]) -> float:
        start = time.perf_counter()
        if not self.data_parallel_only:
            loss = float(self.engine.train_batch(data))
        else:
            total = 0.0
            for _ in range(self.micro_batches):
                inputs, labels = next(data)
                step_loss = self.engine(inputs, labels)
                self.engine.backward(step_loss)  # scaled by 1/micro_batches inside
                self.engine.step()  # updates at the micro-batch boundary only
                total += step_loss.detach().item()
            t = torch.tensor([total / self.micro_batches])
            torch.distributed.all_reduce(t)
            loss = float(t) / self.world
        self.metrics["train_loss"].append(loss)
        self.metrics["step_seconds"].append(time.perf_counter() - start)
        return loss

    def finish_training(self):
        """Apply what is still pending: a deferred stage's buffered gradient (hippie, hippie-1f1b),
        the batches still in flight of a continuous schedule (2bw, pipedream)."""
        finish = getattr(self.engine, "drain", None)
        if finish is not None:
            finish()

    # evaluation
    def evaluate(
        self, make_batches: Callable[[], Iterable[tuple]], num_batches: int, metrics: dict[str, Callable]
    ) -> dict[str, float]:
        """Mean of each ``metrics`` function (outputs, labels) -> scalar over ``num_batches`` global
        batches of ``make_batches()``, over all replicas, in one pass."""
        if not self.data_parallel_only:
            # One inference pass over all the micro-batches; the loss stage's "loss" is the vector of
            # metrics, averaged by eval_batch over micro-batches and replicas (not broadcast: it is a
            # vector), then summed over the world from the loss stages only.
            module, loss_fn, total_loss = self.engine.module, self.engine.module.loss_fn, self.engine.total_loss
            module.loss_fn = lambda outputs, labels: torch.stack(
                [fn(outputs, labels).float() for fn in metrics.values()]
            )
            self.engine.total_loss = None  # the engine adds every forward's "loss" to it, eval_batch too
            try:
                value = self.engine.eval_batch(
                    self.share(make_batches()), bcast_loss=False, num_micro_batches=num_batches * self.micro_batches
                )
            finally:
                module.loss_fn, self.engine.total_loss = loss_fn, total_loss
            sums = value.detach().float().cpu() if self.engine.is_last_stage() else torch.zeros(len(metrics))
            torch.distributed.all_reduce(sums)
            sums /= self.replicas
            return dict(zip(metrics, map(float, sums)))
        self.engine.module.eval()
        sums = torch.zeros(len(metrics))
        data = self.share(make_batches())
        with torch.no_grad():
            for _ in range(num_batches * self.micro_batches):
                inputs, labels = next(data)
                outputs = self.engine(inputs)
                sums += torch.stack([fn(outputs, labels).float().detach() for fn in metrics.values()])
        torch.distributed.all_reduce(sums)
        sums /= self.world * num_batches * self.micro_batches
        self.engine.module.train()
        return dict(zip(metrics, map(float, sums)))

    def record_eval(self, step: int, results: dict[str, float]):
        self.metrics["eval"].append({"step": step, **results})

    # the loop
    def run(self, train: Iterator[tuple], evaluate: Callable[[], dict[str, float]]) -> tuple[dict, Path | None]:
        """The examples' training loop: ``--steps`` steps under a progress bar, ``evaluate()`` every
        ``--eval-every`` steps and after the last one (once the last buffered gradient is applied),
        then the metrics file. Returns (the final evaluation, rank 0's timeline picture)."""
        args = self.args
        start = time.perf_counter()
        with progress_bar(args.steps, enabled=self.rank == 0) as bar:
            for step in range(1, args.steps + 1):
                loss = self.train_step(train)
                step_done(bar, loss, step * self.global_batch / (time.perf_counter() - start))
                if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                    self.record_eval(step, evaluate())
        self.finish_training()  # the last step's buffered gradient is applied, not lost

        final = evaluate()
        self.record_eval(args.steps, final)
        return final, self.finish(start, final, args.timeline_steps)

    # output
    def finish(self, start: float, final: dict[str, float], timeline_steps: int) -> Path | None:
        """Write the metrics file and (pipeline mode) the timeline picture; rank 0 returns the picture."""
        wall = time.perf_counter() - start
        steps = len(self.metrics["train_loss"])
        self.metrics.update(final=final, wall_seconds=wall, samples_per_s=steps * self.global_batch / wall)
        # Throughput without the first steps (start-up, first-send metadata) and the evaluations.
        tail = self.metrics["step_seconds"][min(5, steps // 4) :]
        self.metrics["steady_samples_per_s"] = len(tail) * self.global_batch / sum(tail) if tail else None
        picture = None
        if not self.data_parallel_only:
            self.engine.write_timeline()
            # each stage's share of its gradient applied one step late (partial deferral, "auto")
            mine = (
                self.engine.stage_id,
                self.engine.delayed_fraction() if hasattr(self.engine, "delayed_fraction") else 0.0,
            )
            shares = [None] * self.world
            torch.distributed.all_gather_object(shares, mine)
            self.metrics["delayed_fraction"] = {str(s): f for s, f in sorted(set(shares))}
        torch.distributed.barrier()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if not self.data_parallel_only:
                picture = draw_timeline(self.out, self.schedule, timeline_steps)
                self.metrics["timeline"] = str(picture)
            (self.out / "metrics.json").write_text(json.dumps(self.metrics, indent=1))
        return picture


def progress_bar(steps: int, enabled: bool = True) -> tqdm:
    """The training steps' bar (tqdm on stderr; ``enabled``: rank 0 only). After each step the
    script calls :func:`step_done`, which shows the loss and the samples per second so far."""
    return tqdm(total=steps, desc="train", unit="step", disable=not enabled)


def step_done(bar: tqdm, loss: float, samples_per_s: float) -> None:
    bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:.1f}", refresh=False)
    bar.update()


def draw_timeline(out: Path, schedule: str, last_steps: int):
    from hippie_ds.schedules.trace import chrome_trace, timeline_png

    ranks = [json.loads(p.read_text()) for p in sorted((out / "timeline").glob("rank*.json"))]
    t0 = min(r["t0_unix"] for r in ranks)
    events = []
    for r in ranks:
        final = max((e["step"] for e in r["events"]), default=0)
        for e in r["events"]:
            if e["step"] > final - last_steps:
                shift = r["t0_unix"] - t0
                events.append(
                    {**e, "rank": r["rank"], "stage": r["stage"], "start": e["start"] + shift, "end": e["end"] + shift}
                )
    start = min(e["start"] for e in events)
    for e in events:
        e["start"] -= start
        e["end"] -= start
    chrome_trace(events, out / "trace.json")
    timeline_png(events, out / "timeline.png", title=f"{schedule}: executed instructions, last {last_steps} steps")
    return out / "timeline.png"
