"""Per-layer profiles: the planner's model of a network. Pure Python (pydantic, pyyaml).

A profile is a sequence of layers in execution (topological) order, measured at one
micro-batch size. Times are seconds per micro-batch of ``batch_size`` samples, sizes bytes.

* ``forward`` / ``backward``: compute time of the layer; ``recompute`` the extra backward time
  when the layer is re-computed (activation checkpointing); default: its forward time.
* ``backward_weight``: the part of ``backward`` that computes the parameter gradients (W of a
  split backward, zero-bubble schedules; the rest is the input gradient, the paper's B); at most
  ``backward`` (a larger value is an error); default half of ``backward`` (the zero-bubble
  paper's B = W). 0 for a layer without parameters; the whole backward for a layer whose input
  needs no gradient (an embedding of token ids).
* ``split_extra``: what the engine's split backward costs beyond ``backward`` (its I and W are two
  autograd passes, W one ``autograd.grad`` per parameter group): the profilers time the engine's
  own I and W on the layer and record W as ``backward_weight`` and I + W - backward here (at least
  0), so I = backward - backward_weight + split_extra; default 0 (the split free). Only a layer
  with an input gradient has one: a first layer without (None) is fed data that needs no gradient
  (token ids), and the stage holding it runs its whole backward as W; a first layer with one is
  fed floating-point data, which DeepSpeed's first stage marks as requiring grad, and that stage
  splits like the others.
* ``output_bytes``: the layer's output activation; ``saved_bytes``: what the layer keeps for
  its backward per in-flight micro-batch, attributed to the layer that produced it (default:
  ``output_bytes``); ``output_saved``: whether that includes the output (false when neither
  the layer nor the next saves it, e.g. a linear layer before tanh; a stage still holds its
  last layer's output until the backward, and the planner counts it then);
  ``input_bytes``: what enters the layer (default: the previous layer's output).
* ``param_bytes``: bytes of the layer's parameters as stored in the profile (fp32: 4 a param).
* ``working_bytes``: the memory the layer's forward+backward needs above its input, its
  parameters and what it keeps for backward (the gradient it receives, the gradients it
  produces, its temporaries), measured with the CUDA allocator (``max_memory_allocated`` around
  one forward+backward). None (a CPU profile, or an older one): :meth:`Profile.working`
  estimates it as input bytes + output bytes + param bytes, the gradients at the layer's
  boundary that a backward holds at once (the one it receives and the ones it produces); it
  cannot see a layer's internal temporaries, so it is a lower bound where those dominate.
* ``cut_bytes[i]`` (N-1 entries): bytes of every tensor crossing the cut after layer i, i.e. what
  a stage ending at layer i sends onward (and receives back as gradients). For a chain it is
  ``output_bytes[i]`` (the default); branched graphs cross with several tensors.

Profile-level fields (optional; a profile without them loads and plans as before):

* ``loss``: the loss function (``PipelineModule``'s ``loss_fn``) measured like a layer on the
  last layer's output and the labels (its own ``saved_bytes``: the logits it receives are the
  last layer's; ``input_bytes``: outputs and labels); not a layer (the layer list and the
  fingerprint stay the model's). The planner adds its times to the last model part, its saved
  bytes to what that part keeps per micro-batch and its working memory to that part's peak;
* ``param_dtype``: the dtype the parameters were trained in (``float32``, ``bfloat16``,
  ``float16``), as measured; ``param_bytes_dtype``: the dtype ``param_bytes`` counts (an in-place
  profile records the layer specs' build dtype, so a bf16 job's are fp32-sized). With both,
  :meth:`Profile.state_factor` is ``hippie-ds plan``'s default ``--state-factor``;
* ``job``: the shape of the job measured in place (stages, data-parallel replicas, micro-batch
  size, global batch, virtual stages; :class:`.profile_fields.JobShape`), which ``hippie-ds plan``
  keeps unless told otherwise (:mod:`.job_shape`); ``load``: the machine's load while measured
  (load average, process CPU over wall time; :class:`.profile_fields.MeasuredLoad`);
* ``groups``: layers that are the same work (same class, parameter shapes and input shape),
  measured as one group: each member's times are the group's pooled median. Per layer,
  ``spread`` is the relative inter-quartile range of its timed repeats (forward and backward,
  over the median) and ``own_ratio`` its own median over the pooled one; identical layers whose
  own medians part by more than :data:`.noise.NOISE_MARGIN` make the profile noisy
  (:mod:`.noise`: a warning when it is written and when it is planned from).

Scaling assumption: times and activation sizes (working memory and the loss's figures too)
scale linearly with the micro-batch size (``Profile.scaled(b)`` multiplies them by
``b / batch_size``), parameters do not. This ignores
kernel efficiency changes at small batches; it is the usual first-order model (PipeDream's
planner makes the same one).

A profile file (YAML or JSON)::

    model: my-model
    batch_size: 8
    layers:
      - {name: embed, forward: 0.001, backward: 0.002, output_bytes: 4.0e6, param_bytes: 2.0e8}
      - {name: block0, forward: 0.003, backward: 0.006, backward_weight: 0.003, ...}
      - ...
    cut_bytes: [...]   # optional, N-1 entries

PipeDream ``graph.txt`` profiles are read by :func:`.pipedream_profile.read_pipedream`; either
format by :func:`.profile_io.load_profile`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hippie_ds.data_files import describe, write_data_file

from .profile_fields import JobShape, MeasuredLoad


DEFAULT_STATE_FACTOR = 4.0  # fp32 weights, gradients and two Adam moments per fp32 parameter byte
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlannerError(ValueError):
    """Input the planner cannot use (profile, cluster, plan); the message says which and why."""


class ProfileError(PlannerError):
    """A profile that cannot be read or used; the message names the file, line or field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerProfile(_Strict):
    name: str = Field(min_length=1)
    forward: float = Field(ge=0, description="forward time of one micro-batch (s)")
    backward: float = Field(ge=0, description="backward time of one micro-batch (s)")
    backward_weight: float | None = Field(
        None,
        ge=0,
        description="the parameter-gradient part of backward (W of a split backward, s; default half of backward)",
    )
    split_extra: float | None = Field(
        None,
        ge=0,
        description="what the engine's split backward (I, then W: one "
        "autograd.grad per parameter group) costs beyond the whole backward (s); its I "
        "is backward - backward_weight + this (default 0: the split free)",
    )
    recompute: float | None = Field(None, ge=0, description="extra backward time when re-computed (default forward)")
    output_bytes: float = Field(0.0, ge=0, description="bytes of the layer's output activation")
    saved_bytes: float | None = Field(None, ge=0, description="bytes kept for backward (default output_bytes)")
    output_saved: bool | None = Field(
        None, description="saved_bytes includes the output: this layer or the next saves it for backward (default true)"
    )
    input_bytes: float | None = Field(None, ge=0, description="bytes entering the layer (default: previous output)")
    param_bytes: float = Field(0.0, ge=0, description="bytes of parameters (fp32: 4 per parameter)")
    working_bytes: float | None = Field(
        None,
        ge=0,
        description="memory the forward+backward needs above the input, "
        "parameters and saved bytes (CUDA allocator peak; default: an estimate)",
    )
    tied_key: str | None = Field(
        None,
        min_length=1,
        description="the key of a module tied to other layers "
        "(TiedLayerSpec): param_bytes counts it at its first use only, and every other stage "
        "that uses it holds a copy of those bytes",
    )
    spread: float | None = Field(
        None,
        ge=0,
        description="relative spread of the timed repeats: inter-quartile range "
        "of forward + backward over their median (a group's: over all its repeats)",
    )
    own_ratio: float | None = Field(
        None,
        gt=0,
        description="of a grouped layer: its own median forward + backward "
        "over the group's pooled median (1: it agrees with its group)",
    )

    @model_validator(mode="after")
    def _weight_within_backward(self) -> "LayerProfile":
        if self.backward_weight is not None and self.backward_weight > self.backward:
            raise ValueError(
                f"backward_weight = {self.backward_weight} exceeds backward = {self.backward} "
                "(it is the parameter-gradient part of backward)"
            )
        return self

    @property
    def recompute_time(self) -> float:
        return self.forward if self.recompute is None else self.recompute

    @property
    def weight_time(self) -> float:
        """W of a split backward (the zero-bubble paper's B = W when the profile does not say)."""
        return self.backward / 2 if self.backward_weight is None else self.backward_weight

    @property
    def split_time(self) -> float:
        """What the split backward costs beyond the whole backward (0 when the profile does not say)."""
        return self.split_extra or 0.0

    @property
    def saved(self) -> float:
        return self.output_bytes if self.saved_bytes is None else self.saved_bytes


