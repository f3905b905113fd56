"""The plan file: what the planner writes (:class:`Plan`, per-stage :class:`StagePlan`, the
baselines it compared), how it is saved and loaded, and its text summary. Pure Python."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hippie_ds.config import DEFAULT_DEFERRED_LAYERS
from hippie_ds.data_files import describe, read_data_file, write_data_file
from hippie_ds.formatting import table

from .cluster import Cluster
from .profile import DEFAULT_STATE_FACTOR, PlannerError, Profile  # noqa: F401 (DEFAULT_STATE_FACTOR: re-exported)

SCHEDULES = ("1f1b", "gpipe", "hippie", "hippie-1f1b", "zb-h1")
GB = 1e9
# Bottleneck targets for re-computation, as a factor of the unchanged bottleneck (inf: every
# stage takes its least-memory choice).
# 0: no re-computation at all.
TARGETS = (0.0, 1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0, math.inf)


class PlanMismatchError(PlannerError):
    """A plan used for another model or another number of devices."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------
# The plan file

class Prediction(_Strict):
    step_time: float = Field(ge=0, description="seconds per training step (global batch)")
    steps_factor: float = Field(1.0, ge=1.0, description="steps to a loss relative to no staleness, as "
                                "hippie.staleness_price models the delayed layers; the planner ranks by "
                                "step_time x this")
    throughput: float = Field(ge=0, description="samples per second")
    scalability: float = Field(ge=0, description="throughput / (devices x single-device throughput)")
    memory: float = Field(ge=0, description="memory the objective uses (bytes): mean or max per device")
    memory_max: float = Field(ge=0, description="largest per-device memory (bytes)")
    memory_per_stage: list[float] = Field(description="per-device memory of each stage (bytes)")
    me: float = Field(ge=0, description="memory efficiency: scalability x throughput / memory, samples/s per GB")
    fits: bool = Field(description="every device within its memory (and the memory cap)")
    predicted_by: Literal["simulator", "analytic"]


class StagePlan(_Strict):
    """One model part: a stage's (with virtual stages, one chunk of a stage's)."""

    stage: int = Field(ge=0, description="the pipeline stage (rank) holding this part")
    chunk: int = Field(0, ge=0, description="which of the stage's model chunks it is (virtual stages; else 0)")
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1, description="one past the stage's last layer")
    checkpointed: list[int] = Field(default_factory=list, description="layers re-computed in backward")
    forward: float = Field(ge=0, description="forward time of one micro-batch (s; the last part's with the loss's)")
    backward: float = Field(ge=0, description="backward time of one micro-batch, without re-computation (s; the last "
                                              "part's with the loss's)")
    recompute: float = Field(ge=0, description="extra backward time of the re-computed layers (s)")
    param_bytes: float = Field(ge=0)
    activation_bytes: float = Field(ge=0, description="bytes sent to the next stage per micro-batch")
    kept_bytes: float = Field(ge=0, description="activation bytes kept per in-flight micro-batch")
    in_flight: int = Field(ge=1, description="peak micro-batches whose activations are held (this chunk's)")
    deferred: bool = Field(False, description="all-reduce deferred to the next step (gradient buffer)")
    deferred_layers: int | None = Field(None, ge=1, description="of a deferred stage: its leading layers with "
                                        "parameters whose gradient is applied one step late (hippie.deferred_layers 'auto'; "
                                        "its layer count: the whole stage); none: not chosen, the config's value applies "
                                        f"(default {DEFAULT_DEFERRED_LAYERS!r})")
    delayed_share: float = Field(0.0, ge=0, le=1, description="share of the stage's gradient bytes applied one "
                                                               "step late")
    memory: float = Field(ge=0, description="peak memory of one device of this stage (bytes; all its chunks): "
                                            "param_bytes x state factor (+ a deferred stage's gradient buffer) + "
                                            "activation_memory + working_memory")
    activation_memory: float = Field(0.0, ge=0, description="of which activations held for backward: in-flight "
                                                            "micro-batches x kept bytes (the last part's: with what "
                                                            "the loss saves) + the largest re-computed run "
                                                            "(this chunk's)")
    working_memory: float = Field(0.0, ge=0, description="of which the largest working memory of one layer's "
                                                         "forward+backward on the stage (the loss's on the last part): "
                                                         "beyond what it keeps, on top of the activations")


