"""The plan file: what the planner writes (:class:`Plan`, per-stage :class:`StagePlan`, the
baselines it compared), how it is saved and loaded, and its text summary. Pure Python."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hippie_ds.config import DEFAULT_DEFERRED_LAYERS
from hippie_ds.data_files import describe, read_data_file, write_data_file

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
    steps_factor: float = Field(
        1.0,
        ge=1.0,
        description="steps to a loss relative to no staleness: 1 + the "
        "staleness price x the stale share of the gradient (the price and its source: the "
        "plan's assumptions); a priced objective (time-to-loss) ranks by throughput / this",
    )
    throughput: float = Field(ge=0, description="samples per second")
    scalability: float = Field(ge=0, description="throughput / (devices x single-device throughput)")
    memory: float = Field(ge=0, description="memory the objective uses (bytes): mean or max per device")
    memory_max: float = Field(ge=0, description="largest per-device memory (bytes)")
    memory_per_stage: list[float] = Field(description="per-device memory of each stage (bytes)")
    memory_working_per_stage: list[float] | None = Field(
        None,
        description="of memory_per_stage, the working memory (bytes): the largest one layer's forward+backward "
        "needs above what it keeps; the rest (state, deferral buffers, weight versions, kept activations) "
        "is what a count of live state and saved tensors sees",
    )
    me: float = Field(ge=0, description="memory efficiency: scalability x throughput / memory, samples/s per GB")
    fits: bool = Field(description="every device within its memory (and the memory cap)")
    predicted_by: Literal["simulator", "analytic"]
    objective_value: float | None = Field(
        None,
        description="the figure the plan's objective ranks this row by "
        "(hippie_ds.planner.objectives; throughput: samples/s, me: ME)",
    )


class StagePlan(_Strict):
    """One model part: a stage's (with virtual stages, one chunk of a stage's)."""

    stage: int = Field(ge=0, description="the pipeline stage (rank) holding this part")
    chunk: int = Field(0, ge=0, description="which of the stage's model chunks it is (virtual stages; else 0)")
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1, description="one past the stage's last layer")
    checkpointed: list[int] = Field(default_factory=list, description="layers re-computed in backward")
    forward: float = Field(ge=0, description="forward time of one micro-batch (s; the last part's with the loss's)")
    backward: float = Field(
        ge=0,
        description="backward time of one micro-batch, without re-computation (s; the last part's with the loss's)",
    )
    recompute: float = Field(ge=0, description="extra backward time of the re-computed layers (s)")
    param_bytes: float = Field(ge=0)
    activation_bytes: float = Field(ge=0, description="bytes sent to the next stage per micro-batch")
    kept_bytes: float = Field(ge=0, description="activation bytes kept per in-flight micro-batch")
    in_flight: int = Field(ge=1, description="peak micro-batches whose activations are held (this chunk's)")
    deferred: bool = Field(False, description="all-reduce deferred to the next step (gradient buffer)")
    deferred_layers: int | None = Field(
        None,
        ge=1,
        description="of a deferred stage: its leading layers with "
        "parameters whose gradient is applied one step late (hippie.deferred_layers "
        "'auto'; its layer count: the whole stage); none: not chosen, the config's "
        f"value applies (default {DEFAULT_DEFERRED_LAYERS!r})",
    )
    delayed_share: float = Field(
        0.0, ge=0, le=1, description="share of the stage's gradient bytes applied one step late"
    )
    memory: float = Field(
        ge=0,
        description="peak memory of one device of this stage (bytes; all its chunks): "
        "param_bytes x state factor (+ a deferred stage's gradient buffer and staleness delta) + "
        "activation_memory + working_memory",
    )
    activation_memory: float = Field(
        0.0,
        ge=0,
        description="of which activations held for backward: in-flight "
        "micro-batches x kept bytes (the last part's: with what "
        "the loss saves) + the largest re-computed run "
        "(this chunk's)",
    )
    working_memory: float = Field(
        0.0,
        ge=0,
        description="of which the largest working memory of one layer's "
        "forward+backward on the stage (the loss's on the last part): "
        "beyond what it keeps, on top of the activations",
    )


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
    deferred_layers: dict[str, int] = Field(
        default_factory=dict,
        description="{deferred stage: leading layers with "
        "parameters delayed} of a searched deferral; empty: the config's default",
    )
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
    objective_figure: str | None = Field(
        None, description="what the objective's figure is (prediction.objective_value, on the plan and every row)"
    )
    job: str | None = Field(
        None, description="the job as it is, a candidate (baselines named job:...), or why there is none"
    )
    chosen_from: Literal["search", "job"] = Field(
        "search", description="'job': the job as it is won, the plan is its own configuration"
    )
    memory_metric: Literal["mean", "max"] = "mean"
    memory_cap: float | None = Field(None, gt=0)
    pipeline_depth: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    micro_batches: int = Field(ge=1)
    schedule: str
    virtual_stages: int = Field(1, ge=1, description="model chunks per stage (pipeline.virtual_stages)")
    layout: Literal["interleaved", "v"] = Field(
        "interleaved", description="which model part each chunk of each stage holds (hippie_ds.schedules.layout)"
    )
    schedule_params: dict[str, Any] = Field(default_factory=dict)
    boundaries: list[int] = Field(
        description="DeepSpeed parts: [0, b1, ..., num_layers], pipeline_depth x virtual_stages + 1 entries"
    )
    checkpointed_layers: list[int] = Field(default_factory=list)
    stages: list[StagePlan] = Field(description="one entry per model part, in model order")
    prediction: Prediction
    single_device_throughput: float = Field(gt=0, description="samples/s of one device, the scalability reference")
    baselines: list[Baseline] = Field(default_factory=list)
    candidates: list[Candidate] = Field(
        default_factory=list,
        description="runner-ups by predicted step: other cuts of this configuration, other configurations",
    )
    profile_spread: float | None = Field(
        None,
        ge=0,
        description="the profile's relative time spread "
        "(noise.time_spread): "
        "candidates within it of the plan's step are not told apart by the profile",
    )
    profile_steps: int | None = Field(
        None,
        ge=1,
        description="the steps the profile was measured over (Profile.steps); none: one pass or not recorded",
    )
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
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} x micro_batches {self.micro_batches} x "
                f"data_parallel {self.data_parallel} != global_batch {self.global_batch}"
            )
        bad = [i for i in self.checkpointed_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"checkpointed_layers {bad}: outside 0..{n - 1}")
        if len(self.stages) != parts:
            raise ValueError(
                f"{len(self.stages)} stage entries for pipeline_depth {k}"
                + (f" x virtual_stages {self.virtual_stages}" if self.virtual_stages > 1 else "")
            )
        for p, st in enumerate(self.stages):
            if (st.first_layer, st.end_layer) != (b[p], b[p + 1]):
                raise ValueError(
                    f"stages[{p}] covers layers {st.first_layer}..{st.end_layer - 1}, boundaries say "
                    f"{b[p]}..{b[p + 1] - 1}"
                )
            if (st.stage, st.chunk) != geometry.place(p):
                raise ValueError(
                    f"stages[{p}] is stage {st.stage} chunk {st.chunk}; layout {self.layout!r} places "
                    f"model part {p} on stage {geometry.place(p)[0]} chunk {geometry.place(p)[1]}"
                )
        return self

    # -- use ------------------------------------------------------------------------------------
    def check_matches(
        self,
        profile: Profile | None = None,
        *,
        num_layers: int | None = None,
        fingerprint: str | None = None,
        world_size: int | None = None,
    ) -> None:
        """Raise :class:`PlanMismatchError` when the plan was made for another model (layer count
        or fingerprint) or another number of devices."""
        if profile is not None:
            num_layers = profile.num_layers if num_layers is None else num_layers
            fingerprint = profile.fingerprint() if fingerprint is None else fingerprint
        if num_layers is not None and num_layers != self.num_layers:
            raise PlanMismatchError(
                f"the plan is for {self.model!r} with {self.num_layers} layers; this model has "
                f"{num_layers}: the plan was made for another model"
            )
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"the plan is for {self.model!r} (fingerprint {self.fingerprint}); this model's "
                f"layer names or parameter sizes differ (fingerprint {fingerprint}): the plan "
                "was made for another model"
            )
        if world_size is not None and world_size != self.world_size:
            raise PlanMismatchError(
                f"the plan is for {self.world_size} devices ({self.pipeline_depth} stages x "
                f"{self.data_parallel} replicas); this job has {world_size}"
            )

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
        return {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.micro_batches,
            "pipeline": {
                "schedule": self.schedule,
                **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}),
            },
            "hippie": hippie,
        }

    def summary(self) -> str:
        from .plan_summary import format_summary

        return format_summary(self)

    @property
    def ranks_priced(self) -> bool:
        """The plan's objective ranks by the priced step (step x steps factor), not the raw one."""
        from .objectives import OBJECTIVES, PRICED

        found = OBJECTIVES.get(self.objective)
        return found is not None and found.deferral == PRICED

    def ranked_step(self, step: float, steps_factor: float) -> float:
        """The step the plan's objective compares: priced (x ``steps_factor``) or raw."""
        return step * steps_factor if self.ranks_priced else step


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
