"""Declarative pipeline schedules: load, compile, validate, simulate (pure: no torch, no DeepSpeed;
:func:`hippie_ds.adapter.stage.instructions.build` turns one into DeepSpeed instructions). The schedule
a job runs comes from :func:`hippie_ds.schedules.resolve.resolve` ('auto' parameters, deferral,
one compile); :func:`compile` here compiles a shape as given (listings, checks, the bench)."""

from .compiler import compile_schedule, resolve_params
from .ir import CompiledSchedule, Op, OpKind
from .spec import ScheduleError, ScheduleSpec, available, load_spec


def compile(
    name_or_path, stages: int, micro_batches: int, validate: bool = True, virtual_stages: int | None = None, **params
) -> CompiledSchedule:
    """Load and compile a schedule for every stage (``virtual_stages``: model chunks per stage, default
    the schedule's); validate it unless told not to."""
    spec = load_spec(name_or_path)
    compiled = compile_schedule(
        spec, stages, micro_batches, params, source=str(name_or_path), virtual_stages=virtual_stages
    )
    if validate:
        from .validator import validate as _validate

        _validate(compiled)
    return compiled


def builtins_where(predicate, stages: int, micro_batches: int, chunks: tuple[int, str] | None = None) -> list[str]:
    """The built-in schedules whose compiled form at this shape satisfies ``predicate`` (error
    messages list what is allowed by asking the schedules, not by naming them). ``chunks``: (model
    chunks per stage, layout) the model holds; only the schedules that run on it."""
    names = []
    for name in available():
        try:
            compiled = compile(
                name, stages, micro_batches, virtual_stages=chunks[0] if chunks is not None and chunks[0] > 1 else None
            )
        except ScheduleError:  # a shape the schedule does not run (its `requires`)
            continue
        if (
            chunks is not None
            and compiled.virtual_stages != chunks[0]
            or chunks is not None
            and chunks[0] > 1
            and compiled.layout_kind != chunks[1]
        ):
            continue
        if predicate(compiled):
            names.append(name)
    return names


__all__ = [
    "available",
    "builtins_where",
    "compile",
    "compile_schedule",
    "load_spec",
    "resolve_params",
    "CompiledSchedule",
    "Op",
    "OpKind",
    "ScheduleError",
    "ScheduleSpec",
]
