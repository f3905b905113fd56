"""Static validation of a compiled schedule. Pure Python, no torch.

Two analyses, both over ``iterations`` consecutive runs of the schedule (consecutive
``train_batch`` calls: deferred stages leave a filled gradient buffer and an in-flight
all-reduce behind, so one run alone cannot show whether the next one consumes them):

* a simulation of every stage's stream together, with p2p modelled as the engine runs it
  (blocking sends are rendezvous, non-blocking ones are queued until WAIT_SENDS, FIFO channels,
  pipeline collectives matched by count), to find deadlocks and mis-matched messages;
* a per-stage pass over the stream for data flow (every micro-batch loaded / received /
  computed / sent in a valid order), pipeline buffer slots and the gradient state machine.

Layout: this module (the API), :mod:`.deadlock` (the communication analysis),
:mod:`.stage_checks` (the per-stage analysis), :mod:`.check_common` (problems, scenarios).

Problems are collected, not raised one by one: :func:`check` returns them all, :func:`validate`
raises :class:`ScheduleValidationError` listing them.
"""

from __future__ import annotations

from .check_common import Problem, problem, scenario_ops, scenarios, unique  # noqa: F401 (API)
from .deadlock import _Simulation
from .ir import BUFFER_KINDS, OP_INFO, CompiledSchedule
from .spec import ScheduleError
from .continuous_checks import ContinuousStageChecker
from .op_rules import RULES
from .stage_checks import _StageChecker

_MAX_LISTED = 20


class ScheduleValidationError(ScheduleError):
    """A compiled schedule that would deadlock, compute wrong results or lose gradients."""

    def __init__(self, compiled: CompiledSchedule, problems: list[Problem]):
        self.compiled = compiled
        self.problems = list(problems)
        lines = [str(p) for p in self.problems[:_MAX_LISTED]]
        if len(self.problems) > _MAX_LISTED:
            lines.append(f"... and {len(self.problems) - _MAX_LISTED} more")
        super().__init__(
            f"schedule {compiled.name} ({compiled.stages} stages x {compiled.micro_batches} "
            f"micro-batches, params {compiled.params}): {len(self.problems)} problem(s):\n  " + "\n  ".join(lines)
        )


def check(compiled: CompiledSchedule, iterations: int = 2) -> list[Problem]:
    """Every problem found in ``compiled`` run ``iterations`` times in a row (deduplicated:
    a fault repeated in each iteration is reported once)."""
    if iterations < 1:
        raise ValueError(f"iterations = {iterations}: must be >= 1")
    problems = _check_shape(compiled)
    if problems:  # the analyses index streams and buffers by stage
        return unique(problems)
    if compiled.continuous:
        for scenario in scenarios(compiled, iterations):
            problems += _Simulation(compiled, iterations, RULES, scenario).run()
            for s in range(compiled.stages):
                problems += ContinuousStageChecker(compiled, s, scenario, RULES).run()
        return unique(problems)
    problems += _Simulation(compiled, iterations, RULES).run()
    for s in range(compiled.stages):
        problems += _StageChecker(compiled, s, RULES).run(iterations)
    return unique(problems)


def validate(compiled: CompiledSchedule) -> CompiledSchedule:
    """``compiled`` itself if :func:`check` finds nothing, else raise ScheduleValidationError."""
    problems = check(compiled)
    if problems:
        raise ScheduleValidationError(compiled, problems)
    return compiled


def _check_shape(compiled: CompiledSchedule) -> list[Problem]:
    """The stream layout the analyses rely on: one stream and one slot count per stage, ops
    that say which stage and step they are in, the fields each kind needs."""
    problems = []
    K = compiled.stages
    if len(compiled.streams) != K or len(compiled.num_buffers) != K:
        return [
            Problem(
                0,
                None,
                None,
                f"{K} stages but {len(compiled.streams)} streams and {len(compiled.num_buffers)} buffer counts",
            )
        ]
    for s, stream in enumerate(compiled.streams):
        for t, step in enumerate(stream):
            for op in step:
                if op.stage != s or op.step != t:
                    problems.append(
                        problem(
                            op,
                            f"op says stage {op.stage} step {op.step} but is in stage {s}'s stream at step {t}",
                            stage=s,
                        )
                    )
                if op.kind in BUFFER_KINDS and op.micro_batch is None:
                    problems.append(problem(op, f"{op.kind.value} without a micro-batch"))
                targets = OP_INFO[op.kind].targets
                if targets and op.target not in targets:
                    problems.append(problem(op, f"{op.kind.value} needs target one of {', '.join(targets)}"))
    return problems


def weight_versions(compiled: CompiledSchedule, iterations: int = 2) -> list[int]:
    """Per stage, the most weight versions held at once (current plus stashed), over the
    validator's scenarios; 1 for schedules without versions."""
    if not compiled.continuous:
        return [1] * compiled.stages
    peaks = [1] * compiled.stages
    for scenario in scenarios(compiled, iterations):
        for s in range(compiled.stages):
            checker = ContinuousStageChecker(compiled, s, scenario, RULES)
            checker.run()
            peaks[s] = max(peaks[s], checker.peak_versions)
    return peaks