class Baseline(_Strict):
    name: str
    description: str
    pipeline_depth: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    micro_batches: int = Field(ge=1)
    schedule: str
    schedule_params: dict[str, Any] = Field(default_factory=dict)
    boundaries: list[int] = Field(default_factory=list, description="empty when skipped")
    checkpointed_layers: list[int] = Field(default_factory=list)
    prediction: Prediction | None = None
    skipped: str | None = Field(None, description="why it was not evaluated")


class Candidate(_Strict):
    """A runner-up beside the plan (:mod:`.candidates`): another cut of the plan's configuration, or
    another configuration, with its predicted step."""
    kind: Literal["cut", "configuration"]
    pipeline_depth: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    micro_batches: int = Field(ge=1)
    schedule: str
    virtual_stages: int = Field(1, ge=1)
    boundaries: list[int]
    checkpointed_layers: list[int] = Field(default_factory=list)
    step_time: float = Field(ge=0, description="predicted seconds per step")
    steps_factor: float = Field(1.0, ge=1.0, description="staleness price, as the plan's prediction")
    objective_value: float = Field(description="the plan's objective for this candidate")
    memory_max: float = Field(ge=0)
    predicted_by: Literal["simulator", "analytic"]

    @property
    def ranked_step(self) -> float:
        return self.step_time * self.steps_factor


