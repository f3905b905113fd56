"""hippie-ds's part of a DeepSpeed JSON config, validated before any process group is touched.

"pipeline": {"schedule": "hippie",          # a built-in name or a path to a schedule file
             "virtual_stages": 2},          # model chunks per stage (interleaved-1f1b, ...); default:
                                            #   the schedule's
"hippie": {
    "deferred_stages": "auto",              # or a list of stage ids (schedules that declare it)
    "deferred_layers": "untied",            # partial deferral: a deferred stage delays only its first
                                            #   layer with parameters not tied to another stage (a
                                            #   tied embedding before it stays in-step); an int (or
                                            #   {"stage": int}): its first this many layers with
                                            #   parameters (0: none, the stage is not deferred); the
                                            #   rest of its gradient is all-reduced and applied
                                            #   in-step; "all": the whole stage (the
                                            #   paper's rule); "auto": chosen from costs for the
                                            #   least time to a loss
    "staleness_price": null,                # "auto"'s price of a stale gradient: extra steps (a share)
                                            #   when the whole model's gradient is stale; null: 0.5
    "schedule_params": {},                  # other parameters a schedule file declares
    "costs": null,                          # cost file for 'auto' parameters (simulator's rule)
    "placement": null,                      # checked against the module's topology when given:
                                            #   "pipeline_in_node" or "data_parallel_in_node"
    "timeline_dir": null,                   # write a per-rank Chrome trace of executed instructions
    "timeline_steps": 100,                  #   of the last this many train_batch calls (memory stays flat)
    "plan": null,                           # a planner plan file (`hippie-ds plan --out`): stage
                                            #   boundaries, checkpointed layers, schedule, batch
    "staleness": {                          # correction for stages that update one step late
        "method": "extrapolate-made",       #   W_hat = W + c * (W - W_previous), and where a stage has
                                            #   made its next weights before it computes (2bw's last
                                            #   stage), those ("extrapolate": never); "adam": W_hat = W +
                                            #   c * (Adam's predicted next update, from its moments,
                                            #   step count and LR; Adam/AdamW only); or "none" (the
                                            #   plain one-step-delayed rule)
        "coefficient": 1.0,                 #   c
        "error_feedback": 0.0,              # 2bw: update u(t) + g (u(t) - u(t-1)), u the optimizer's
                                            #   step (g; 0: off)
        "delay_compensation": 0.0           # 2bw with "method": "none": DC-ASGD's gradient g + L g g
    },                                      #   (W - W_computed_on) / (sqrt(v_hat) + eps) (L; 0: off)
    "profile": null                         # {"out": "profile.yaml", "steps": 3, "repeats": 3}: measure
                                            #   every layer of every stage in place (after one warm-up
                                            #   train_batch, during the next `steps`), write one profile
}
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_SCHEDULE = "1f1b"
# hippie.deferred_layers' values, decided in schedules/deferral/decide.py; the one default for the config, `schedule
# simulate` and the planner
UNTIED_LAYERS = "untied"  # hippie.deferred_layers: the first layer with parameters not tied to another stage
DEFAULT_DEFERRED_LAYERS = UNTIED_LAYERS
WHOLE_STAGE = "all"  # hippie.deferred_layers: delay a deferred stage's whole gradient
AUTO_LAYERS = "auto"  # hippie.deferred_layers: chosen from costs (schedules.deferral.auto_layers)
NOT_DEFERRED = "none"  # hippie.deferred_layers: delay nothing, so the stage is not deferred (a count of 0 reads as it)


class ConfigError(ValueError):
    """A bad hippie-ds config value; the message names the key, the value and what is allowed."""


class StalenessConfig(BaseModel):
    """How a stage that applies its gradient one step late (hippie's deferred stages) corrects
    for it; see :mod:`hippie_ds.adapter.staleness.prediction`."""

    model_config = ConfigDict(extra="forbid")

    # "extrapolate": W_hat = W + c (W - W_previous); "extrapolate-made": the same, but a stage that has
    # made the next weights before it computes (2bw's last stage) computes on them, any optimizer;
    # "adam": W_hat = W + c u_hat, u_hat the next update predicted from Adam's own state, made weights
    # where made (hippie_ds.adapter.staleness.adam; torch Adam/AdamW only, refused at start-up
    # otherwise); "none": no correction.
    method: Literal["none", "extrapolate", "extrapolate-made", "adam"] = "extrapolate-made"
    coefficient: float = Field(1.0, ge=0.0, le=4.0)
    # Error feedback on 2bw's one-update-late stages (hippie_ds.adapter.staleness.error_feedback): the update
    # u(t) + g (u(t) - u(t-1)), u the optimizer's own step; 0: off.
    error_feedback: float = Field(0.0, ge=0.0, le=4.0)
    # Delay compensation (DC-ASGD) on 2bw's one-update-late stages with method "none"
    # (hippie_ds.adapter.staleness.delay_compensation): the gradient g + L g g (W - W_computed_on) /
    # (sqrt(v_hat) + eps), v the stepped gradients' second moment; 0: off.
    delay_compensation: float = Field(0.0, ge=0.0, allow_inf_nan=False)


class ProfileConfig(BaseModel):
    """``hippie.profile``: the job profiles its own layers in place
    (:mod:`hippie_ds.adapter.profiling.profile_in_place`) and global rank 0 writes one profile file."""

    model_config = ConfigDict(extra="forbid")

    # The profile to write (.json, else YAML), relative to the working directory of rank 0.
    out: str = Field(min_length=1, strict=True)
    # train_batch calls measured, after one warm-up call; each re-runs every layer on its input.
    steps: int = Field(3, ge=1, strict=True)
    # timed runs of each layer per measured step (after one untimed run); medians.
    repeats: int = Field(3, ge=1, strict=True)
    # The profile's model name; None: the module's class name.
    name: str | None = Field(None, min_length=1, strict=True)


class HippieConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # 'auto' or a list of stage ids (checked against the stage count when the schedule compiles)
    deferred_stages: Any = None
    # An int (every deferred stage) or {stage: int}: a deferred stage delays only the gradient of
    # its first that many layers with parameters (0: none, so the stage is not deferred); "all": its
    # whole gradient. The default,
    # "untied", delays its first layer with parameters that is not a module tied to another stage
    # (Megatron's word embedding, tied to the output head, stays in-step before it): one layer,
    # the rule that trains as well as data parallelism (docs/results.md). "auto": per stage, from
    # hippie.costs or the plan, the count with the least predicted time to a loss.
    deferred_layers: Any = DEFAULT_DEFERRED_LAYERS
    # "auto"'s price of staleness (schedules.deferral.auto_layers); None: its measured default.
    staleness_price: float | None = Field(None, ge=0.0)
    schedule_params: dict[str, Any] = {}
    costs: str | None = None
    # None: whatever layout the PipelineModule was built with (DeepSpeed's default topology keeps
    # working unchanged); a value is checked against the module's topology.
    placement: Literal["pipeline_in_node", "data_parallel_in_node"] | None = None
    timeline_dir: str | None = None
    timeline_steps: int = Field(100, ge=1)
    # Path of a plan file; relative paths are tried from the working directory, then from the
    # config file's directory.
    plan: str | None = None
    staleness: StalenessConfig = StalenessConfig()
    # Measure the job's layers in place into a profile (None: no profiling).
    profile: ProfileConfig | None = None
    # Set from "pipeline.virtual_stages" (model chunks per stage); None: the schedule's own.
    virtual_stages: int | None = None

    @field_validator("profile", mode="before")
    @classmethod
    def _profile(cls, v):
        if v is not None and not isinstance(v, (dict, ProfileConfig)):
            raise ValueError(
                'allowed: null or a mapping {"out": FILE, "steps": N, "repeats": N, "name": NAME} '
                '(only "out" is required)'
            )
        return v

    @field_validator("deferred_stages", mode="before")
    @classmethod
    def _stages(cls, v):
        ok = (
            v is None
            or v == "auto"
            or (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
        )
        if not ok:
            raise ValueError("allowed: 'auto' or a list of non-negative stage indices, e.g. [0, 1]")
        return v

    @field_validator("deferred_layers", mode="before")
    @classmethod
    def _layers(cls, v):
        def count(x):
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        # read here once: a count of 0 means the stage is not deferred, said as NOT_DEFERRED
        if v in (WHOLE_STAGE, AUTO_LAYERS, UNTIED_LAYERS, NOT_DEFERRED) or count(v):
            return NOT_DEFERRED if v == 0 else v
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                key = int(k) if isinstance(k, str) and k.isdigit() else k
                if not (count(key) and (count(x) or x == NOT_DEFERRED)):
                    break
                out[key] = NOT_DEFERRED if x == 0 else x
            else:
                return out
        raise ValueError(
            'allowed: "untied" (the first layer with parameters not tied to another stage, the '
            'default), a non-negative count of layers with parameters (every deferred stage; 0 or "none": '
            'not deferred), "all" (the whole stage), '
            '"auto" (per stage the count with the least predicted time to a loss, from '
            '"hippie.costs" or "hippie.plan"), or a mapping of deferred stage to layer count, '
            'e.g. {"0": 1}'
        )


def _describe(err: dict, section: str) -> str:
    key = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    if err["type"] == "missing":
        return f'config key "{section}.{key}" is required (in {err.get("input")!r})'
    if err["type"] == "extra_forbidden":
        model = HippieConfig  # the section the unknown key sits in
        for part in err["loc"][:-1]:
            annotation = model.model_fields[part].annotation
            annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)  # X | None
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else model
        allowed = ", ".join(model.model_fields)
        return f'config key "{section}.{key}" (value {value!r}) is not known; allowed keys: {allowed}'
    return f'config key "{section}.{key}" = {value!r}: {err["msg"]}'


def split_config(config: dict) -> tuple[dict, str, HippieConfig]:
    """(DeepSpeed's config without our keys, schedule name or path, hippie options)."""
    if not isinstance(config, dict):
        raise ConfigError(f"expected the DeepSpeed config as a dict, got {type(config).__name__}")
    ds_config = dict(config)
    raw = ds_config.pop("hippie", {}) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f'config key "hippie" = {raw!r}: must be a mapping of hippie-ds options')
    pipeline = dict(ds_config.get("pipeline", {}) or {})
    schedule = pipeline.pop("schedule", DEFAULT_SCHEDULE)
    if not isinstance(schedule, str) or not schedule:
        raise ConfigError(
            f'config key "pipeline.schedule" = {schedule!r}: must be a schedule name '
            "(see `hippie-ds schedule list`) or a path to a schedule file"
        )
    virtual = pipeline.pop("virtual_stages", None)
    if virtual is not None and (isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1):
        raise ConfigError(
            f'config key "pipeline.virtual_stages" = {virtual!r}: must be an integer >= 1 (model '
            "chunks per stage, for schedules with virtual stages such as interleaved-1f1b)"
        )
    if "virtual_stages" in raw:
        raise ConfigError('config key "hippie.virtual_stages" is not known; set "pipeline.virtual_stages"')
    ds_config["pipeline"] = pipeline
    try:
        options = HippieConfig.model_validate({**raw, "virtual_stages": virtual})
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(e, "hippie") for e in exc.errors())) from None
    return ds_config, schedule, options