class Profile(_Strict):
    model: str = Field(min_length=1, description="model name")
    batch_size: int = Field(ge=1, description="micro-batch size (samples) the times and sizes were measured at")
    layers: list[LayerProfile] = Field(min_length=1)
    cut_bytes: list[float] | None = Field(None, description="bytes crossing the cut after layer i (N-1 entries)")
    source: str | None = Field(None, description="where the profile came from (file, tool)")
    loss: LayerProfile | None = Field(None, description="the loss function, measured like a layer (not one)")
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the dtype the parameters were trained in, as measured"
    )
    param_bytes_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the dtype param_bytes counts (default: param_dtype)"
    )
    job: JobShape | None = Field(
        None,
        description="the shape of the job measured in place (hippie.profile): "
        "hippie-ds plan keeps it unless told otherwise",
    )
    load: MeasuredLoad | None = Field(None, description="the machine's load while the profile was measured")
    groups: list[list[int]] | None = Field(
        None,
        description="layers that are the same work (class, parameter "
        "shapes, input shape), measured as one group: they share their times",
    )
    steps: int | None = Field(
        None,
        ge=1,
        description="train_batch calls the times were measured over "
        "(hippie.profile's steps); none: one pass (hippie-ds profile) or not recorded",
    )

    @model_validator(mode="after")
    def _check_cuts(self) -> "Profile":
        n = len(self.layers)
        if self.cut_bytes is not None:
            if len(self.cut_bytes) != n - 1:
                raise ValueError(
                    f"cut_bytes has {len(self.cut_bytes)} entries; a profile of {n} layers has {n - 1} cuts"
                )
            bad = [i for i, v in enumerate(self.cut_bytes) if not v >= 0]
            if bad:
                raise ValueError(f"cut_bytes[{bad[0]}] = {self.cut_bytes[bad[0]]}: must be >= 0")
        seen: set[int] = set()
        for g, group in enumerate(self.groups or ()):
            bad = [i for i in group if not 0 <= i < n or i in seen]
            if bad or len(group) < 2:
                raise ValueError(
                    f"groups[{g}] = {group}: a group lists two or more distinct layer indices in "
                    f"0..{n - 1}, each in one group only"
                )
            seen.update(group)
        return self

    # -- derived per-layer vectors (plain lists: the planner's inner loops index them) ------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def cuts(self) -> list[float]:
        """Bytes crossing the cut after each layer (N-1 entries)."""
        if self.cut_bytes is not None:
            return list(self.cut_bytes)
        return [layer.output_bytes for layer in self.layers[:-1]]

    def inputs(self) -> list[float]:
        """Bytes entering each layer (the first layer's input is the data: 0, it is loaded)."""
        out, prev = [], 0.0
        for layer in self.layers:
            out.append(prev if layer.input_bytes is None else layer.input_bytes)
            prev = layer.output_bytes
        return out

    def total_time(self) -> float:
        """Forward + backward of the whole model (and the loss) for one micro-batch of ``batch_size``."""
        loss = 0.0 if self.loss is None else self.loss.forward + self.loss.backward
        return sum(layer.forward + layer.backward for layer in self.layers) + loss

    def working(self) -> list[float]:
        """Working memory of each layer's forward+backward (bytes above what it keeps): measured,
        else input + output + parameter bytes (the module docstring says why)."""
        return [
            x.working_bytes if x.working_bytes is not None else i + x.output_bytes + x.param_bytes
            for x, i in zip(self.layers, self.inputs())
        ]

    def loss_working(self) -> float:
        """The loss's working memory (0 without a loss entry), estimated as a layer's."""
        x = self.loss
        if x is None:
            return 0.0
        if x.working_bytes is not None:
            return x.working_bytes
        inp = self.layers[-1].output_bytes if x.input_bytes is None else x.input_bytes
        return inp + x.output_bytes + x.param_bytes

    def state_factor(self) -> float:
        """Training-state bytes per profiled parameter byte for the recorded precision: fp32 with
        Adam 16 bytes a parameter (weights, gradients, two moments); bf16/fp16 as DeepSpeed's
        BF16_Optimizer keeps it, 18 (2-byte weights, fp32 master weights, fp32 gradient
        accumulator, two fp32 moments); divided by the bytes a parameter has in ``param_bytes``
        (``param_bytes_dtype``, default ``param_dtype``). Without ``param_dtype``: 4 (fp32)."""
        if self.param_dtype is None:
            return DEFAULT_STATE_FACTOR
        state = 16.0 if self.param_dtype == "float32" else 18.0
        return state / DTYPE_BYTES[self.param_bytes_dtype or self.param_dtype]

    def total_param_bytes(self) -> float:
        return sum(layer.param_bytes for layer in self.layers)

    def fingerprint(self) -> str:
        """Identifies the model, not the measurement: a hash of layer names and parameter sizes.
        A plan records it; loading the plan for a different model is then detected."""
        return fingerprint_of([x.name for x in self.layers], [x.param_bytes for x in self.layers])

    def scaled(self, batch_size: int) -> "Profile":
        """The same model at another micro-batch size (times and activations scale linearly)."""
        if batch_size == self.batch_size:
            return self
        f = batch_size / self.batch_size

        def scale(layer: LayerProfile) -> LayerProfile:
            d = layer.model_dump()
            for key in (
                "forward",
                "backward",
                "backward_weight",
                "split_extra",
                "recompute",
                "output_bytes",
                "saved_bytes",
                "input_bytes",
                "working_bytes",
            ):
                if d[key] is not None:
                    d[key] *= f
            return LayerProfile(**d)

        cuts = None if self.cut_bytes is None else [c * f for c in self.cut_bytes]
        return self.model_copy(
            update=dict(
                batch_size=batch_size,
                layers=[scale(x) for x in self.layers],
                cut_bytes=cuts,
                loss=None if self.loss is None else scale(self.loss),
            )
        )


