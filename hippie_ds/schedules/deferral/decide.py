"""Partial deferral decided once (``hippie.deferred_layers``): from a schedule's deferred stages,
the config's value and a plain description of every stage's layers (:class:`StageLayers`, which
the adapter reads off the module), exactly what each stage delays (:func:`decide`). Pure Python;
the engine, ``hippie-ds schedule simulate`` and the planner read its result and decide nothing.

One unit: layers are global indices into the model's layer list. The config counts layers with
parameters (a count of 2 is a stage's first two layers that hold trainable parameters; the
functions and parameterless layers before and between them are not counted). Values:

* ``"untied"`` (:data:`DEFAULT_DEFERRED_LAYERS`, for the config, the CLI and the planner): a
  deferred stage delays its first layer with parameters that is not a module tied to another
  stage; the tied modules in front of it stay in-step, on every holder;
* an int ``n >= 1`` (every deferred stage) or ``{stage: n}`` (the stages named; the others
  whole): the first ``n`` layers with parameters, tied ones included; ``n`` at least the
  stage's count: the whole stage;
* ``"none"`` (:data:`NOT_DEFERRED`; the config reads a count of ``0`` as it, also per stage):
  the stage delays nothing, so it is not deferred: it runs as a stage left out of
  ``hippie.deferred_stages`` (all-reduce and update in-step, no gradient buffer);
* ``"all"``: every deferred stage whole (the paper's rule);
* ``"auto"`` is resolved beforehand (:func:`~hippie_ds.schedules.deferral.auto_layers.choose_deferred_layers`
  chooses leading layers of a cost file's stage; :func:`with_parameters` counts them in this unit;
  :func:`hippie_ds.schedules.resolve.resolve` does both).

Tied modules follow one rule (adapter/gradients/tied.py): when a stage delays a module tied to other
stages, every holder delays it; a holder that delays nothing else becomes a deferred stage that
delays only its tied weights (``layers`` empty, ``tied_keys`` set) - the one way a stage with no
delayed layer is deferred.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ...config import AUTO_LAYERS, DEFAULT_DEFERRED_LAYERS, NOT_DEFERRED, UNTIED_LAYERS, WHOLE_STAGE, ConfigError

__all__ = [
    "AUTO_LAYERS",
    "DEFAULT_DEFERRED_LAYERS",
    "NOT_DEFERRED",
    "UNTIED_LAYERS",
    "WHOLE_STAGE",
    "Deferral",
    "StageDeferral",
    "StageLayers",
    "decide",
    "delayed_layers",
    "with_ties",
    "with_parameters",
]


@dataclass(frozen=True)
class StageLayers:
    """One stage's layers as the deferral sees them: where they start (global index), which hold
    trainable parameters as built, and, per layer, the key of a module tied to another stage
    (None: not such a module). A stage with virtual stages is described by its first chunk's
    layers, the ones whose backward comes last."""

    first: int
    params: tuple[bool, ...]
    tied: tuple[str | None, ...] = ()
    elsewhere: frozenset[str] = frozenset()  # tie keys the stage holds outside these layers (its other chunks)

    def __post_init__(self):
        if self.tied and len(self.tied) != len(self.params):
            raise ValueError(f"StageLayers: {len(self.params)} layers but {len(self.tied)} tie entries")

    def tie_at(self, i: int) -> str | None:
        return self.tied[i] if self.tied else None

    def with_params(self) -> list[int]:
        """Global indices of the layers holding parameters."""
        return [self.first + i for i, has in enumerate(self.params) if has]

    def keys(self, upto: int | None = None) -> set[str]:
        """Tie keys of the modules tied to another stage held here (``upto``: at global indices <= it)."""
        return {
            self.tie_at(i)
            for i in range(len(self.params))
            if self.tie_at(i) is not None and (upto is None or self.first + i <= upto)
        } | (set(self.elsewhere) if upto is None else set())


@dataclass(frozen=True)
class StageDeferral:
    """What one deferred stage delays. ``layers``: global indices of its layers with parameters
    whose gradient is applied one step late; ``whole``: every parameter of the stage (then
    ``layers`` lists all its layers with parameters); ``tied_keys``: the tied modules it delays
    (every holder does); ``kept_keys`` ("untied"): tied modules among its leading layers that
    stay in-step."""

    stage: int
    layers: tuple[int, ...]
    whole: bool = False
    tied_keys: frozenset[str] = field(default_factory=frozenset)
    kept_keys: frozenset[str] = field(default_factory=frozenset)

    @property
    def delays_anything(self) -> bool:
        return self.whole or bool(self.layers) or bool(self.tied_keys)

    def leading(self, first: int) -> int | None:
        """The stage's leading layers up to its last delayed one (``first``: its first layer's
        global index): the count the simulator's ``deferred_layers`` takes, a cost file's unit
        (None: the whole stage; 0: no layer, only tied weights). The engine takes the
        :class:`StageDeferral` itself (global indices)."""
        if self.whole:
            return None
        return max(self.layers) + 1 - first if self.layers else 0


@dataclass(frozen=True)
class Deferral:
    """Every deferred stage's :class:`StageDeferral`; a stage not in ``stages`` updates in-step."""

    stages: Mapping[int, StageDeferral]

    def deferred_stages(self) -> list[int]:
        return sorted(self.stages)

    @property
    def tied_delayed(self) -> set[str]:
        return {k for d in self.stages.values() for k in d.tied_keys}

    @property
    def tied_kept(self) -> set[str]:
        return {k for d in self.stages.values() for k in d.kept_keys}

    def leading(self, layers: Mapping[int, StageLayers]) -> dict[int, int]:
        """{stage: leading layers} of the stages not delayed whole (what the simulator takes as
        ``deferred_layers``)."""
        return {s: d.leading(layers[s].first) for s, d in sorted(self.stages.items()) if not d.whole}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def delayed_layers(
    deferred_stages: Sequence[int], value: Any, layers: Mapping[int, StageLayers]
) -> dict[int, StageDeferral]:
    """Per deferred stage, the layers ``value`` delays there, before the tie rule; a stage that
    delays nothing is kept with empty ``layers`` (:func:`with_ties` drops it)."""
    shown = f'config key "hippie.deferred_layers" = {value!r}'
    if value == NOT_DEFERRED:
        value = 0
    elif isinstance(value, dict):
        value = {s: 0 if n == NOT_DEFERRED else n for s, n in value.items()}
    if value == AUTO_LAYERS:
        raise ConfigError(f"{shown}: resolve it first (choose_deferred_layers, then with_parameters)")
    if not (value in (WHOLE_STAGE, UNTIED_LAYERS) or _count(value) or isinstance(value, dict)):
        raise ConfigError(f'{shown}: allowed "untied", "all", "none", a count >= 0 or {{stage: count}}')
    if isinstance(value, dict):
        extra = sorted(set(value) - set(deferred_stages))
        if extra:
            raise ConfigError(f"{shown}: stage(s) {extra} are not deferred; deferred stages: {sorted(deferred_stages)}")
    out = {}
    for s in deferred_stages:
        st = layers[s]
        ours = st.with_params()
        n = value if _count(value) else value.get(s) if isinstance(value, dict) else None
        if value == UNTIED_LAYERS:
            pick = [st.first + i for i, has in enumerate(st.params) if has and st.tie_at(i) is None][:1]
            whole = bool(pick) and pick == ours and not st.keys()
            out[s] = StageDeferral(
                s,
                tuple(ours if whole else pick),
                whole,
                kept_keys=frozenset() if whole or not pick else frozenset(st.keys(pick[0])),
            )
        elif n is None or n and n >= len(ours):  # "all", a stage the mapping leaves out, every layer
            out[s] = StageDeferral(s, tuple(ours), True)
        else:
            out[s] = StageDeferral(s, tuple(ours[:n]))
    return out


