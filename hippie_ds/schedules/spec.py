"""Pydantic models of a schedule file, and loading with errors that name file, line and field.

A schedule file declares *where* each stage runs its compute (forward, backward, or fused
forward+backward of every micro-batch, placed at a step given by an expression) and what it
runs before and after (gradient reduction, buffering, updates). The compiler derives the
loads, sends, receives and buffer ids from that; see docs/reference.md ("Schedule files").
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .expr import Expression, ExpressionError
from .ir import COMPUTE_KINDS, OP_INFO, PLACEABLE_KINDS, OpKind


class ScheduleError(ValueError):
    """A schedule that cannot be loaded, compiled or run; the message says where and why."""


def _expression(value, info, optional: bool = False) -> Expression | None:
    """A field validator's value as an Expression (already parsed ones pass; None too where optional)."""
    if isinstance(value, Expression) or (optional and value is None):
        return value
    try:
        return Expression(value)
    except ExpressionError as exc:
        raise ValueError(f"{info.field_name}: {exc}") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)


class SendPolicy(_Strict):
    """When the result of a compute op is sent to its neighbour."""

    # next_step: at the start of the following step, ordered against that step's receive as
    # DeepSpeed's TrainSchedule does; same_step: right after the op.
    when: Literal["next_step", "same_step"] = "next_step"
    blocking: bool = True


class PlacedOp(_Strict):
    """A non-compute op placed at the start (prologue) or end (epilogue) of a stage's stream."""

    op: str
    target: Literal["grads", "buffer", "chunk"] | None = None
    when: Expression = Expression("True")
    # stage_end: right after the stage's own last compute and its sends; end: the schedule's
    # last step (DeepSpeed's TrainSchedule puts its reduce/step there).
    at: Literal["stage_end", "end"] = "stage_end"

    @field_validator("op")
    @classmethod
    def _known_op(cls, v):
        allowed = sorted(k.value for k in PLACEABLE_KINDS)
        if v not in allowed:
            raise ValueError(
                f"unknown op {v!r}; allowed here: {', '.join(allowed)} "
                "(loads, sends and receives are added by the compiler)"
            )
        return v

    @field_validator("when", mode="before")
    @classmethod
    def _parse(cls, v, info):
        return _expression(v, info)

    def model_post_init(self, __context) -> None:
        targets = OP_INFO[OpKind(self.op)].targets
        needs_target = bool(targets)
        if needs_target and self.target not in targets:
            raise ValueError(f"op {self.op} needs target: one of {', '.join(targets)}")
        if not needs_target and self.target is not None:
            raise ValueError(f"op {self.op} takes no target (got {self.target!r})")

    @property
    def kind(self) -> OpKind:
        return OpKind(self.op)


class ComputeRule(_Strict):
    """Place one compute op for every micro-batch ``mb`` for which ``when`` holds."""

    op: Literal[tuple(k.value for k in OpKind if k in COMPUTE_KINDS)]  # forward, backward, ... (the table's order)
    at: Expression = Field(description="step index, an expression of mb, stage, stages, micro_batches, params")
    when: Expression = Expression("True")
    send: SendPolicy = SendPolicy()
    # Weight version the op uses, counted in this stage's updates from the start of the op's
    # batch (e.g. -1: the weights before this batch's first update, as of the previous batch);
    # versions below 0 of the first batches are the initial weights. Forward and backward of a
    # micro-batch must use the same version; the compiler adds stash_weights / free_weights.
    version: Expression | None = None
    # Placed ops run right after this op, for every micro-batch whose ``when`` holds (it sees mb,
    # chunk and the definitions; e.g. PipeDream's update after each backward, a chunk's early
    # all-reduce after its last backward). They belong to the op's batch.
    after: list["PlacedOp"] = []

    @field_validator("at", "when", mode="before")
    @classmethod
    def _parse(cls, v, info):
        return _expression(v, info)

    @field_validator("version", mode="before")
    @classmethod
    def _parse_version(cls, v, info):
        return _expression(v, info, optional=True)

    @field_validator("after")
    @classmethod
    def _after_at(cls, v):
        for p in v:
            if p.at != "stage_end":
                raise ValueError(f"op {p.op}: 'at' is not allowed in 'after' (it runs right after the compute op)")
        return v


class SteadyState(_Strict):
    """The pipeline stays full across train_batch calls: batch t's ops are placed ``period``
    steps after batch t-1's, and train_batch call t runs, on each stage, the steps
    [t * period + offset, (t + 1) * period + offset) of that endless stream: the rest of
    earlier batches still in flight and the start of batch t. ``engine.drain()`` runs what is
    left when training ends."""

    period: Expression
    offset: Expression = Expression("0")

    @field_validator("period", "offset", mode="before")
    @classmethod
    def _parse(cls, v, info):
        return _expression(v, info)


