"""Profile files of either format: the one reader that picks PipeDream's ``graph.txt``
(:mod:`.pipedream_profile`) or hippie-ds's YAML/JSON (:mod:`.profile`). Its own module so that the
two format modules do not import each other."""

from __future__ import annotations

from pathlib import Path

from hippie_ds.data_files import read_data_file

from .pipedream_profile import read_pipedream
from .profile import Profile, ProfileError, profile_from_dict


def load_profile(path: str | Path, fmt: str | None = None, batch_size: int | None = None) -> Profile:
    """Read a profile: ``fmt`` 'pipedream' (graph.txt) or 'hippie' (YAML/JSON); by default
    from the suffix (.txt is PipeDream). ``batch_size`` overrides the recorded profiled size."""
    path = Path(path)
    if fmt is None:
        fmt = "pipedream" if path.suffix.lower() == ".txt" else "hippie"
    if fmt == "pipedream":
        return read_pipedream(path, batch_size=batch_size)
    if fmt != "hippie":
        raise ProfileError(f"profile format {fmt!r}: expected 'pipedream' or 'hippie'")
    profile = profile_from_dict(read_data_file(path, "profile", ProfileError), str(path))
    if batch_size is not None:
        profile = profile.model_copy(update={"batch_size": batch_size})
    return profile