def with_ties(
    stages: Mapping[int, StageDeferral], layers: Mapping[int, StageLayers], tie_rule: bool = True
) -> Deferral:
    """The deferred stages that delay something, under one rule per tied module (``tie_rule``:
    the schedule's stages update apart; False where DeepSpeed's tied reduction keeps the copies
    equal): a tied module some stage delays (among its delayed leading layers, or its whole
    stage) is delayed on every holder; a holder delaying nothing else is added with only it."""
    kept = {s: d for s, d in stages.items() if d.whole or d.layers}
    if not tie_rule:
        return Deferral(kept)

    def reached(s: int, d: StageDeferral) -> set[str]:
        return layers[s].keys() if d.whole else layers[s].keys(max(d.layers))

    delayed = {k for s, d in kept.items() for k in reached(s, d) - d.kept_keys}
    out = {}
    for s in sorted(set(kept) | {h for h, st in layers.items() if st.keys() & delayed}):
        mine = frozenset(layers[s].keys() & delayed)
        base = kept.get(s, StageDeferral(s, ()))
        out[s] = StageDeferral(s, base.layers, base.whole, mine, base.kept_keys)
    return Deferral(out)


def decide(
    deferred_stages: Sequence[int], value: Any, layers: Mapping[int, StageLayers], tie_rule: bool = True
) -> Deferral:
    """What every stage delays: :func:`delayed_layers` then :func:`with_ties`. ``deferred_stages``:
    the compiled schedule's; ``value``: ``hippie.deferred_layers`` ("auto" resolved);
    ``layers``: every stage's (at least the deferred ones and the holders of tied modules)."""
    return with_ties(delayed_layers(deferred_stages, value, layers), layers, tie_rule)


def with_parameters(params: Sequence[bool], leading: int) -> int:
    """The layers with parameters among a stage's first ``leading`` layers (``params``: which of
    its layers hold parameters): a leading-layer count ("auto"'s, a cost file's layers) in the
    config's unit."""
    return sum(1 for has in params[:leading] if has)