class ParamSpec(_Strict):
    kind: Literal["stage_list", "int", "bool"]
    default: Union[int, bool, list[int], Literal["auto"]]
    # For stage_list params whose default is "auto": the stages chosen when no costs are known.
    auto: Expression | None = None
    help: str = ""

    @field_validator("auto", mode="before")
    @classmethod
    def _parse(cls, v, info):
        return _expression(v, info, optional=True)


class Requirement(_Strict):
    check: Expression
    message: str

    @field_validator("check", mode="before")
    @classmethod
    def _parse(cls, v, info):
        return _expression(v, info)


class ScheduleSpec(_Strict):
    name: str
    description: str = ""
    params: dict[str, ParamSpec] = {}
    requires: list[Requirement] = []
    steps: Expression | None = None  # default: just enough for every stage's ops and sends
    compute: list[ComputeRule]
    prologue: list[PlacedOp] = []
    epilogue: list[PlacedOp] = []
    steady_state: SteadyState | None = None
    # Virtual stages: every stage holds this many model chunks (an expression; the job's
    # ``pipeline.virtual_stages`` overrides it), placed by ``layout`` (hippie_ds.schedules.layout).
    # Compute rules then run for every (chunk, mb); expressions see ``chunk`` and ``virtual_stages``.
    virtual_stages: Expression | None = None
    layout: Literal["interleaved", "v"] = "interleaved"
    # Named sub-expressions for the compute rules, evaluated in order for every op (they may use
    # mb, chunk, stage and the names defined before them): long placements stay readable.
    define: dict[str, Expression] = {}

    @field_validator("define", mode="before")
    @classmethod
    def _definitions(cls, v, info):
        if not isinstance(v, dict):
            raise ValueError("define: a mapping of name to expression")
        reserved = {"stages", "stage", "micro_batches", "mb", "chunk", "virtual_stages"}
        out = {}
        for name, expr in v.items():
            if not isinstance(name, str) or not name.isidentifier() or name in reserved:
                raise ValueError(f"define: name {name!r} is reserved or not an identifier")
            out[name] = _expression(expr, info)
        return out

    @field_validator("steps", "virtual_stages", mode="before")
    @classmethod
    def _parse(cls, v, info):
        return _expression(v, info, optional=True)

    @field_validator("params")
    @classmethod
    def _param_names(cls, v):
        reserved = {"stages", "stage", "micro_batches", "mb", "chunk", "virtual_stages"}
        for name in v:
            if name in reserved or not name.isidentifier():
                raise ValueError(f"parameter name {name!r} is reserved or not an identifier")
        return v


# ---------------------------------------------------------------------------------------------
# Loading


def builtin_dir() -> Path:
    """Where the built-in schedule files live: the installed copy, else the source checkout."""
    try:
        from importlib.resources import files

        installed = Path(str(files("hippie_ds._builtin_schedules")))
        if any(installed.glob("*.yaml")):
            return installed
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "schedules"


def available() -> list[str]:
    """Names of the built-in schedules."""
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))


def resolve_path(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise ScheduleError(f"schedule file {text!r} does not exist")
        return path
    path = builtin_dir() / f"{text}.yaml"
    if not path.is_file():
        raise ScheduleError(
            f"unknown schedule {text!r}; built-in schedules: {', '.join(available())} "
            "(or give a path to a .yaml schedule file)"
        )
    return path


def _line_of(root: yaml.Node | None, loc: tuple) -> int | None:
    """The 1-based line of the YAML node at pydantic error location ``loc``, if found."""
    node, line = root, None
    for key in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
    return node.start_mark.line + 1 if node is not None else line


_SPEC_CACHE: dict[tuple[str, float], ScheduleSpec] = {}


def load_spec(name_or_path: str | Path) -> ScheduleSpec:
    """Load and validate a schedule file (built-in name or path)."""
    path = resolve_path(name_or_path)
    key = (str(path.resolve()), path.stat().st_mtime)
    if key in _SPEC_CACHE:
        return _SPEC_CACHE[key]
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ScheduleError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ScheduleError(
            f"{path}: a schedule file is a mapping with keys name, compute, ...; got {type(data).__name__}"
        )
    try:
        spec = ScheduleSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            line = _line_of(root, loc)
            field = ".".join(str(p) for p in loc) or "(top level)"
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" (value {value!r})"
            problems.append(f"{path}:{line or '?'}: field {field}{shown}: {err['msg']}")
        raise ScheduleError("invalid schedule file:\n  " + "\n  ".join(problems)) from None
    _SPEC_CACHE[key] = spec
    return spec
