"""Where ``hippie_ds.PipelineModule`` finds the DeepSpeed config when it is built without ``config=``.

Real training scripts (Megatron-DeepSpeed's ``GPTModelPipe``, GPT-NeoX's pipe model) subclass
DeepSpeed's ``PipelineModule`` and build it without any config; the config reaches DeepSpeed only
later, in ``deepspeed.initialize``. The module must know the schedule's virtual stages and the
``hippie.plan`` when it partitions, so it looks, in this order:

1. :func:`set_config` (``hippie_ds.set_config(config)``): a dict or a file path the script sets
   before building the model;
2. ``--deepspeed_config VALUE`` / ``--deepspeed_config=VALUE`` in ``sys.argv`` (the argument
   ``deepspeed.add_config_arguments`` defines; its deprecated ``--deepscale_config`` and the spelling
   ``--deepspeed-config`` too; the last one given wins, as in argparse): a JSON file's path, or the
   urlsafe-base64 JSON that DeepSpeed's ``DeepSpeedConfig`` also accepts (GPT-NeoX passes it so).
   Megatron-DeepSpeed reads the file and sets ``args.deepspeed_config = None`` before building the
   model, but ``sys.argv`` still names it.

DeepSpeed's launcher (``deepspeed/launcher``) passes the script's own arguments through and exports
no config of its own to the ranks, so there is no third place. Nothing found: the module is
DeepSpeed's ``PipelineModule`` unchanged.
"""

from __future__ import annotations

import base64
import binascii
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ...config import ConfigError, read_config

ARGV_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--deepscale_config")

_override: dict | str | None = None


@dataclass(frozen=True)
class FoundConfig:
    """A DeepSpeed config and where it came from (``source``: a phrase for messages; ``path``: the
    file, which plan paths are relative to; None for a dict or base64)."""

    config: dict
    source: str
    path: str | None = None


def set_config(config: dict | str | os.PathLike | None) -> None:
    """The DeepSpeed config (a dict or a JSON file's path) that ``hippie_ds.PipelineModule`` built
    without ``config=`` uses, ahead of ``sys.argv``; None forgets it. Give ``hippie_ds.initialize``
    the same config."""
    global _override
    if config is not None and not isinstance(config, (dict, str, os.PathLike)):
        raise TypeError(f"hippie_ds.set_config({type(config).__name__}): expected a dict, a path or None")
    _override = config if config is None or isinstance(config, dict) else str(config)


def argv_value(argv: list[str]) -> tuple[str, str] | None:
    """(flag, value) of the last DeepSpeed config argument in ``argv``, or None."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in ARGV_FLAGS:
            continue
        if eq:
            found = (flag, value)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            found = (flag, argv[i + 1])
    return found


def decode(value: str | os.PathLike) -> tuple[dict, str | None]:
    """(config, file path or None) of a ``--deepspeed_config`` value: a file, else DeepSpeed's
    urlsafe-base64 JSON (decoded as ``DeepSpeedConfig`` decodes it)."""
    if os.path.exists(value):
        return read_config(value), str(value)
    try:
        import hjson  # DeepSpeed's own parser of the decoded string

        data = hjson.loads(base64.urlsafe_b64decode(str(value)).decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError, AttributeError):
        data = None
    if not isinstance(data, dict):
        raise ConfigError(
            f"DeepSpeed config {_short(str(value))!r}: no such file, and not the urlsafe-base64 JSON "
            "DeepSpeed also accepts"
        )
    return dict(data), None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def discover(argv: list[str] | None = None) -> FoundConfig | None:
    """The config a module built without ``config=`` takes (see the module docstring), or None."""
    if _override is not None:
        if isinstance(_override, dict):
            return FoundConfig(_override, "hippie_ds.set_config(<dict>)")
        config, path = decode(_override)
        return FoundConfig(config, f"hippie_ds.set_config({_override!r})", path)
    hit = argv_value(sys.argv[1:] if argv is None else argv)
    if hit is None:
        return None
    flag, value = hit
    config, path = decode(value)
    if path is not None:
        return FoundConfig(config, f"{flag} {value} (sys.argv)", str(Path(path)))
    return FoundConfig(config, f"{flag} <base64 JSON> (sys.argv)")


__all__ = ["ARGV_FLAGS", "FoundConfig", "argv_value", "decode", "discover", "set_config"]
