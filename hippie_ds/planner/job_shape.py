"""The job's shape and the plan's: what ``hippie-ds plan`` keeps of the job a profile was
measured in (:func:`keep_shape`), and the changes a plan of another shape asks of the job
(:func:`shape_changes`), printed by ``hippie-ds plan`` and by the start-up refusal of a module whose
stage count is not the plan's (:func:`hippie_ds.adapter.module.pipeline_module.check_plan`). Pure Python.

A job's shape lives in three places the user sets: the model's pipeline size (``num_stages=`` where
the ``PipelineModule`` is built, or the ``topology=`` a model class builds from its own argument:
Megatron-DeepSpeed's ``--pipeline-model-parallel-size``), the launcher's rank count (stages x
data-parallel replicas) and the DeepSpeed config's batch keys (``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``train_batch_size``; ``hippie.plan`` merges the plan's, and refuses
a config key that says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .profile import PlannerError
from .profile_fields import JobShape

STAGE_SOURCES = ("topology=", "num_stages=")


@dataclass
class KeptShape:
    """What the search is restricted to: pipeline depths and micro-batch sizes (None: all), the
    global batch, and the line that says what was kept (None: nothing to say)."""

    depths: list[int] | None
    micro_batch_sizes: list[int] | None
    global_batch: int
    message: str | None


def keep_shape(
    job: JobShape | None,
    devices: int,
    *,
    depths: Sequence[int] | None = None,
    search_all: bool = False,
    micro_batch_sizes: Sequence[int] | None = None,
    global_batch: int | None = None,
) -> KeptShape:
    """The job's shape kept unless told otherwise: without ``depths`` (``--stages``) and
    ``search_all`` (``--stages all``) on a cluster of the job's device count, its stage count and
    (without ``micro_batch_sizes``) its micro-batch size; without ``global_batch`` its global batch.
    Raises :class:`PlannerError` (naming the option) when the global batch is missing, or when the
    kept shape cannot run the global batch given."""
    if global_batch is None:
        if job is None:
            raise PlannerError(
                "--global-batch is required: the profile records no job shape (a profile measured "
                "in place with hippie.profile records the job's train_batch_size)"
            )
        global_batch = job.global_batch
    sizes = list(micro_batch_sizes) if micro_batch_sizes else None
    if job is None or depths or search_all:
        told = "--stages all" if search_all else (f"--stages {','.join(map(str, depths))}" if depths else None)
        message = (
            None
            if job is None
            else (
                f"the profiled job ran {job.describe()}; searching {told}"
                + (f", global batch {global_batch}" if global_batch != job.global_batch else "")
            )
        )
        return KeptShape(list(depths) if depths else None, sizes, global_batch, message)
    if devices != job.world_size:
        return KeptShape(
            None,
            sizes,
            global_batch,
            f"the profiled job ran {job.describe()} on {job.world_size} ranks; the cluster has "
            f"{devices} devices, so other stage counts are searched (global batch {global_batch})",
        )
    sizes = sizes or [job.micro_batch_size]
    replicas = job.data_parallel
    if any(global_batch % (replicas * b) for b in sizes):
        bad = next(b for b in sizes if global_batch % (replicas * b))
        raise PlannerError(
            f"--global-batch {global_batch}: the job's shape from the profile ({job.stages} stages x "
            f"{replicas} replicas, micro-batch {bad}) needs a multiple of {replicas * bad} (replicas x "
            "micro-batch); pass another --global-batch, --micro-batch-size, or --stages to search other "
            "shapes"
        )
    kept = [f"{job.stages} stage{'s' if job.stages != 1 else ''} x {replicas} replica{'s' if replicas != 1 else ''}"]
    kept.append(
        f"micro-batch {job.micro_batch_size}"
        if micro_batch_sizes is None
        else f"micro-batch {','.join(map(str, sizes))} (--micro-batch-size)"
    )
    kept.append(f"global batch {global_batch}" + (" (--global-batch)" if global_batch != job.global_batch else ""))
    return KeptShape(
        [job.stages],
        sizes,
        global_batch,
        f"keeping the job's shape from the profile: {', '.join(kept)}; pass --stages (a list, or "
        "'all') to search other shapes",
    )


def pipeline_size_change(stages: int, stages_from: str | None) -> str:
    """Where the model's stage count is set, for a stage count to change to."""
    if stages_from == "num_stages=":
        return f"num_stages={stages} where the PipelineModule is built"
    topology = (
        "the topology= the model class builds from its own pipeline-size argument (e.g. Megatron-DeepSpeed's "
        f"--pipeline-model-parallel-size {stages}; hippie_ds.make_topology({stages}, world_size) or "
        f"PipeModelDataParallelTopology(num_pp={stages}, ...))"
    )
    if stages_from == "topology=":
        return topology
    return f"num_stages={stages} where the PipelineModule is built, or " + topology