class Plan(_Strict):
    """A plan file: what to run and what it is predicted to do."""

    format_version: Literal[1] = 1
    model: str
    num_layers: int = Field(ge=1)
    fingerprint: str = Field(min_length=1, description="hash of the profile's layer names and parameter sizes")
    profile_batch_size: int = Field(ge=1)
    cluster: Cluster
    world_size: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    objective: str  # a name in hippie_ds.planner.objectives.OBJECTIVES
    memory_metric: Literal["mean", "max"] = "mean"
    memory_cap: float | None = Field(None, gt=0)
    pipeline_depth: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    micro_batches: int = Field(ge=1)
    schedule: str
    virtual_stages: int = Field(1, ge=1, description="model chunks per stage (pipeline.virtual_stages)")
    layout: Literal["interleaved", "v"] = Field("interleaved", description="which model part each chunk of each "
                                                "stage holds (hippie_ds.schedules.layout)")
    schedule_params: dict[str, Any] = Field(default_factory=dict)
    boundaries: list[int] = Field(description="DeepSpeed parts: [0, b1, ..., num_layers], pipeline_depth x "
                                  "virtual_stages + 1 entries")
    checkpointed_layers: list[int] = Field(default_factory=list)
    stages: list[StagePlan] = Field(description="one entry per model part, in model order")
    prediction: Prediction
    single_device_throughput: float = Field(gt=0, description="samples/s of one device, the scalability reference")
    baselines: list[Baseline] = Field(default_factory=list)
    candidates: list[Candidate] = Field(default_factory=list, description="runner-ups by predicted step: other cuts "
                                        "of this configuration, other configurations")
    profile_spread: float | None = Field(None, ge=0, description="the profile's relative time spread "
                                         "(noise.time_spread): "
                                         "candidates within it of the plan's step are not told apart by the profile")
    profile_steps: int | None = Field(None, ge=1, description="the steps the profile was measured over "
                                      "(Profile.steps); none: one pass or not recorded")
    assumptions: dict[str, Any] = Field(default_factory=dict)
    search: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        from hippie_ds.schedules.layout import Layout
        k, n = self.pipeline_depth, self.num_layers
        geometry = Layout(self.layout, k, self.virtual_stages)  # ValueError: a V layout of other than 2 chunks
        parts = geometry.parts
        b = self.boundaries
        if len(b) != parts + 1 or b[0] != 0 or b[-1] != n or any(y <= x for x, y in zip(b, b[1:])):
            chunks = f" ({k} stages x {self.virtual_stages} virtual stages)" if self.virtual_stages > 1 else ""
            raise ValueError(f"boundaries {b}: need {parts + 1} strictly increasing entries from 0 to {n}{chunks}")
        if k * self.data_parallel != self.world_size:
            raise ValueError(f"pipeline_depth {k} x data_parallel {self.data_parallel} != world_size {self.world_size}")
        if self.micro_batch_size * self.micro_batches * self.data_parallel != self.global_batch:
            raise ValueError(f"micro_batch_size {self.micro_batch_size} x micro_batches {self.micro_batches} x "
                             f"data_parallel {self.data_parallel} != global_batch {self.global_batch}")
        bad = [i for i in self.checkpointed_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"checkpointed_layers {bad}: outside 0..{n - 1}")
        if len(self.stages) != parts:
            raise ValueError(f"{len(self.stages)} stage entries for pipeline_depth {k}"
                             + (f" x virtual_stages {self.virtual_stages}" if self.virtual_stages > 1 else ""))
        for p, st in enumerate(self.stages):
            if (st.first_layer, st.end_layer) != (b[p], b[p + 1]):
                raise ValueError(f"stages[{p}] covers layers {st.first_layer}..{st.end_layer - 1}, boundaries say "
                                 f"{b[p]}..{b[p + 1] - 1}")
            if (st.stage, st.chunk) != geometry.place(p):
                raise ValueError(f"stages[{p}] is stage {st.stage} chunk {st.chunk}; layout {self.layout!r} places "
                                 f"model part {p} on stage {geometry.place(p)[0]} chunk {geometry.place(p)[1]}")
        return self

    # -- use ------------------------------------------------------------------------------------
    def check_matches(self, profile: Profile | None = None, *, num_layers: int | None = None,
                      fingerprint: str | None = None, world_size: int | None = None) -> None:
        """Raise :class:`PlanMismatchError` when the plan was made for another model (layer count
        or fingerprint) or another number of devices."""
        if profile is not None:
            num_layers = profile.num_layers if num_layers is None else num_layers
            fingerprint = profile.fingerprint() if fingerprint is None else fingerprint
        if num_layers is not None and num_layers != self.num_layers:
            raise PlanMismatchError(f"the plan is for {self.model!r} with {self.num_layers} layers; this model has "
                                    f"{num_layers}: the plan was made for another model")
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise PlanMismatchError(f"the plan is for {self.model!r} (fingerprint {self.fingerprint}); this model's "
                                    f"layer names or parameter sizes differ (fingerprint {fingerprint}): the plan "
                                    "was made for another model")
        if world_size is not None and world_size != self.world_size:
            raise PlanMismatchError(f"the plan is for {self.world_size} devices ({self.pipeline_depth} stages x "
                                    f"{self.data_parallel} replicas); this job has {world_size}")

    def deepspeed_config(self) -> dict:
        """The config keys this plan sets (merge into a DeepSpeed config for hippie-ds)."""
        # the planner's model keeps a pipeline's stages in one node; on one node every link is the
        # same and a module built with its own topology (Megatron's GPTModelPipe) keeps it
        hippie: dict[str, Any] = {"placement": "pipeline_in_node"} if self.cluster.nodes > 1 else {}
        params = dict(self.schedule_params)
        if "deferred_stages" in params:
            hippie["deferred_stages"] = params.pop("deferred_stages")
        layers = {str(st.stage): st.deferred_layers for st in self.stages if st.deferred_layers is not None}
        if layers:
            hippie["deferred_layers"] = layers
        if params:
            hippie["schedule_params"] = params
        return {"train_batch_size": self.global_batch, "train_micro_batch_size_per_gpu": self.micro_batch_size,
                "gradient_accumulation_steps": self.micro_batches,
                "pipeline": {"schedule": self.schedule,
                             **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {})},
                "hippie": hippie}

    def summary(self) -> str:
        return format_summary(self)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write a plan as JSON (.json) or YAML (.yaml/.yml)."""
    write_data_file(path, plan.model_dump(mode="json"), default="json")


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    data = read_data_file(path, "plan", PlannerError)
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise PlannerError("invalid plan:\n  " + "\n  ".join(describe(exc, str(path)))) from None


# ---------------------------------------------------------------------------------------------
# Summary

def _gb(x: float) -> str:
    return f"{x / GB:.3g}"


def _short(xs: Sequence[int], limit: int = 40) -> str:
    if len(xs) <= limit:
        return str(list(xs))
    return "[" + ", ".join(map(str, xs[:limit // 2])) + f", ... ({len(xs) - limit} more) ..., " + \
        ", ".join(map(str, xs[-limit // 2:])) + "]"


def _ranges(xs: Sequence[int]) -> str:
    if not xs:
        return "-"
    out, start, prev = [], xs[0], xs[0]
    for x in list(xs[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def _deferred(st: StagePlan) -> str:
    """A stage's deferral: '-', 'yes', or the layers it delays and their share of its gradient."""
    if not st.deferred:
        return "-"
    if st.deferred_layers is None:
        return f"yes, {DEFAULT_DEFERRED_LAYERS}"  # the config's value; its default unless set
    layers = st.end_layer - st.first_layer
    what = "all" if st.deferred_layers >= layers else f"{st.deferred_layers}/{layers}"
    return f"{what} layers, {st.delayed_share:.0%}"


