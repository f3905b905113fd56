"""What hippie-ds adds to DeepSpeed's pipeline checkpoints, and how it crosses to stock DeepSpeed.

hippie-ds checkpoints are DeepSpeed checkpoints (layer files + one ``mp_rank_XX`` file per stage);
its own state rides in the client state:

- ``hippie_ds_state`` (:data:`STATE_KEY`): the training state below, one dict with a ``format``
  field (:func:`training_state`; checkpoints of format 1 kept three keys and still load,
  :func:`read_training_state`);
- ``hippie_ds_layout``: the stage boundaries, so a run re-planned to other boundaries or another
  depth can resume (weights are matched by layer by DeepSpeed's layer files; see
  :func:`check_layout`);
- in-flight training state, which the next step needs to be exact: a deferred stage's gradient
  (``hippie``), stashed weight versions and the lagged sum of tied gradients (``2bw``,
  ``pipedream``; :class:`~hippie_ds.adapter.tied.LaggedTieSums`). It is wrapped in
  :class:`InFlightState`, which unpickles only inside :func:`loading`: stock DeepSpeed loading
  such a checkpoint stops with :data:`STOCK_MESSAGE` instead of silently dropping the gradient.
  With nothing in flight (after ``engine.drain()``) nothing is wrapped, and stock DeepSpeed loads
  the checkpoint like its own.
"""
from __future__ import annotations

import contextlib
import threading

LAYOUT_KEY = "hippie_ds_layout"
STATE_KEY = "hippie_ds_state"
STATE_FORMAT = 2
# format 1: one client-state key per part
_FORMAT1_KEYS = {"grad_buffer": "hippie_ds_grad_buffer", "weight_versions": "hippie_ds_weight_versions",
                 "prediction": "hippie_ds_weight_prediction"}
STOCK_MESSAGE = ("this checkpoint holds hippie-ds in-flight training state that stock DeepSpeed would drop: resume it "
                 "with hippie_ds.initialize(...) (one import), or, for a deferred gradient (hippie, hippie-1f1b, hippie-zb), "
                 "call engine.drain() on every rank before save_checkpoint; 2bw/pipedream always keep the stashed "
                 "weight version their next batch uses")

_state = threading.local()


class InFlightCheckpointError(RuntimeError):
    """A checkpoint with hippie-ds in-flight state was loaded outside hippie-ds."""


def _unwrap(payload):
    if not getattr(_state, "loading", False):
        raise InFlightCheckpointError(STOCK_MESSAGE)
    return InFlightState(payload)


class InFlightState:
    """Client-state value that only hippie-ds can unpickle (see the module docstring)."""

    def __init__(self, payload):
        self.payload = payload

    def __reduce__(self):
        return _unwrap, (self.payload, )


@contextlib.contextmanager
def loading():
    """Inside: checkpoints with in-flight state unpickle (hippie-ds's load_checkpoint)."""
    previous = getattr(_state, "loading", False)
    _state.loading = True
    try:
        yield
    finally:
        _state.loading = previous


def unwrap(value):
    """The payload of an :class:`InFlightState`, or ``value`` itself."""
    return value.payload if isinstance(value, InFlightState) else value


def training_state(grad_buffer: dict, weight_versions: dict | None, prediction: dict | None):
    """The client-state value of :data:`STATE_KEY`: {format, grad_buffer, weight_versions,
    prediction}, wrapped in :class:`InFlightState` when a gradient or a weight version is in flight
    (the staleness correction's deltas alone are not: stock DeepSpeed may drop them)."""
    state = {"format": STATE_FORMAT, "grad_buffer": grad_buffer, "weight_versions": weight_versions,
             "prediction": prediction}
    return InFlightState(state) if holds_in_flight(grad_buffer, weight_versions) else state


def holds_in_flight(grad_buffer: dict | None, weight_versions: dict | None) -> bool:
    """True when the saved gradient state or weight versions hold something the next step needs:
    a deferred gradient, lagged tied-gradient sums, stashed weight versions."""
    return bool(grad_buffer and (grad_buffer["state"] != "empty" or grad_buffer.get("tie_sums") is not None)
                or weight_versions and weight_versions["stashed"])


def read_training_state(client_state: dict) -> dict:
    """Pop hippie-ds's training state from a loaded client state, in either format:
    {grad_buffer, weight_versions, prediction}, each None when absent."""
    state = unwrap(client_state.pop(STATE_KEY, None))
    old = {part: unwrap(client_state.pop(key, None)) for part, key in _FORMAT1_KEYS.items()}
    if state is None:
        return old
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"hippie-ds checkpoint state of format {state.get('format')!r}; this version reads "
                         f"formats 1 and {STATE_FORMAT}")
    return {part: state.get(part) for part in _FORMAT1_KEYS}


def layout(parts: list[int]) -> dict:
    """What identifies a stage layout: the stage boundaries (layer indices)."""
    return {"parts": [int(p) for p in parts]}


def layout_changed(saved: dict | None, current: dict, checkpoint_stages: int, shapes_match: bool = True) -> bool:
    """True when the checkpoint's stage boundaries differ from ``current``'s. For a checkpoint
    without a layout (stock DeepSpeed's), the stage count and this stage's optimizer-state shapes
    (``shapes_match``) tell."""
    if saved is None:
        return checkpoint_stages != len(current["parts"]) - 1 or not shapes_match
    return saved["parts"] != current["parts"]


def layout_change_message(saved: dict | None, current: dict, checkpoint_stages: int) -> str:
    was = f"stage boundaries {saved['parts']}" if saved else f"{checkpoint_stages} stage(s)"
    return (f"the checkpoint was saved with {was}, this model has stage boundaries {current['parts']}: weights "
            "follow by layer, but optimizer state (e.g. Adam's moments) belongs to the old stages; pass "
            "load_optimizer_states=False to load_checkpoint to keep weights, step counters and the LR schedule and "
            "restart the optimizer state")
