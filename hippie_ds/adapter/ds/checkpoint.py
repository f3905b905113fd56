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
