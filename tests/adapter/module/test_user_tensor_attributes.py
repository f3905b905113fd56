"""Model code sets plain attributes on its parameters, and an instance attribute hides the tensor
method of the same name (Megatron's ``ColumnParallelLinear``: ``bias.stride = stride``, an int, so
``bias.stride()`` raised ``'int' object is not callable`` in the split backward's weight pass). Every
call hippie-ds makes on a user's parameter or activation goes through ``torch.Tensor``
(hippie_ds/adapter/module/tensor_calls.py says why). The sweep is checked here over the source; the model
that carries Megatron's attributes trains under every schedule in tests/real_clients/test_user_model_code.py."""

import ast
from pathlib import Path

import pytest
import torch

from hippie_ds.adapter.gradients import split_backward
from hippie_ds.adapter.module.tensor_calls import numel, tensor_bytes

PACKAGE = Path(__file__).resolve().parents[3] / "hippie_ds"
# the names the adapter gives a user's parameters and activations (gradients and buffers are torch's
# or hippie-ds's own objects, which no model code decorates)
USER_TENSOR_NAMES = {"p", "param", "w", "weight", "leaf", "x", "o", "y", "t", "tensor", "first", "inp"}
TENSOR_METHODS = {n for n in dir(torch.Tensor) if callable(getattr(torch.Tensor, n, None)) and not n.startswith("__")}


def _torch_modules():
    """The modules that touch tensors: all but the pure layers (schedules, planner, CLI)."""
    pure = {"schedules", "planner", "cli"}
    return [f for f in sorted(PACKAGE.rglob("*.py")) if not pure & set(f.relative_to(PACKAGE).parts[:-1])]


def test_no_tensor_method_is_called_on_a_user_tensor_by_attribute():
    found = []
    for f in _torch_modules():
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in TENSOR_METHODS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in USER_TENSOR_NAMES
            ):
                found.append(f"{f.relative_to(PACKAGE.parent)}:{node.lineno}: {node.func.value.id}.{node.func.attr}()")
    assert not found, "call these through torch.Tensor (hippie_ds/adapter/module/tensor_calls.py):\n" + "\n".join(found)


def test_the_sweep_covers_the_modules_that_touch_tensors():
    """The scan is not vacuous: it reads the split backward and the profiler, and would flag a call."""
    names = {f.name for f in _torch_modules()}
    assert {"split_backward.py", "profiler.py", "engine.py", "store.py"} <= names
    tree = ast.parse("p.stride()")
    call = tree.body[0].value
    assert call.func.attr in TENSOR_METHODS and call.func.value.id in USER_TENSOR_NAMES


def _megatron_param(shape, strides=None):
    p = torch.nn.Parameter(torch.randn(shape) if strides is None else torch.empty_strided(shape, strides).normal_())
    p.stride, p.partition_dim, p.partition_stride = 1, 0, 1  # ColumnParallelLinear's bias
    p.tensor_model_parallel, p.sequence_parallel, p.shared, p.main_grad = False, False, False, None
    return p


@pytest.mark.parametrize("strides", [None, (1, 3)])
def test_the_weight_pass_lays_out_a_gradient_for_a_parameter_whose_stride_is_an_int(strides):
    """What crashed: as_accumulated -> obeys_layout -> _dense on a parameter with ``stride = 1``.
    A transposed (column-major) parameter gets a gradient with its strides, as AccumulateGrad does."""
    leaf = _megatron_param((3, 4), strides)
    with pytest.raises(TypeError):
        leaf.stride()  # the premise: the attribute hides the method
    grad = torch.randn(3, 4)
    laid = split_backward.as_accumulated(grad, leaf)
    assert torch.equal(laid, grad)
    assert torch.Tensor.stride(laid) == torch.Tensor.stride(leaf)


def test_sizes_of_parameters_whose_methods_are_hidden():
    params = [_megatron_param((3, 4)), _megatron_param((5,))]
    assert numel(params) == 17 and tensor_bytes(params) == 68
