"""The engine's split backward (zero-bubble schedules), as a component: what ``BackwardInputPass``
and ``BackwardWeightPass`` do, and what the first keeps per pipeline buffer for the second. The
torch part is :mod:`hippie_ds.adapter.gradients.split_backward`; this is the DeepSpeed side: pipe
buffers, the received gradient (``grad_layer``), the loss and DeepSpeed's backward hooks, reached
through :mod:`hippie_ds.adapter.ds.engine`. The engine's handlers (adapter/engine/handlers.py) call it."""
from __future__ import annotations

import contextlib

from deepspeed.utils import logger

from ...schedules.ir import CompiledSchedule
from ..ds import engine as ds_engine
from .split_backward import PendingWeightGrad, backward_input, backward_weight, check_coverage


class SplitBackward:
    """Per pipeline buffer, what backward_input left for backward_weight. Built with what it uses:
    ``engine``, the DeepSpeed engine whose pipe buffers, received gradient and backward hooks it
    works on (public attributes, and DeepSpeed's internals through ``ds.engine``); ``params``, the
    stage's trained parameters; ``store``, its :class:`~hippie_ds.adapter.gradients.store.GradStore`."""

    def __init__(self, engine, compiled: CompiledSchedule, params, store):
        self._engine, self._params, self._store = engine, params, store
        self._pending: dict[int, PendingWeightGrad] = {}
        self.loss_scaled = False  # the loss stage's backward_input divided the loss itself (DeepSpeed's hook must not)
        self.meter = None  # what backward_input keeps beyond the graph, counted (engine.count_split_state_in)
        self._coverage_checked = set()  # the model chunks checked (one, without virtual stages)
        # DeepSpeed's activation checkpoint refuses autograd.grad(): with it, B runs the whole
        # backward (DeepSpeed's own) and W has nothing left; values and order stay 1F1B's.
        module = engine.module
        self.whole_backward_in_input = getattr(module, "activation_checkpoint_interval", 0) > 0
        if compiled.splits_backward:  # its torch version refused at start-up (adapter/startup/checks.py)
            if self.whole_backward_in_input and engine.global_rank == 0:
                logger.info(f"hippie-ds: schedule {compiled.name!r} with activation_checkpoint_interval = "
                            f"{module.activation_checkpoint_interval}: backward_input runs the whole backward "
                            "(DeepSpeed's checkpoint needs it), backward_weight has nothing left to do")
            if engine.is_pipe_partitioned or engine.is_grad_partitioned:
                raise ValueError(f"schedule {compiled.name!r} splits the backward, which does not support "
                                 "partitioned pipeline activations or gradients (tensor-slice parallelism)")

    @contextlib.contextmanager
    def _engine_backward(self):
        """What PipelineEngine's backward sets for DeepSpeed's output hooks: the flag they check,
        and on the loss stage that the loss is already divided by the accumulation steps."""
        ds_engine.set_running_engine_backward(self._engine, True)
        self.loss_scaled = self._engine.is_last_stage()
        try:
            yield
        finally:
            ds_engine.set_running_engine_backward(self._engine, False)
            self.loss_scaled = False

    def backward_input(self, buffer_id, loss, chunk) -> None:
        """``inputs.grad = d out / d inputs`` of buffer ``buffer_id`` (``loss``: its loss on the loss
        stage, else None; ``chunk``: the model chunk selected), no parameter gradients."""
        engine = self._engine
        buffers = engine.pipe_buffers
        if loss is not None:
            # DeepSpeedEngine.backward's scaling; its per-tensor hook must not scale again
            outputs, grads = ds_engine.scale_loss(engine, loss / engine.gradient_accumulation_steps()), None
        else:
            outputs, grads = buffers["outputs"][buffer_id], ds_engine.received_gradient(engine)
        inputs = buffers["inputs"][buffer_id]
        if chunk not in self._coverage_checked:
            check_coverage(outputs, inputs, self._params,
                           [n for n, p in engine.module.named_parameters() if p.requires_grad])
            self._coverage_checked.add(chunk)
        with self._engine_backward():
            self._pending[buffer_id] = backward_input(outputs, grads, inputs, self._params)
        if self.meter is not None:
            self.meter.hold(self._pending[buffer_id].tensors())
        if loss is not None:
            ds_engine.backward_epilogue(engine)  # what engine.backward(loss) runs after loss.backward()
        buffers["output_tensors"][buffer_id] = None
        buffers["outputs"][buffer_id] = None

    def backward_weight(self, buffer_id) -> None:
        """``grads += d out / d params`` of the buffer's micro-batch; frees what backward_input kept."""
        # A stage without input gradients runs its whole backward here, through DeepSpeed's hooks.
        with self._engine_backward():
            backward_weight(self._pending.pop(buffer_id), self._params)
        self._store.collect_weight_pass()  # bf16: into the optimizer's accumulator