def shape_changes(
    plan,
    *,
    stages: int | None,
    world_size: int | None = None,
    stages_from: str | None = None,
    micro_batch_size: int | None = None,
    micro_batches: int | None = None,
    global_batch: int | None = None,
    virtual_stages: int | None = None,
) -> list[str]:
    """The changes that run ``plan`` (a :class:`~.plan_file.Plan`) in a job of the given shape
    (None: not known; the plan's value is named). Empty when the shapes agree."""
    out = []
    if stages is not None and stages != plan.pipeline_depth:
        out.append(
            f"pipeline stages {stages} -> {plan.pipeline_depth}: "
            + pipeline_size_change(plan.pipeline_depth, stages_from)
        )
    if world_size is not None and world_size != plan.world_size:
        out.append(
            f"ranks {world_size} -> {plan.world_size}: the launcher's rank count (deepspeed --num_gpus / "
            f"--num_nodes, or the hostfile's slots), {plan.pipeline_depth} stages x {plan.data_parallel} "
            "data-parallel replicas"
        )
    elif stages is not None and stages != plan.pipeline_depth:
        dp = (world_size or plan.world_size) // stages
        out.append(
            f"data-parallel replicas {dp} -> {plan.data_parallel}: follows from the same "
            f"{plan.world_size} ranks over {plan.pipeline_depth} stages"
        )
    batch = (micro_batch_size, micro_batches, global_batch)
    planned = (plan.micro_batch_size, plan.micro_batches, plan.global_batch)
    if out or batch != planned:
        keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
        said = [f"{k} {v} -> {p}" if v is not None and v != p else f"{k} {p}" for k, v, p in zip(keys, batch, planned)]
        out.append(
            "batch keys " + ", ".join(said) + " (hippie.plan merges the plan's: leave them out of the "
            "DeepSpeed config or set these values; Megatron-DeepSpeed: --micro-batch-size "
            f"{plan.micro_batch_size} --global-batch-size {plan.global_batch})"
        )
    if virtual_stages is not None and virtual_stages != plan.virtual_stages:
        out.append(
            f"model chunks per stage {virtual_stages} -> {plan.virtual_stages}: pipeline.virtual_stages "
            f"(schedule {plan.schedule!r}; a hippie_ds.PipelineModule takes it from the plan)"
        )
    return out


def changes_from_job(job: JobShape, plan) -> list[str]:
    """:func:`shape_changes` from a profiled job's shape to ``plan``'s."""
    return shape_changes(
        plan,
        stages=job.stages,
        world_size=job.world_size,
        micro_batch_size=job.micro_batch_size,
        micro_batches=job.micro_batches,
        global_batch=job.global_batch,
        virtual_stages=job.virtual_stages,
    )


def format_changes(changes: Sequence[str], head: str) -> str:
    return head + "".join(f"\n  - {c}" for c in changes)


@dataclass(frozen=True)
class Job:
    """The job as it is: what the user runs today (stages, micro-batch size, schedule; None: not
    known, every schedule considered stands in), a candidate of every plan (:mod:`.job_candidates`)."""

    stages: int
    micro_batch_size: int
    schedule: str | None
    source: str

    def describe(self) -> str:
        return (
            f"{self.stages} stage{'s' if self.stages != 1 else ''}, micro-batch {self.micro_batch_size}, "
            + (f"schedule {self.schedule}" if self.schedule else "its schedule not known (every schedule considered)")
            + f" ({self.source})"
        )


def parse_job(text: str) -> tuple[int, int, str | None]:
    """``--job K,B[,SCHEDULE]``: stages, micro-batch size, schedule (None: not given)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        stages, micro = int(parts[0]), int(parts[1])
        if stages < 1 or micro < 1:
            raise ValueError
    except ValueError:
        raise PlannerError(
            f"--job {text!r}: expected STAGES,MICRO_BATCH[,SCHEDULE] with positive integers, e.g. 4,32,hippie-1f1b"
        ) from None
    return stages, micro, (parts[2] or None) if len(parts) == 3 else None


def job_as_it_is(
    job: JobShape | None,
    devices: int,
    global_batch: int,
    *,
    given: str | None = None,
    depths: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    schedules: Sequence[str] = (),
) -> tuple[Job | None, str | None]:
    """The job as it is on ``devices`` devices for ``global_batch``, and why there is none: ``given``
    (``--job``), else the profile's job shape, else the one shape ``depths`` and
    ``micro_batch_sizes`` name (``--stages``, ``--micro-batch-size``; the schedule when ``schedules``
    names one). Raises :class:`PlannerError` for a ``--job`` the cluster cannot run."""
    if given is not None:
        stages, micro, schedule = parse_job(given)
        found, source = Job(stages, micro, schedule, "--job"), "--job"
    elif job is not None:
        found, source = Job(job.stages, job.micro_batch_size, None, "the profile's job shape"), "the profile's job"
    elif depths and len(depths) == 1 and micro_batch_sizes and len(micro_batch_sizes) == 1:
        found = Job(
            depths[0],
            micro_batch_sizes[0],
            schedules[0] if len(schedules) == 1 else None,
            "--stages and --micro-batch-size",
        )
        source = "--stages/--micro-batch-size"
    else:
        return None, (
            "no job to compare with: the profile records no job shape; pass --job STAGES,MICRO_BATCH"
            "[,SCHEDULE] (or one --stages and one --micro-batch-size)"
        )
    replicas = devices // found.stages if devices % found.stages == 0 else 0
    why = (
        f"{found.stages} stages do not divide the {devices} devices"
        if not replicas
        else f"global batch {global_batch} is not a multiple of {replicas} replicas x micro-batch "
        f"{found.micro_batch_size}"
        if global_batch % (replicas * found.micro_batch_size)
        else None
    )
    if why is None:
        return found, None
    if given is not None:
        raise PlannerError(f"--job {given!r}: {why}")
    return None, f"{source} ({found.describe()}) cannot run here: {why}"
