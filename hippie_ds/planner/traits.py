"""What the planner asks a schedule, instead of knowing it by name. Pure Python.

The answers come from the schedule file and its compiled streams (the same compiler the engine
runs), so a new schedule file is plannable without touching the planner:

* ``in_flight[s]``: the most micro-batches stage s holds activations for (forwards whose
  backward has not run), over the steady-state stream; with virtual stages, counted in chunk
  micro-batches (micro-batch m on chunk c counts once per chunk);
* ``in_flight_chunks[s][c]``: the most micro-batches chunk c of stage s holds activations for
  (``(in_flight[s],)`` with one chunk); the memory model sums in-flight x saved bytes over a
  stage's chunks (an upper bound: the chunks' peaks need not coincide);
* ``virtual_stages`` and ``layout``: model chunks per stage and which model part each chunk is
  (:class:`hippie_ds.schedules.layout.Layout`);
* ``interleaved``: some stage runs a backward before all of its forwards (1F1B order): the
  analytic cycle is one F+B per micro-batch; otherwise GPipe order (all forwards, then all
  backwards);
* ``defers``: the file declares a ``deferred_stages`` stage list: the stages whose all-reduce
  does not fit their slack apply their gradient one step late (the simulator's rule);
* ``continuous``: the pipeline stays full across steps (no fill or drain per step);
* ``splits_backward``: the backward is split into its input gradient (``backward_input``, which
  the previous stage waits for) and its parameter gradients (``backward_weight``, which nobody
  waits for; zero-bubble schedules): the analytic model times the two apart;
* ``weight_versions[s]``: the most weight versions stage s holds at once (the validator's count;
  1 = just the current weights);
* ``late_update``: the update rule is not synchronous SGD (deferred stages, or compute on
  older weight versions): convergence differs from data parallelism's;
* ``updates_per_batch[s]``: gradient all-reduces and updates of stage s per step (1 but for
  pipedream, which updates after every micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .profile import PlannerError


@dataclass(frozen=True)
class ScheduleTraits:
    name: str
    stages: int
    micro_batches: int
    in_flight: tuple[int, ...]
    interleaved: bool
    defers: bool
    continuous: bool
    splits_backward: bool
    weight_versions: tuple[int, ...]
    late_update: bool
    updates_per_batch: tuple[int, ...]  # all-reduces + updates per stage per step (pipedream: M)
    virtual_stages: int = 1
    layout: str = "interleaved"
    in_flight_chunks: tuple[tuple[int, ...], ...] = ()  # [stage][chunk]

    @property
    def parts(self) -> int:
        """Model parts of a pipeline of this depth: stages x virtual stages."""
        return self.stages * self.virtual_stages


DEPTH_PROBE = 32  # deeper pipelines are extrapolated by position from the last stage


@lru_cache(maxsize=65536)
def schedule_traits(schedule: str, stages: int, micro_batches: int) -> ScheduleTraits:
    """The traits of ``schedule`` (a built-in name or a file) at ``stages`` x ``micro_batches``.

    Compiling a long stream for every micro-batch count the search visits would dominate the
    planner's time, so above ``2 * stages + 2`` micro-batches the counts that depend on M are
    extrapolated linearly from two compiled probes (M0 and M0 + 1): a count either stays (it
    saturated, like 1F1B's in-flight micro-batches) or grows by one per micro-batch (GPipe's).
    Likewise, pipelines deeper than :data:`DEPTH_PROBE` stages take the traits of a
    ``DEPTH_PROBE``-stage pipeline by distance from the last stage, continued linearly in the
    distance and in the depth (from the ``DEPTH_PROBE - 1``-stage one; 1F1B's
    K - s, GPipe's constant M); their ``requires`` are still checked at the real depth.
    Schedules with virtual stages are compiled at their real depth (their ``requires`` may
    tie M to K, as interleaved-1f1b's M % K == 0, so two depths need not share an M); above
    the probe size their M probes are the two smallest counts the schedule runs.
    ``tests/planner/test_planner.py`` and ``tests/planner/test_planner_virtual.py`` check both against full
    compiles of every built-in schedule."""
    if stages > DEPTH_PROBE and not _virtual(schedule):
        return _deeper(schedule, stages, micro_batches)
    probe = 2 * stages + 2
    if micro_batches <= probe + 1:
        return _compiled_traits(schedule, stages, micro_batches)
    _check_shape(schedule, stages, micro_batches)
    lo, hi = _probes(schedule, stages, probe)
    a, b = _compiled_traits(schedule, stages, lo), _compiled_traits(schedule, stages, hi)

    def extend(x: tuple, y: tuple) -> tuple:
        # (hi - lo) is 1, or the step the schedule's `requires` allows (interleaved-1f1b: K)
        return tuple(
            extend(u, w) if isinstance(u, tuple) else u + (w - u) * (micro_batches - lo) // (hi - lo)
            for u, w in zip(x, y)
        )

    return ScheduleTraits(
        name=a.name,
        stages=stages,
        micro_batches=micro_batches,
        in_flight=extend(a.in_flight, b.in_flight),
        interleaved=a.interleaved,
        defers=a.defers,
        continuous=a.continuous,
        splits_backward=a.splits_backward,
        weight_versions=extend(a.weight_versions, b.weight_versions),
        late_update=a.late_update,
        updates_per_batch=extend(a.updates_per_batch, b.updates_per_batch),
        virtual_stages=a.virtual_stages,
        layout=a.layout,
        in_flight_chunks=extend(a.in_flight_chunks, b.in_flight_chunks),
    )


@lru_cache(maxsize=256)
def _spec(schedule: str):
    from ..schedules.spec import load_spec

    return load_spec(schedule)


def _virtual(schedule: str) -> bool:
    return _spec(schedule).virtual_stages is not None


def _check_shape(schedule: str, stages: int, micro_batches: int) -> None:
    """Raise PlannerError when ``schedule`` cannot run this shape (its params or ``requires``),
    without compiling its streams."""
    from ..schedules.compiler import resolve_params, resolve_virtual_stages
    from ..schedules.placement import eval_expr
    from ..schedules.spec import ScheduleError

    spec = _spec(schedule)
    try:
        given = {"deferred_stages": []} if "deferred_stages" in spec.params else {}
        resolved = resolve_params(spec, stages, micro_batches, given)
        v = resolve_virtual_stages(spec, stages, micro_batches)
        env = {"stages": stages, "micro_batches": micro_batches, "virtual_stages": v, **resolved}
        for req in spec.requires:
            if not eval_expr(req.check, env, f"schedule {spec.name!r} requires"):
                raise ScheduleError(f"{req.message} ({req.check.source})")
    except ScheduleError as exc:
        raise PlannerError(
            f"schedule {schedule!r} cannot be planned at {stages} stages x {micro_batches} micro-batches: {exc}"
        ) from None


@lru_cache(maxsize=4096)
def _probes(schedule: str, stages: int, probe: int) -> tuple[int, int]:
    """The two smallest micro-batch counts >= ``probe`` the schedule runs at this depth."""
    found = []
    for m in range(probe, probe + 4 * stages + 4):
        try:
            _check_shape(schedule, stages, m)
        except PlannerError:
            continue
        found.append(m)
        if len(found) == 2:
            return found[0], found[1]
    raise PlannerError(
        f"schedule {schedule!r}: no micro-batch counts near {probe} to extrapolate its traits at {stages} stages from"
    )


@lru_cache(maxsize=4096)
def _compiled_traits(schedule: str, stages: int, micro_batches: int) -> ScheduleTraits:
    from ..schedules import compile as compile_schedule
    from ..schedules.ir import COMPUTE_KINDS, GRAD_RECEIVING_KINDS, OP_INFO
    from ..schedules.spec import ScheduleError, load_spec
    from ..schedules.validator import weight_versions

    try:
        spec = load_spec(schedule)
        defers = any(n == "deferred_stages" and p.kind == "stage_list" for n, p in spec.params.items())
        params = {"deferred_stages": []} if defers else {}
        compiled = compile_schedule(schedule, stages, micro_batches, validate=False, **params)
    except ScheduleError as exc:
        raise PlannerError(
            f"schedule {schedule!r} cannot be planned at {stages} stages x {micro_batches} micro-batches: {exc}"
        ) from None
    v = compiled.virtual_stages
    in_flight, chunks, interleaved = [], [], False
    for s in range(stages):
        live, peak, forwards = set(), 0, 0
        chunk_live, chunk_peak = [set() for _ in range(v)], [0] * v
        for op in compiled.ops(s):
            key, c = (op.batch, op.micro_batch, op.chunk), op.chunk
            info = OP_INFO[op.kind]  # what the op computes: its forward holds activations until its weight gradients
            if info.forward and not info.weight_grad:  # forward: held from here
                live.add(key)
                chunk_live[c].add(key)
                forwards += 1
                peak = max(peak, len(live))
                chunk_peak[c] = max(chunk_peak[c], len(chunk_live[c]))
            elif info.forward:  # forward_backward: held during the op only
                peak = max(peak, len(live) + 1)
                chunk_peak[c] = max(chunk_peak[c], len(chunk_live[c]) + 1)
                forwards += 1
            elif op.kind in GRAD_RECEIVING_KINDS:  # backward, backward_input
                if forwards < v * micro_batches:
                    interleaved = True
            if info.weight_grad and not info.forward:  # held until the parameter gradients (B, W)
                live.discard(key)
                chunk_live[c].discard(key)
        in_flight.append(max(1, min(peak, v * micro_batches) if not compiled.continuous else peak))
        chunks.append(tuple(max(1, min(x, micro_batches) if not compiled.continuous else x) for x in chunk_peak))
    versions = tuple(weight_versions(compiled)) if compiled.continuous else (1,) * stages
    versioned = any(
        op.version is not None and op.kind in COMPUTE_KINDS for s in range(stages) for op in compiled.ops(s)
    )
    return ScheduleTraits(
        name=compiled.name,
        stages=stages,
        micro_batches=micro_batches,
        in_flight=tuple(in_flight),
        interleaved=interleaved,
        defers=defers,
        continuous=compiled.continuous,
        splits_backward=compiled.splits_backward,
        weight_versions=versions,
        late_update=defers or versioned,
        updates_per_batch=tuple(compiled.updates_per_batch or (1,) * stages),
        virtual_stages=v,
        layout=compiled.layout_kind,
        in_flight_chunks=tuple(chunks),
    )


def _deeper(schedule: str, stages: int, micro_batches: int) -> ScheduleTraits:
    from ..schedules.compiler import resolve_params
    from ..schedules.spec import ScheduleError, load_spec

    spec = load_spec(schedule)
    try:
        resolve_params(spec, stages, micro_batches, {"deferred_stages": []} if "deferred_stages" in spec.params else {})
    except ScheduleError as exc:
        raise PlannerError(
            f"schedule {schedule!r} cannot be planned at {stages} stages x {micro_batches} micro-batches: {exc}"
        ) from None
    base = schedule_traits(schedule, DEPTH_PROBE, micro_batches)
    prev = schedule_traits(schedule, DEPTH_PROBE - 1, micro_batches)

    def at(x: tuple[int, ...], d: int) -> int:  # by distance d from the last stage, continued linearly
        n = len(x)
        return x[n - 1 - d] if d < n else x[0] + (x[0] - x[1]) * (d - n + 1)

    def by_distance(field: str) -> tuple[int, ...]:
        # linear in the distance from the last stage and in the depth (zb-h1 holds K everywhere)
        x, y = getattr(base, field), getattr(prev, field)
        return tuple(
            at(x, d) + (stages - DEPTH_PROBE) * (at(x, d) - at(y, d)) for d in (stages - 1 - s for s in range(stages))
        )

    in_flight = by_distance("in_flight")
    v = base.virtual_stages
    per_chunk = [
        tuple(
            at(tuple(x[c] for x in base.in_flight_chunks), d)
            + (stages - DEPTH_PROBE)
            * (at(tuple(x[c] for x in base.in_flight_chunks), d) - at(tuple(x[c] for x in prev.in_flight_chunks), d))
            for d in (stages - 1 - s for s in range(stages))
        )
        for c in range(v)
    ]
    chunks = tuple(zip(*per_chunk))
    if not base.continuous:  # a flush pipeline holds at most its M micro-batches (per chunk)
        in_flight = tuple(min(x, v * micro_batches) for x in in_flight)
        chunks = tuple(tuple(min(x, micro_batches) for x in row) for row in chunks)
    return ScheduleTraits(
        name=base.name,
        stages=stages,
        micro_batches=micro_batches,
        in_flight=in_flight,
        interleaved=base.interleaved,
        defers=base.defers,
        continuous=base.continuous,
        splits_backward=base.splits_backward,
        weight_versions=by_distance("weight_versions"),
        late_update=base.late_update,
        updates_per_batch=by_distance("updates_per_batch"),
        virtual_stages=v,
        layout=base.layout,
        in_flight_chunks=chunks,
    )