def format_summary(plan: Plan, max_stage_rows: int = 24) -> str:
    """A readable summary: the configuration, one line a stage (the first and last ones of a deep
    pipeline), and the plan beside its baselines."""
    p = plan.prediction
    lines = [
        f"plan for {plan.model} ({plan.num_layers} layers) on {plan.cluster.describe()}",
        f"objective {plan.objective}{' under ' + _gb(plan.memory_cap) + ' GB' if plan.memory_cap else ''}: "
        f"{plan.pipeline_depth} stage(s) x {plan.data_parallel} data-parallel, schedule {plan.schedule}"
        + (f" ({plan.virtual_stages} chunks per stage, layout {plan.layout})" if plan.virtual_stages > 1 else "")
        + (f" deferred_stages={_ranges(plan.schedule_params['deferred_stages']) or 'none'}"
           if "deferred_stages" in plan.schedule_params else "")
        + f", global batch {plan.global_batch} = {plan.data_parallel} x {plan.micro_batches} micro-batches of "
          f"{plan.micro_batch_size}",
        f"boundaries {_short(plan.boundaries)}; re-computed layers {_ranges(plan.checkpointed_layers)} "
        f"({len(plan.checkpointed_layers)})",
        "",
    ]
    rows = [["stage", "layers", "fwd ms", "bwd ms", "recomp ms", "params MB", "in flight", "kept MB/mb",
             "deferred", "memory GB"]]
    shown = plan.stages
    if len(shown) > max_stage_rows:
        half = max_stage_rows // 2
        shown = shown[:half] + [None] + shown[-half:]
    for st in shown:
        if st is None:
            rows.append(["...", f"({len(plan.stages) - 2 * half} more)"])
            continue
        rows.append([f"{st.stage}.{st.chunk}" if plan.virtual_stages > 1 else str(st.stage),
                     f"{st.first_layer}-{st.end_layer - 1}", f"{st.forward * 1e3:.4g}",
                     f"{st.backward * 1e3:.4g}", f"{st.recompute * 1e3:.4g}", f"{st.param_bytes / 1e6:.4g}",
                     str(st.in_flight), f"{st.kept_bytes / 1e6:.4g}", _deferred(st),
                     _gb(st.memory)])
    lines.append(table(rows[0], rows[1:]))
    lines.append("")
    rows = [["", "stages x dp", "schedule", "mb x M", "step ms", "samples/s", "scalability",
             f"mem GB ({plan.memory_metric})", "max GB", "ME", "vs DP ME", "fits"]]
    dp = next((b.prediction for b in plan.baselines if b.name == "dp" and b.prediction), None)

    def row(name, depth, width, schedule, b, M, pred):
        rel = f"{pred.me / dp.me:.2f}x" if dp and dp.me > 0 else "-"
        return [name, f"{depth} x {width}", schedule, f"{b} x {M}", f"{pred.step_time * 1e3:.4g}",
                f"{pred.throughput:.4g}", f"{pred.scalability:.3f}", _gb(pred.memory), _gb(pred.memory_max),
                f"{pred.me:.4g}", rel, "yes" if pred.fits else "NO"]

    rows.append(row("plan", plan.pipeline_depth, plan.data_parallel, plan.schedule, plan.micro_batch_size,
                    plan.micro_batches, p))
    skipped = []
    for b in plan.baselines:
        if b.prediction is None:
            skipped.append(f"{b.name}: skipped, {b.skipped}")
            continue
        rows.append(row(b.name, b.pipeline_depth, b.data_parallel, b.schedule, b.micro_batch_size, b.micro_batches,
                        b.prediction))
    lines.append(table(rows[0], rows[1:]))
    lines.extend(skipped)
    lines.append(f"ME = scalability x throughput / memory (samples/s per GB); single device {plan.single_device_throughput:.4g} "
                 f"samples/s; figures by {p.predicted_by}; planned in {plan.search.get('seconds', 0):.3g} s")
    if p.steps_factor > 1.0:
        lines.append(f"the delayed layers are priced at {p.steps_factor:.3f}x the steps to a loss (staleness_price "
                     f"{plan.assumptions.get('staleness_price')}); candidates were ranked by step x that")
    lines.extend(format_candidates(plan))
    return "\n".join(lines)


