"""DeepSpeed's pipeline module reached by name: ``PipelineModule`` (the class ``hippie_ds.PipelineModule``
subclasses), its layer specs and topology, and the internals of a built module hippie-ds reads or
sets, each as a named operation (roughly: what it does in DeepSpeed's own terms).

The subclass also overrides ``_build`` and ``_partition_layers`` by name
(:data:`hippie_ds._compat.OVERRIDES`).
"""

from __future__ import annotations

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "dualpipev_module"]


def dualpipev_module() -> type:
    """Roughly: ``deepspeed.runtime.pipe.dualpipev.DualPipeVModule`` (imported when asked: DeepSpeed's V-shaped
    module)."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    return DualPipeVModule


def layer_specs(module) -> list:
    """Roughly: ``module._layer_specs`` (every layer of the model, as given: specs, modules, callables; global
    indices)."""
    return module._layer_specs


def has_layer_specs(module) -> bool:
    """Roughly: ``hasattr(module, "_layer_specs")`` (a DeepSpeed pipeline module, built)."""
    return hasattr(module, "_layer_specs")


def topology(module):
    """Roughly: ``module._topo`` (its ``ProcessTopology``; None on an object without one)."""
    return getattr(module, "_topo", None)


def stage_of_rank(module, rank: int) -> int:
    """Roughly: ``module._topo.get_coord(rank).pipe`` (the pipeline stage of global rank ``rank``)."""
    return module._topo.get_coord(rank).pipe


def data_parallel_index(module, rank: int) -> int:
    """Roughly: ``module._topo.get_coord(rank).data`` (the data-parallel index of global rank ``rank``)."""
    return module._topo.get_coord(rank).data


def local_range(module) -> tuple[int, int]:
    """Roughly: ``(module._local_start, module._local_stop)`` (the global layer range the rank built)."""
    return module._local_start, module._local_stop


def local_start(module, *default) -> int:
    """Roughly: ``module._local_start`` (the global index of the rank's first layer; ``default``,
    if given, where the module has none)."""
    return getattr(module, "_local_start", *default)


def set_bounds(module, start: int, stop: int) -> None:
    """Roughly: ``module._set_bounds(start=start, stop=stop)`` (the range ``_build`` builds next)."""
    module._set_bounds(start=start, stop=stop)


def set_local_range(module, start: int, stop: int) -> None:
    """Roughly: ``_set_bounds`` without ``nn.Module.__setattr__``: ``object.__setattr__`` of
    ``_local_start`` / ``_local_stop`` (a chunk's view swapped in, adapter/module/chunks.py)."""
    object.__setattr__(module, "_local_start", start)
    object.__setattr__(module, "_local_stop", stop)


def precompute_checkpointable_values(module) -> None:
    """Roughly: ``module._precompute_checkpointable_values()`` (which interval blocks of ``forward_funcs`` hold
    parameters)."""
    module._precompute_checkpointable_values()


def recursive_getattr(module, obj, attr: str):
    """Roughly: ``module._recursive_getattr(obj, attr)`` (a dotted attribute, as ``tied_comms``' ``weight_attr`` names
    it)."""
    return module._recursive_getattr(obj, attr)


def set_random_seed(seed: int) -> None:
    """Roughly: ``deepspeed.runtime.utils.set_random_seed(seed)`` (what ``PipelineModule.forward`` seeds layers
    with)."""
    from deepspeed.runtime import utils

    utils.set_random_seed(seed)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Roughly: ``deepspeed.runtime.utils.partition_uniform`` (``partition_method="uniform"``'s boundaries)."""
    from deepspeed.runtime.utils import partition_uniform as uniform

    return uniform(num_items=num_items, num_parts=num_parts)
