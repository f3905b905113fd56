"""What hippie-ds adds to DeepSpeed's pipeline checkpoints, and how it crosses to stock DeepSpeed.

hippie-ds checkpoints are DeepSpeed checkpoints (layer files + one ``mp_rank_XX`` file per stage);
its own state rides in the client state:

- ``hippie_ds_state`` (:data:`STATE_KEY`): the training state below, one dict with a ``format``
  field (:func:`training_state`; checkpoints of format 1 kept three keys, format 2 had no tied
  copies; both still load, :func:`read_training_state`);
- ``hippie_ds_layout``: the stage boundaries, so a run re-planned to other boundaries or another
  depth can resume (weights are matched by layer by DeepSpeed's layer files; see
  :func:`check_layout`);
- in-flight training state, which the next step needs to be exact: a deferred stage's gradient
  (``hippie``), stashed weight versions and the lagged sum of tied gradients (``2bw``,
  ``pipedream``; :class:`~hippie_ds.adapter.gradients.tied.LaggedTieSums`). It is wrapped in
  :class:`InFlightState`, which unpickles only inside :func:`loading`: stock DeepSpeed loading
  such a checkpoint stops with :data:`STOCK_MESSAGE` instead of silently dropping the gradient.
  With nothing in flight (after ``engine.drain()``) nothing is wrapped, and stock DeepSpeed loads
  the checkpoint like its own;
- the stage's own copy of each module tied across stages (``2bw``, ``pipedream``): their holders
  apply the same gradients at other times of the pipeline, so under an LR schedule the copies
  differ, and DeepSpeed's load overwrites every copy with the first holder's
  (``PipelineModule._synchronize_tied_weights``); hippie-ds puts each copy back.

Stock checkpoints carry no layout: their stage count is DeepSpeed's (:func:`checkpoint_stages`),
and their optimizer state is matched to this stage's parameters as torch matches it
(:func:`optimizer_state_fits`).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading

LAYOUT_KEY = "hippie_ds_layout"
STATE_KEY = "hippie_ds_state"
STATE_FORMAT = 3
READS_FORMATS = (2, 3)  # and format 1's keys; format 2 had no tied copies
# format 1: one client-state key per part
_FORMAT1_KEYS = {
    "grad_buffer": "hippie_ds_grad_buffer",
    "weight_versions": "hippie_ds_weight_versions",
    "prediction": "hippie_ds_weight_prediction",
}
_PARTS = (*_FORMAT1_KEYS, "tied_copies")
# in DeepSpeed's model states: {pp_degree, tp_degree} (deepspeed.checkpoint.constants.CHECKPOINT_PARALLEL_DIMS)
PARALLEL_DIMS = "checkpoint_parallel_dimensions"
STOCK_MESSAGE = (
    "this checkpoint holds hippie-ds in-flight training state that stock DeepSpeed would drop: resume it "
    "with hippie_ds.initialize(...) (one import), or, for a deferred gradient (hippie, hippie-1f1b, "
    "hippie-zb), call engine.drain() on every rank before save_checkpoint; 2bw/pipedream always keep the "
    "stashed weight version their next batch uses"
)

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
        return _unwrap, (self.payload,)


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


def training_state(
    grad_buffer: dict, weight_versions: dict | None, prediction: dict | None, tied_copies: dict | None = None
):
    """The client-state value of :data:`STATE_KEY`: {format, grad_buffer, weight_versions,
    prediction, tied_copies}, wrapped in :class:`InFlightState` when a gradient or a weight version
    is in flight (the staleness correction's deltas alone are not: stock DeepSpeed may drop them).
    ``tied_copies``: {"key.attr": this stage's copy of a tied weight} (schedules that never flush)."""
    state = {
        "format": STATE_FORMAT,
        "grad_buffer": grad_buffer,
        "weight_versions": weight_versions,
        "prediction": prediction,
        "tied_copies": tied_copies,
    }
    return InFlightState(state) if holds_in_flight(grad_buffer, weight_versions) else state


def holds_in_flight(grad_buffer: dict | None, weight_versions: dict | None) -> bool:
    """True when the saved gradient state or weight versions hold something the next step needs:
    a deferred gradient, lagged tied-gradient sums, stashed weight versions."""
    return bool(
        grad_buffer
        and (grad_buffer["state"] != "empty" or grad_buffer.get("tie_sums") is not None)
        or weight_versions
        and weight_versions["stashed"]
    )


def read_training_state(client_state: dict) -> dict:
    """Pop hippie-ds's training state from a loaded client state, in any format:
    {grad_buffer, weight_versions, prediction, tied_copies}, each None when absent."""
    state = unwrap(client_state.pop(STATE_KEY, None))
    old = {part: unwrap(client_state.pop(key, None)) for part, key in _FORMAT1_KEYS.items()}
    if state is None:
        return {**old, "tied_copies": None}
    if state.get("format") not in READS_FORMATS:
        raise ValueError(
            f"hippie-ds checkpoint state of format {state.get('format')!r}; this version reads "
            f"formats 1 to {STATE_FORMAT}"
        )
    return {part: state.get(part) for part in _PARTS}


def layout(parts: list[int]) -> dict:
    """What identifies a stage layout: the stage boundaries (layer indices)."""
    return {"parts": [int(p) for p in parts]}


def checkpoint_stages(model_state: dict, model_files: list[str], layer_files: list[str]) -> int:
    """The pipeline stages of a DeepSpeed checkpoint. DeepSpeed writes one ``mp_rank_XX`` file per
    stage and tensor-parallel rank, numbered stage x TP degree + TP rank (the rank among its
    data-parallel replica's ranks: ``PipelineParallelGrid.get_model_parallel_rank``), so the files
    count stages only without tensor parallelism. The stage count is the saved
    ``checkpoint_parallel_dimensions.pp_degree`` (DeepSpeed 0.19 writes it); for checkpoints
    without it, the file count over the TP degree, which layer files name (``layer_XX-model_YY``)."""
    dims = model_state.get(PARALLEL_DIMS) if isinstance(model_state, dict) else None
    if isinstance(dims, dict) and isinstance(dims.get("pp_degree"), int) and dims["pp_degree"] > 0:
        return dims["pp_degree"]
    tp = len({m.group(1) for m in (re.search(r"-model_(\d+)", os.path.basename(f)) for f in layer_files) if m})
    return max(len(model_files) // max(tp, 1), 1)


def optimizer_state_fits(state: dict, saved_groups: list[dict], groups: list[list]) -> bool:
    """Whether a torch optimizer's saved ``state`` (indices of its ``param_groups``) fits this
    stage's parameters ``groups`` (the optimizer's groups' parameters), paired as torch's
    ``Optimizer.load_state_dict`` pairs them: group by group, each in its order. Optimizers with
    several groups (Megatron-DeepSpeed's weight decay on / off) number their parameters in
    another order than the module's."""
    if len(saved_groups) != len(groups) or any(len(g["params"]) != len(p) for g, p in zip(saved_groups, groups)):
        return False
    params = {i: p for g, ps in zip(saved_groups, groups) for i, p in zip(g["params"], ps)}
    return all(
        not hasattr(t, "shape") or len(t.shape) == 0 or (i in params and tuple(t.shape) == tuple(params[i].shape))
        for i, st in state.items()
        for t in st.values()
    )


def layout_changed(saved: dict | None, current: dict, checkpoint_stages: int, shapes_match: bool = True) -> bool:
    """True when the checkpoint's stage boundaries differ from ``current``'s. For a checkpoint
    without a layout (stock DeepSpeed's), the stage count and this stage's optimizer-state shapes
    (``shapes_match``) tell."""
    if saved is None:
        return checkpoint_stages != len(current["parts"]) - 1 or not shapes_match
    return saved["parts"] != current["parts"]


def layout_change_message(saved: dict | None, current: dict, checkpoint_stages: int) -> str:
    was = f"stage boundaries {saved['parts']}" if saved else f"{checkpoint_stages} stage(s)"
    return (
        f"the checkpoint was saved with {was}, this model has stage boundaries {current['parts']}: weights "
        "follow by layer, but optimizer state (e.g. Adam's moments) belongs to the old stages; pass "
        "load_optimizer_states=False to load_checkpoint to keep weights, step counters and the LR schedule and "
        "restart the optimizer state"
    )