def fingerprint_of(names: Sequence[str], param_bytes: Sequence[float]) -> str:
    """Hash of layer names and parameter sizes (``Profile.fingerprint``; the model side computes it
    from its layer specs: ``hippie_ds.adapter.module.pipeline_module.model_fingerprint``)."""
    h = hashlib.sha256()
    for name, size in zip(names, param_bytes):
        h.update(name.encode())
        h.update(b"\0")
        h.update(repr(float(size)).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Files


def _format(exc: ValidationError, where: str) -> str:
    return "\n  ".join(describe(exc, where))


def profile_from_dict(data: Any, where: str = "profile") -> Profile:
    if not isinstance(data, Mapping):
        raise ProfileError(
            f"{where}: expected a mapping with keys model, batch_size, layers; got {type(data).__name__}"
        )
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError("invalid profile:\n  " + _format(exc, where)) from None


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a profile as JSON (.json) or YAML (anything else)."""
    write_data_file(path, profile.model_dump(exclude_none=True), default="yaml")


# ---------------------------------------------------------------------------------------------
# Synthetic profiles (tests, benchmarks)


def synthetic_profile(
    num_layers: int,
    seed: int = 0,
    model: str | None = None,
    batch_size: int = 8,
    time_scale: float = 1e-3,
    act_scale: float = 5e7,
    param_scale: float = 2e7,
) -> Profile:
    """A reproducible transformer-like profile: blocks of varied cost with an embedding first and
    a large head last (deterministic for a seed)."""
    import random

    rng = random.Random(seed)
    layers = []
    for i in range(num_layers):
        w = rng.uniform(0.5, 1.5)
        if i == 0 or i == num_layers - 1:
            w *= 0.3
        params = param_scale * (4.0 if i in (0, num_layers - 1) else rng.uniform(0.2, 1.2))
        out = act_scale * rng.uniform(0.5, 1.5)
        # A block saves several times its output for backward (its internals and its output).
        saved = out * rng.uniform(3.0, 8.0)
        layers.append(
            LayerProfile(
                name=f"layer{i}",
                forward=time_scale * w,
                backward=2 * time_scale * w,
                output_bytes=out,
                saved_bytes=saved,
                param_bytes=round(params),
            )
        )
    return Profile(
        model=model or f"synthetic-{num_layers}-{seed}", batch_size=batch_size, layers=layers, source="synthetic"
    )


def as_profile(data: Profile | Mapping[str, Any] | Sequence[Mapping[str, Any]], **kwargs) -> Profile:
    """A Profile from a Profile, a mapping, or a list of layer mappings (with ``model`` and
    ``batch_size`` in ``kwargs``)."""
    if isinstance(data, Profile):
        return data
    if isinstance(data, Mapping):
        return profile_from_dict(data)
    return profile_from_dict({"layers": list(data), **kwargs})
