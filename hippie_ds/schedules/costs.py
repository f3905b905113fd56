"""Cost models for the schedule simulator: per-stage compute/memory costs and the network.

Pure Python (pydantic, pyyaml). Times are seconds, sizes bytes, bandwidths bytes per second.
Used by the simulator, the CLI, the planner and the engine's cost-based ``'auto'`` choices.

A cost file (YAML or JSON) looks like::

    stages:                 # one mapping per stage, or a single mapping for every stage
      - {forward: 0.020, backward: 0.040, activation_bytes: 4.2e6, saved_bytes: 3.0e7, param_bytes: 1.37e7}
      - forward: 0.020
        backward: 0.040
        param_bytes: 1.37e7
        layers:             # optional, in PipelineModule order: what partial deferral
          - {param_bytes: 0.6e7, backward: 0.010}   # (hippie.deferred_layers) delays
          - {param_bytes: 0.77e7, backward: 0.030}
    comm:
      p2p_bandwidth: 10.0e9
      allreduce_bandwidth: 1.25e8   # 1 Gbit/s inter-node link
      data_parallel: 2
    tied_groups: [[0, 3]]   # optional: stages sharing a tied module (none given: all stages)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hippie_ds.data_files import describe, read_data_file


class CostsError(ValueError):
    """A cost description that cannot be used; the message names the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerShare(_Strict):
    """One layer of a stage, for partial deferral (``hippie.deferred_layers``): what delaying it
    moves out of the step (its gradient bytes) and how much earlier the rest of the stage's
    gradient is final (its backward time; the first layers' backward runs last)."""

    param_bytes: float = Field(
        ge=0,
        description="bytes of this layer's parameters; only their share of the "
        "stage's layers matters (parameter counts do)",
    )
    backward: float | None = Field(
        None,
        ge=0,
        description="backward time of one micro-batch through this layer "
        "(s); default: the stage's backward split by parameter share",
    )


class DelayedPart(NamedTuple):
    """A deferred stage's delayed part: ``fraction`` of its gradient bytes is buffered and applied
    one step late; the rest is final ``lead`` seconds before its last backward ends (the engine
    starts that part's all-reduce then)."""

    fraction: float
    lead: float = 0.0