def schedule_params(options: HippieConfig, declared: dict, declaring=None) -> dict:
    """The parameters passed to the schedule: ``schedule_params`` plus ``deferred_stages``.
    ``declaring(param)``: the schedules that declare ``param``, named in the error (the caller
    asks the schedule specs, which this layer does not import; called only on that error)."""
    params = dict(options.schedule_params)
    if options.deferred_stages is not None:
        if "deferred_stages" not in declared:
            which = f" ({', '.join(declaring('deferred_stages'))})" if declaring else ""
            raise ConfigError(
                f'config key "hippie.deferred_stages" = {options.deferred_stages!r}: the chosen '
                f"schedule has no deferred stages; it applies to schedules that declare it{which}"
            )
        params["deferred_stages"] = options.deferred_stages
    unknown = set(params) - set(declared)
    if unknown:
        raise ConfigError(
            f'config key "hippie.schedule_params" has {sorted(unknown)}, which the schedule does not '
            f"declare; declared: {sorted(declared) or 'none'}"
        )
    return params


def read_config(config: str | os.PathLike | dict) -> dict:
    """A DeepSpeed config given as a dict or a JSON file path."""
    if isinstance(config, dict):
        return config
    try:
        with open(config) as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config {str(config)!r}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {str(config)!r}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {str(config)!r}: expected a JSON object, got {type(data).__name__}")
    return data


def merge_plan(config: dict, planned: dict, plan_path: str, _prefix: str = "") -> dict:
    """``config`` with the keys a plan sets (``Plan.deepspeed_config()``) filled in. A key the
    config already sets must agree with the plan ('auto' deferred stages and layers take the plan's)."""
    out = dict(config)
    for key, value in planned.items():
        name = f"{_prefix}{key}"
        if key not in out or out[key] is None:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = merge_plan(out[key], value, plan_path, name + ".")
        elif name in ("hippie.deferred_stages", "hippie.deferred_layers") and out[key] == "auto":
            out[key] = value
        elif out[key] != value:
            raise ConfigError(
                f'config key "{name}" = {out[key]!r}, but the plan {plan_path} (config key '
                f'"hippie.plan") sets {value!r}; remove the key to use the plan\'s value, or make a '
                "plan for it (`hippie-ds plan ...`)"
            )
    return out
