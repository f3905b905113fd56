"""fp32 gradient clipping of a module with virtual stages by the coefficient 1F1B uses.

Stock DeepSpeed clips fp32 gradients by their global norm (``DeepSpeedEngine.clip_fp32_gradients``
-> ``deepspeed.runtime.utils.clip_grad_norm_``): each pipeline rank sums the squares of its own
parameters' gradient norms (one ``torch.stack(norms).pow(2).sum()``), the pipeline all-reduces
those sums, the data-parallel group averages the root. A rank of a virtual layout holds other
parameters (``interleaved-1f1b``'s stage 0 holds parts 0 and 2 of 4), so its partial sum, and the
fp32 rounding of the total, differ: the clip coefficient parted from 1F1B's by ulps (1.75e-3 in
the parameters after 15 AdamW steps). :func:`clip_like_one_chunk` computes the sums 1F1B's
ranks would: every rank's per-parameter norms are gathered over the pipeline (one small object
all-gather a step), each rank sums those of the parameters 1F1B's rank of the same stage holds
and counts (DeepSpeed counts a parameter on model-parallel rank 0 only, unless it is model-parallel;
a pipeline's model-parallel rank is its stage, so stock's norm is stage 0's gradients'), in 1F1B's
order (tied modules first, as DeepSpeed registers them, then layers by index), and the same
all-reduces follow. The per-parameter norms are the same tensors in both layouts, so the
coefficient is bit-identical. A tied module's norms are each stage's own copy's (its copies may
differ in which parameters have a gradient), which is 1F1B's where the layout puts its holders on
1F1B's stages (interleaved; the V layout holds it once: equal to rounding). Only for DeepSpeed's
partition methods: a plan's model parts have no one-chunk counterpart (``one_chunk_parts`` None),
nor has a per-stage step (its own norm).
"""

from __future__ import annotations

import torch
from deepspeed import comm as dist

from ..ds import module as ds_module
from ..ds.module import TiedLayerSpec
from ..ds.runtime import data_parallel_group, is_model_parallel_parameter


def _norm(p) -> tuple[torch.Tensor, bool]:
    """clip_grad_norm_'s per-parameter norm, and whether every rank counts it (a model-parallel
    parameter: DeepSpeed counts the others on model-parallel rank 0 only, which for a pipeline's
    mpu is stage 0: stock's norm is stage 0's gradients' and the model-parallel ones')."""
    return p.grad.data.detach().float().norm(2.0), bool(is_model_parallel_parameter(p))


def _local_norms(module) -> dict:
    """{("layer", index) | ("tied", key): [(per-parameter gradient norm, counted everywhere)]} of this
    rank's layers."""
    tied = {id(m) for m in module.tied_modules.values()}
    norms = {
        ("tied", key): [_norm(p) for p in m.parameters() if p.grad is not None]
        for key, m in module.tied_modules.items()
    }
    for index, layer in module.local_layers():
        if isinstance(layer, torch.nn.Module) and id(layer) not in tied:
            norms[("layer", index)] = [_norm(p) for p in layer.parameters() if p.grad is not None]
    return norms


def _one_chunk_order(specs, start: int, stop: int) -> list[tuple[str, object]]:
    """The order DeepSpeed's module of layers [start, stop) lists its parameters in: the tied
    modules (registered before the layers) in first-use order, then each module layer by index."""
    keys = list(dict.fromkeys(s.key for s in specs[start:stop] if isinstance(s, TiedLayerSpec)))
    return [("tied", k) for k in keys] + [
        ("layer", i) for i in range(start, stop) if not isinstance(specs[i], TiedLayerSpec)
    ]


def clip_like_one_chunk(module, grid, mpu, device, max_norm: float) -> torch.Tensor:
    """Clip this rank's fp32 gradients (of ``module``, the stage's ``PipelineModule``) by 1F1B's
    coefficient; returns the total norm (as stock). ``grid``: the pipe grid; ``mpu``: the engine's
    (the pipeline's model-parallel group); ``device``: the engine's."""
    gathered = [None] * grid.get_pipe_parallel_world_size()
    dist.all_gather_object(gathered, _local_norms(module), group=grid.get_pipe_parallel_group())
    norms = {}
    for part in gathered:
        norms.update(part)
    # a tied module's copies differ in which parameters have a gradient (Megatron's head copy leaves the
    # position table's None): this stage's own copy is the one 1F1B's rank of this stage holds
    norms.update({key: value for key, value in gathered[grid.get_stage_id()].items() if key[0] == "tied"})
    parts = module.one_chunk_parts
    stage, first = grid.get_stage_id(), mpu.get_model_parallel_rank() == 0
    mine = [
        n
        for key in _one_chunk_order(ds_module.layer_specs(module), parts[stage], parts[stage + 1])
        for n, everywhere in norms.get(key, [])
        if first or everywhere
    ]
    total = torch.stack(mine).pow(2.0).sum().float() if mine else torch.FloatTensor([0.0])
    total = total.to(device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(1.0 / 2.0)
    dp = data_parallel_group()
    total = total * 1.0 / float(dist.get_world_size(group=dp))
    dist.all_reduce(total, group=dp)
    params = [p for p in module.parameters() if p.grad is not None]
    total = total.to(params[0].device)
    coef = torch.min(
        torch.tensor([1.0], device=total.device), torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6)
    )
    for p in params:
        p.grad.data.mul_(coef)
    return total
