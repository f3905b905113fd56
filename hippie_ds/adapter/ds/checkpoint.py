"""DeepSpeed's checkpoint files reached by name: which model-state files a load reads, as named
operations (roughly: what each does in DeepSpeed's own terms)."""

from __future__ import annotations


def checkpoint_files(engine, load_dir, tag) -> list:
    """Roughly: ``engine._get_all_ckpt_names(load_dir, tag)`` (the model-state files DeepSpeed's load reads,
    mp_rank_XX)."""
    return engine._get_all_ckpt_names(load_dir, tag)


def own_checkpoint_file(engine, load_dir, tag) -> str:
    """Roughly: ``engine._get_ckpt_name(load_dir, tag)`` (the one this rank's DeepSpeed load reads)."""
    return engine._get_ckpt_name(load_dir, tag)


class CheckpointFiles:
    """The model-state files one engine's DeepSpeed load reads, for the in-flight state
    (``checkpoint/in_flight.py``), which holds this and not the engine."""

    def __init__(self, engine):
        self._engine = engine

    def all(self, load_dir, tag) -> list:
        """Roughly: :func:`checkpoint_files` of the engine (``engine._get_all_ckpt_names(load_dir, tag)``)."""
        return checkpoint_files(self._engine, load_dir, tag)

    def own(self, load_dir, tag) -> str:
        """Roughly: :func:`own_checkpoint_file` of the engine (``engine._get_ckpt_name(load_dir, tag)``)."""
        return own_checkpoint_file(self._engine, load_dir, tag)
