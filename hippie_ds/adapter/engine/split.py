"""The engine's split backward (zero-bubble schedules): ``BackwardInputPass`` and
``BackwardWeightPass``. The torch part is :mod:`hippie_ds.adapter.gradients.split_backward`; this is the DeepSpeed
side: pipe buffers, the received gradient (``grad_layer``), the loss slots and DeepSpeed's
backward hooks."""
from __future__ import annotations

import contextlib

from deepspeed.utils import logger

from ...schedules.ir import CompiledSchedule
from ..ds import engine as ds_engine
from ..gradients.split_backward import PendingWeightGrad, backward_input, backward_weight, check_coverage, check_torch_version


class SplitBackwardMixin:
    """Per pipeline buffer, what backward_input left for backward_weight."""

    _loss_scaled_by_us = False
    _split_meter = None

    def _init_split_backward(self, compiled: CompiledSchedule) -> None:
        self._pending_weight_grads: dict[int, PendingWeightGrad] = {}
        self._loss_scaled_by_us = False
        self._coverage_checked = set()  # the model chunks checked (one, without virtual stages)
        # DeepSpeed's activation checkpoint refuses autograd.grad(): with it, B runs the whole
        # backward (DeepSpeed's own) and W has nothing left; values and order stay 1F1B's.
        self._whole_backward_in_input = getattr(self.module, "activation_checkpoint_interval", 0) > 0
        if compiled.splits_backward:
            check_torch_version()
            if self._whole_backward_in_input and self.global_rank == 0:
                logger.info(f"hippie-ds: schedule {compiled.name!r} with activation_checkpoint_interval = "
                            f"{self.module.activation_checkpoint_interval}: backward_input runs the whole backward "
                            "(DeepSpeed's checkpoint needs it), backward_weight has nothing left to do")
            if self.is_pipe_partitioned or self.is_grad_partitioned:
                raise ValueError(f"schedule {compiled.name!r} splits the backward, which does not support "
                                 "partitioned pipeline activations or gradients (tensor-slice parallelism)")

    def count_split_state_in(self, meter) -> None:
        """Also count in ``meter`` (a :class:`hippie_ds.adapter.profiling.memory.ActivationMeter`) what
        backward_input keeps for backward_weight beyond the graph's saved tensors: the gradients at
        the parameter ops (benchmarks compare it with the simulator's memory held until W)."""
        self._split_meter = meter

    @contextlib.contextmanager
    def _engine_backward(self):
        """What PipelineEngine's backward sets for DeepSpeed's output hooks: the flag they check,
        and on the loss stage that the loss is already divided by the accumulation steps."""
        ds_engine.set_running_engine_backward(self, True)
        self._loss_scaled_by_us = self.is_last_stage()
        try:
            yield
        finally:
            ds_engine.set_running_engine_backward(self, False)
            self._loss_scaled_by_us = False

    def _exec_backward_input_pass(self, buffer_id):
        """Roughly: ``buffers['inputs'][buf].grad = d out / d inputs`` (no parameter gradients)."""
        if self._whole_backward_in_input:
            self._exec_backward_pass(buffer_id)
            return
        if self.is_last_stage():
            # DeepSpeedEngine.backward's scaling; its per-tensor hook must not scale again
            outputs, grads = ds_engine.scale_loss(self, self._losses.pop(buffer_id) / self.gradient_accumulation_steps()), None
        else:
            outputs, grads = self.pipe_buffers["outputs"][buffer_id], ds_engine.received_gradient(self)
        inputs, params = self.pipe_buffers["inputs"][buffer_id], self._params
        if self._chunks.chunk not in self._coverage_checked:
            check_coverage(outputs, inputs, params, [n for n, p in self.module.named_parameters() if p.requires_grad])
            self._coverage_checked.add(self._chunks.chunk)
        with self._engine_backward():
            self._pending_weight_grads[buffer_id] = backward_input(outputs, grads, inputs, params)
        if self._split_meter is not None:
            self._split_meter.hold(self._pending_weight_grads[buffer_id].tensors())
        if self.is_last_stage():
            ds_engine.backward_epilogue(self)  # what engine.backward(loss) runs after loss.backward()
        self.pipe_buffers["output_tensors"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_weight_pass(self, buffer_id):
        """Roughly: ``grads += d out / d params`` of the buffer's micro-batch; frees what I kept."""
        if self._whole_backward_in_input:
            return
        # A stage without input gradients runs its whole backward here, through DeepSpeed's hooks.
        with self._engine_backward():
            backward_weight(self._pending_weight_grads.pop(buffer_id), self._params)
        self._gradients.store.collect_weight_pass()  # bf16: into the optimizer's accumulator

    def _backward_prologue_per_tensor(self, grad):
        # DeepSpeed's output hook divides by the accumulation steps unless engine.backward(loss)
        # already did; the loss stage's backward_input divides the loss itself.
        if self._loss_scaled_by_us:
            return grad
        return super()._backward_prologue_per_tensor(grad)