class StageCost(_Strict):
    """What one pipeline stage costs per micro-batch and per step."""

    forward: float = Field(ge=0, description="forward time of one micro-batch (s)")
    backward: float = Field(ge=0, description="backward time of one micro-batch (s)")
    recompute: float = Field(0.0, ge=0, description="extra backward time when activations are re-computed (s)")
    backward_weight: float | None = Field(
        None,
        ge=0,
        description="the part of backward that computes parameter "
        "gradients (W of a split backward, s); default half of backward",
    )
    split_extra: float = Field(
        0.0,
        ge=0,
        description="what a split backward's two autograd passes cost beyond "
        "backward, charged in its input pass (s; a profile's split_extra)",
    )
    activation_bytes: float = Field(
        0.0, ge=0, description="bytes sent to the next stage per micro-batch (its gradient sent back has the same size)"
    )
    saved_bytes: float = Field(0.0, ge=0, description="activation memory held per in-flight micro-batch")
    param_bytes: float = Field(0.0, ge=0, description="bytes of this stage's parameters (= its gradients)")
    optimizer_time: float = Field(0.0, ge=0, description="time of one optimizer step of this stage (s)")
    # What handing work to the communication threads costs the caller: on GPUs a kernel launch
    # (nothing), on a CPU core shared with gloo a copy and a hand-off of milliseconds.
    send_issue_time: float = Field(
        0.0,
        ge=0,
        description="time the stage spends in one non-blocking send call (s); a blocking send is timed as its transfer",
    )
    allreduce_issue_time: float = Field(
        0.0, ge=0, description="time the stage spends starting one asynchronous all-reduce (s)"
    )
    allreduce_cpu_time: float = Field(
        0.0,
        ge=0,
        description="compute time an all-reduce of this stage's "
        "whole gradient takes from the stage while in flight (s): copies, "
        "reductions and network work on a core compute shares; 0 on GPUs",
    )
    layers: list[LayerShare] | None = Field(
        None,
        min_length=1,
        description="per-layer breakdown in PipelineModule order (partial deferral); none: not known",
    )

    @model_validator(mode="after")
    def _weight_within_backward(self):
        if self.backward_weight is not None and self.backward_weight > self.backward:
            raise ValueError(
                f"backward_weight = {self.backward_weight} exceeds backward = {self.backward} "
                "(it is the weight-gradient part of backward)"
            )
        return self

    def delayed_part(self, layers: int) -> DelayedPart:
        """What delaying the first ``layers`` layers (``hippie.deferred_layers``) means in costs.
        The share is by gradient bytes (all of it for a stage without parameters once every layer
        is delayed); the lead is those layers' backward time, each layer's own or, when not
        given, the stage's backward split by parameter share. Needs :attr:`layers`."""
        if not self.layers:
            raise CostsError(
                "stage costs have no per-layer breakdown (field layers): partial deferral needs each "
                "layer's param_bytes (and optionally backward)"
            )
        n = len(self.layers)
        if isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= n:
            raise CostsError(f"delayed layers = {layers!r}: allowed 0..{n} for a stage of {n} layers")
        total = sum(x.param_bytes for x in self.layers)
        head = self.layers[:layers]
        fraction = sum(x.param_bytes for x in head) / total if total > 0 else float(layers == n)
        lead = sum(
            x.backward
            if x.backward is not None
            else (self.backward * x.param_bytes / total if total > 0 else self.backward / n)
            for x in head
        )
        return DelayedPart(fraction, min(lead, self.backward))

    def delayed_share(self, fraction: float) -> DelayedPart:
        """What delaying ``fraction`` of the gradient bytes means in costs when the layers are not
        known (a run reports only its share): the delayed layers' backward time taken as that share
        of the stage's backward, :meth:`delayed_part`'s rule for layers without their own time."""
        return DelayedPart(fraction, min(fraction * self.backward, self.backward))

    @property
    def weight_time(self) -> float:
        """W of a split backward: the parameter gradients."""
        return self.backward / 2 if self.backward_weight is None else self.backward_weight

    @property
    def input_time(self) -> float:
        """B of a split backward (backward_input): the gradient sent to the previous stage, with
        what the split costs beyond the whole backward."""
        return self.backward - self.weight_time + self.split_extra


class CommCost(_Strict):
    """The network: fast pipeline links inside a node, a slower inter-node link for data parallelism."""

    p2p_bandwidth: float = Field(10e9, gt=0, description="pipeline send/recv bandwidth (bytes/s; .inf = free)")
    p2p_latency: float = Field(0.0, ge=0)
    allreduce_bandwidth: float = Field(1.25e8, gt=0, description="inter-node link bandwidth (bytes/s), 1 Gbit/s")
    allreduce_latency: float = Field(0.0, ge=0)
    data_parallel: int = Field(1, ge=1, description="replicas of every stage (the all-reduce group size)")
    wire_ratio: float = Field(
        1.0,
        gt=0,
        description="bytes the all-reduce sends per gradient byte (param_bytes): "
        "0.5 when DeepSpeed's communication_data_type is bf16 or fp16 and the gradients fp32",
    )
    # Pipeline inside a node, data parallelism across nodes (brief section 4): every stage's
    # all-reduce crosses the same inter-node link, so concurrent ones split its bandwidth.
    shared_link: bool = True


