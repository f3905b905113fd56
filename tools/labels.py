"""The run labels of the tools (convergence, bench, staleness study), parsed in one place:

    NAME[@L][:METHOD[=C]]

NAME is a schedule (or ``dp``); ``@L`` sets ``hippie.deferred_layers`` = L (a layer count, or
``all``: whole deferred stages; ``auto``: chosen from costs, which the tool must supply); ``:METHOD[=C]`` sets ``hippie.staleness`` {"method": METHOD,
"coefficient": C}. e.g. ``hippie@1``, ``hippie@all:none``, ``2bw:extrapolate=1.5``.
"""
from __future__ import annotations


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


def split_name(label: str) -> tuple[str, dict | None]:
    """'hippie:extrapolate=1.5' -> ('hippie', {'method': 'extrapolate', 'coefficient': 1.5}): the
    label's ``hippie.staleness`` (None when it sets none) and its schedule."""
    schedule, _, variant = label.partition(":")
    if not variant:
        return schedule, None
    method, _, value = variant.partition("=")
    return schedule, {"method": method, **({"coefficient": float(value)} if value else {})}
