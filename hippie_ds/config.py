"""hippie-ds's part of a DeepSpeed JSON config, validated before any process group is touched.

    "pipeline": {"schedule": "hippie"},          # a built-in name or a path to a schedule file
    "hippie": {
        "deferred_stages": "auto",              # or a list of stage ids (schedules that declare it)
        "schedule_params": {},                  # other parameters a schedule file declares
        "costs": null,                          # cost file for 'auto' parameters (simulator's rule)
        "placement": "pipeline_in_node",        # or "data_parallel_in_node" (DeepSpeed's default)
        "timeline_dir": null                    # write a per-rank Chrome trace of executed instructions
    }
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

DEFAULT_SCHEDULE = "1f1b"


class ConfigError(ValueError):
    """A bad hippie-ds config value; the message names the key, the value and what is allowed."""


class HippieConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # 'auto' or a list of stage ids (checked against the stage count when the schedule compiles)
    deferred_stages: Any = None
    schedule_params: dict[str, Any] = {}
    costs: str | None = None
    placement: Literal["pipeline_in_node", "data_parallel_in_node"] = "pipeline_in_node"
    timeline_dir: str | None = None

    @field_validator("deferred_stages", mode="before")
    @classmethod
    def _stages(cls, v):
        ok = v is None or v == "auto" or (isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
        if not ok:
            raise ValueError("allowed: 'auto' or a list of non-negative stage indices, e.g. [0, 1]")
        return v


def _describe(err: dict, section: str) -> str:
    key = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(HippieConfig.model_fields)
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
        raise ConfigError(f'config key "pipeline.schedule" = {schedule!r}: must be a schedule name '
                          "(see `hippie-ds schedule list`) or a path to a schedule file")
    ds_config["pipeline"] = pipeline
    try:
        options = HippieConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(e, "hippie") for e in exc.errors())) from None
    return ds_config, schedule, options


def schedule_params(options: HippieConfig, declared: dict) -> dict:
    """The parameters passed to the schedule: ``schedule_params`` plus ``deferred_stages``."""
    params = dict(options.schedule_params)
    if options.deferred_stages is not None:
        if "deferred_stages" not in declared:
            raise ConfigError(f'config key "hippie.deferred_stages" = {options.deferred_stages!r}: the chosen '
                              "schedule has no deferred stages; it applies to schedules that declare it "
                              "(hippie, hippie-1f1b)")
        params["deferred_stages"] = options.deferred_stages
    unknown = set(params) - set(declared)
    if unknown:
        raise ConfigError(f'config key "hippie.schedule_params" has {sorted(unknown)}, which the schedule does not '
                          f"declare; declared: {sorted(declared) or 'none'}")
    return params