class Costs(_Strict):
    stages: list[StageCost] = Field(min_length=1)
    comm: CommCost = CommCost()
    # DeepSpeed's ReduceTiedGrads all-reduces each tied module's gradient over the stages that hold
    # it, and nothing else: a model without tied modules passes through it without waiting.
    tied_groups: list[list[int]] | None = Field(
        None,
        description="the stages sharing each tied module "
        "(TiedLayerSpec), in the engine's order; none: not known, "
        "every stage waits for all (the worst case); []: no tied modules",
    )

    @model_validator(mode="after")
    def _tied_groups_in_range(self):
        for i, group in enumerate(self.tied_groups or []):
            bad = [s for s in group if not 0 <= s < len(self.stages)]
            if bad or not group or len(set(group)) != len(group):
                raise ValueError(
                    f"tied_groups[{i}] = {group}: stage indices must be distinct and within "
                    f"0..{len(self.stages) - 1}, at least one"
                )
        return self

    def tied_groups_of(self, stage: int) -> list[tuple[int, list[int]]]:
        """(index, stages) of the tied groups ``stage`` waits in at ReduceTiedGrads, in order."""
        groups = [list(range(len(self.stages)))] if self.tied_groups is None else self.tied_groups
        return [(i, g) for i, g in enumerate(groups) if stage in g]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def without_allreduce(self) -> "Costs":
        """The same costs with one replica: every all-reduce free, the pipeline's compute shape
        alone (what the all-reduces are measured against)."""
        return self.model_copy(update={"comm": self.comm.model_copy(update={"data_parallel": 1})})

    # -- derived times ---------------------------------------------------------------------
    def allreduce_work(self, stage: int) -> float:
        """Seconds the ring all-reduce of ``stage``'s gradients occupies the link at full
        bandwidth: 2(r-1)/r * |W| * wire_ratio / bandwidth (0 when r = 1)."""
        r = self.comm.data_parallel
        if r == 1:
            return 0.0
        wire = self.stages[stage].param_bytes * self.comm.wire_ratio
        return 2 * (r - 1) / r * wire / self.comm.allreduce_bandwidth

    def allreduce_latency_total(self) -> float:
        """The latency part of a ring all-reduce: 2(r-1) message start-ups."""
        r = self.comm.data_parallel
        return 2 * (r - 1) * self.comm.allreduce_latency if r > 1 else 0.0

    def allreduce_time(self, stage: int) -> float:
        """Stand-alone ring all-reduce time of ``stage``'s gradients (no link sharing)."""
        return self.allreduce_work(stage) + self.allreduce_latency_total()

    def p2p_time(self, stage: int) -> float:
        """Time to move stage ``stage``'s output activation to stage+1 (or its gradient back)."""
        return self.comm.p2p_latency + self.stages[stage].activation_bytes / self.comm.p2p_bandwidth

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def uniform(
        cls,
        stages: int,
        forward: float = 1.0,
        backward: float = 2.0,
        recompute: float = 0.0,
        activation_bytes: float = 0.0,
        saved_bytes: float = 0.0,
        param_bytes: float = 0.0,
        optimizer_time: float = 0.0,
        comm: CommCost | Mapping[str, Any] | None = None,
    ) -> "Costs":
        """``stages`` identical stages."""
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise CostsError(f"stages = {stages!r}: must be an integer >= 1")
        one = dict(
            forward=forward,
            backward=backward,
            recompute=recompute,
            activation_bytes=activation_bytes,
            saved_bytes=saved_bytes,
            param_bytes=param_bytes,
            optimizer_time=optimizer_time,
        )
        return cls._build({"stages": [one] * stages, "comm": _comm_dict(comm)}, "Costs.uniform")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], num_stages: int | None = None, where: str = "costs") -> "Costs":
        """From ``{stages: [...] | {...}, comm: {...}}``; a single stage mapping is used for all
        ``num_stages`` stages."""
        if not isinstance(data, Mapping):
            raise CostsError(f"{where}: expected a mapping with keys 'stages' and 'comm', got {type(data).__name__}")
        data = dict(data)
        if data.get("comm", {}) is None:  # an empty `comm:` section in YAML
            del data["comm"]
        if "stages" not in data:
            raise CostsError(f"{where}: field stages: missing (a list of per-stage costs, or one mapping for all)")
        stages = data["stages"]
        if isinstance(stages, Mapping):
            if num_stages is None:
                raise CostsError(f"{where}: field stages is a single mapping; pass num_stages to expand it")
            data["stages"] = [dict(stages)] * num_stages
        elif isinstance(stages, Sequence) and not isinstance(stages, str):
            if num_stages is not None and len(stages) != num_stages:
                raise CostsError(f"{where}: field stages lists {len(stages)} stages, expected {num_stages}")
        else:
            raise CostsError(f"{where}: field stages: expected a list or a mapping, got {type(stages).__name__}")
        return cls._build(data, where)

    @classmethod
    def from_file(cls, path: str | Path, num_stages: int | None = None) -> "Costs":
        """Load a YAML or JSON cost file (see the module docstring)."""
        data = read_data_file(path, "cost", CostsError)
        return cls.from_dict(data, num_stages=num_stages, where=str(path))

    @classmethod
    def from_layers(
        cls,
        layer_costs: Sequence[Mapping[str, Any]],
        boundaries: Sequence[int],
        comm: CommCost | Mapping[str, Any] | None = None,
    ) -> "Costs":
        """Stages from per-layer costs. Each layer: forward, backward, and optionally recompute,
        backward_weight (summed when every layer of the stage has it), split_extra, saved_bytes, param_bytes,
        optimizer_time (summed over the stage's layers) and
        output_bytes (the stage's activation_bytes is its last layer's); each stage keeps its
        layers' param_bytes and backward (``StageCost.layers``, for partial deferral). ``boundaries`` are
        DeepSpeed-style ``parts`` [0, b1, ..., N] (K+1 entries) or the K stage start indices
        [0, b1, ..., b_{K-1}]."""
        layers = []
        for i, lc in enumerate(layer_costs):
            try:
                layers.append(_LayerCost.model_validate(lc))
            except ValidationError as exc:
                raise CostsError(_format(exc, f"layer_costs[{i}]")) from None
        n = len(layers)
        parts = [int(b) for b in boundaries]
        if not parts or parts[0] != 0:
            raise CostsError(f"boundaries {list(boundaries)}: must start at 0")
        if parts[-1] != n:
            parts.append(n)
        if any(b >= a for a, b in zip(parts[1:], parts)) or parts[-1] > n:
            raise CostsError(
                f"boundaries {list(boundaries)}: must be strictly increasing within 0..{n} "
                f"(every stage needs at least one of the {n} layers)"
            )
        stages = []
        for a, b in zip(parts, parts[1:]):
            seg = layers[a:b]
            stages.append(
                {
                    "forward": sum(x.forward for x in seg),
                    "backward": sum(x.backward for x in seg),
                    "recompute": sum(x.recompute for x in seg),
                    "saved_bytes": sum(x.saved_bytes for x in seg),
                    "split_extra": sum(x.split_extra for x in seg),
                    "backward_weight": (
                        None if any(x.backward_weight is None for x in seg) else sum(x.backward_weight for x in seg)
                    ),
                    "param_bytes": sum(x.param_bytes for x in seg),
                    "optimizer_time": sum(x.optimizer_time for x in seg),
                    "activation_bytes": seg[-1].output_bytes,
                    "layers": [{"param_bytes": x.param_bytes, "backward": x.backward} for x in seg],
                }
            )
        return cls._build({"stages": stages, "comm": _comm_dict(comm)}, "Costs.from_layers")

    @classmethod
    def _build(cls, data: Mapping[str, Any], where: str) -> "Costs":
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise CostsError(_format(exc, where)) from None


class _LayerCost(_Strict):
    forward: float = Field(ge=0)
    backward: float = Field(ge=0)
    backward_weight: float | None = Field(None, ge=0)
    split_extra: float = Field(0.0, ge=0)
    recompute: float = Field(0.0, ge=0)
    saved_bytes: float = Field(0.0, ge=0)
    param_bytes: float = Field(0.0, ge=0)
    optimizer_time: float = Field(0.0, ge=0)
    output_bytes: float = Field(0.0, ge=0)


def _comm_dict(comm: CommCost | Mapping[str, Any] | None) -> dict:
    if comm is None:
        return {}
    if isinstance(comm, CommCost):
        return comm.model_dump()
    return dict(comm)


def _format(exc: ValidationError, where: str) -> str:
    return "invalid costs:\n  " + "\n  ".join(describe(exc, where))
