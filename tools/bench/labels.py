"""The run labels of the bench (the cluster bench, its studies, convergence and the rank worker),
parsed in one place:

    NAME[@L][:METHOD[=C]][+ef=G][+dc=D]

NAME is ``dp`` (DeepSpeed's data-parallel engine over every rank, no pipeline) or a schedule; ``@L``
sets ``hippie.deferred_layers`` = L (a layer count, or ``all``: whole deferred stages; ``auto``:
chosen from costs, which the tool must supply); ``:METHOD[=C]`` sets ``hippie.staleness``
{"method": METHOD, "coefficient": C}, ``+ef=G`` its ``error_feedback`` and ``+dc=D`` its
``delay_compensation`` (:func:`split_name`). e.g. ``hippie@1``, ``hippie@all:none``, ``2bw:extrapolate=1.5``.

Which engine runs a NAME: the bench's names are the reports' and the papers', where ``1f1b`` is
DeepSpeed's stock engine and ``hds-1f1b`` hippie-ds's compiled 1F1B. The rank workers (the
bench's and tests/distributed/train_worker.py) take engine labels, where ``stock`` is DeepSpeed's
engine and every other name a schedule of ``hippie_ds.initialize``: :func:`engine_label` is the one
mapping from the first to the second.
"""

from __future__ import annotations

DATA_PARALLEL = "dp"
STOCK = "stock"  # engine label: deepspeed.initialize on a PipelineModule (DeepSpeed's TrainSchedule)
_ENGINE_LABELS = {"1f1b": STOCK, "hds-1f1b": "1f1b"}


def engine_label(name: str) -> str:
    """A bench name -> the rank worker's engine label: ``1f1b`` (stock DeepSpeed in the reports) ->
    ``stock``, ``hds-1f1b`` -> ``1f1b`` (hippie-ds's); ``dp`` and hippie-ds's schedules unchanged."""
    return _ENGINE_LABELS.get(name, name)


def split_layers(label: str) -> tuple[str, int | str | None]:
    """'hippie@1:none' -> ('hippie:none', 1): the label's ``hippie.deferred_layers`` (None when it
    sets none) and the rest of the label."""
    schedule, at, rest = label.partition("@")
    if not at:
        return label, None
    layers, colon, variant = rest.partition(":")
    if not (layers.isdigit() or layers in ("all", "auto")):
        raise SystemExit(f"{label!r}: expected NAME@L[:METHOD[=C]] with L a layer count, 'all' or 'auto'")
    return schedule + colon + variant, int(layers) if layers.isdigit() else layers


_ADDITIONS = {"ef": "error_feedback", "dc": "delay_compensation"}  # '+KEY=VALUE' after a label's method


def split_name(label: str) -> tuple[str, dict | None]:
    """'hippie:extrapolate=1.5' -> ('hippie', {'method': 'extrapolate', 'coefficient': 1.5}): the
    label's ``hippie.staleness`` (None when it sets none) and its schedule. '+ef=G' after the method
    adds ``error_feedback`` G ('2bw:extrapolate-made+ef=0.5'), '+dc=D' ``delay_compensation`` D
    ('2bw:none+dc=300'), in either order."""
    schedule, _, variant = label.partition(":")
    if not variant:
        return schedule, None
    variant, *additions = variant.split("+")
    method, _, value = variant.partition("=")
    staleness = {"method": method, **({"coefficient": float(value)} if value else {})}
    for addition in additions:
        key, _, number = addition.partition("=")
        if key not in _ADDITIONS or not number:
            raise SystemExit(f"{label!r}: expected NAME:METHOD[=C][+ef=G][+dc=D], not {'+' + addition!r}")
        staleness[_ADDITIONS[key]] = float(number)
    return schedule, staleness