def within_spread(plan: Plan) -> list[int]:
    """Indices of the plan's candidates whose priced step is within the profile's spread of the plan's."""
    if plan.profile_spread is None:
        return []
    mine = plan.prediction.step_time * plan.prediction.steps_factor
    return [i for i, c in enumerate(plan.candidates)
            if mine > 0 and abs(c.ranked_step / mine - 1) <= plan.profile_spread]


def format_candidates(plan: Plan) -> list[str]:
    """The candidates table beside the plan, and what the profile's spread says of the margins."""
    if not plan.candidates:
        return []
    p = plan.prediction
    mine = p.step_time * p.steps_factor
    spread = plan.profile_spread
    close = set(within_spread(plan))
    rows = [["plan", f"{plan.pipeline_depth} x {plan.data_parallel}", plan.schedule,
             f"{plan.micro_batch_size} x {plan.micro_batches}", _short(plan.boundaries, 12), f"{mine * 1e3:.4g}",
             "-", ""]]
    for i, c in enumerate(plan.candidates):
        rows.append([c.kind, f"{c.pipeline_depth} x {c.data_parallel}", c.schedule, f"{c.micro_batch_size} x "
                     f"{c.micro_batches}", _short(c.boundaries, 12), f"{c.ranked_step * 1e3:.4g}",
                     f"{(c.ranked_step / mine - 1) * 100:+.1f}%" if mine > 0 else "-",
                     "within spread" if i in close else ""])
    said = f"the profile's spread {spread:.0%}" if spread is not None else "the profile records no spread"
    lines = ["", f"candidates beside the plan, by predicted step ({said}; the plan is chosen by the "
                 f"{plan.objective} objective):",
             table(["", "stages x dp", "schedule", "mb x M", "boundaries", "step ms", "vs plan", ""], rows)]
    if close:
        lines.append(f"the plan's margin over {len(close)} of them is inside the profile's spread ({spread:.0%}): the "
                     "profile cannot tell which is fastest; measure them on the job (python -m tools.bench cut-sweep "
                     "--plan PLAN --profile PROFILE)")
    from .noise import separating_steps
    steps, margin = separating_steps(plan)
    if steps is not None:
        lines.append(f"profiling steps that would separate the plan from its nearest candidate ({margin:.1%} apart): "
                     f"{steps} ('hippie': {{'profile': {{'steps': {steps}}}}}; this profile measured "
                     f"{plan.profile_steps or 'one pass'})")
    return lines
