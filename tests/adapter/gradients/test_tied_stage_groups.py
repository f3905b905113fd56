"""What the engine tells the simulator of a model's tied modules (``Costs.tied_groups``, for the
'auto' choices): the stages that hold each, in DeepSpeed's key order. No processes."""

from types import SimpleNamespace

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from hippie_ds.adapter.gradients.tied import tied_stage_groups


def _model(specs, parts):
    owner = lambda idx: next(s for s in range(len(parts) - 1) if parts[s] <= idx < parts[s + 1])  # noqa: E731
    return SimpleNamespace(_layer_specs=specs, stage_owner=owner)


def test_tied_stage_groups_name_the_holders_of_each_tied_module_in_key_order():
    tied = lambda key: TiedLayerSpec(key, torch.nn.Linear, 2, 2)  # noqa: E731
    plain = LayerSpec(torch.nn.Linear, 2, 2)
    specs = [tied("wte"), plain, tied("pos"), plain, plain, tied("pos"), plain, tied("wte")]
    assert tied_stage_groups(_model(specs, [0, 2, 4, 6, 8])) == [[1, 2], [0, 3]]  # 'pos' before 'wte'
    # a module tied within one stage needs nobody: DeepSpeed's group is that rank alone
    assert tied_stage_groups(_model(specs, [0, 8])) == []
    assert tied_stage_groups(_model([plain] * 4, [0, 2, 4])) == []
