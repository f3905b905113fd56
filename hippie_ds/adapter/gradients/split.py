"""The engine's split backward (zero-bubble schedules), as a component: what ``BackwardInputPass``
and ``BackwardWeightPass`` do, and what the first keeps per pipeline buffer for the second. The
torch part is :mod:`hippie_ds.adapter.gradients.split_backward`; this is the DeepSpeed side: pipe
buffers, the received gradient (``grad_layer``), the loss and DeepSpeed's backward hooks, reached
through :class:`hippie_ds.adapter.ds.engine.Backward`. The stage's handlers (adapter/stage/handlers.py) call it."""

from __future__ import annotations

import contextlib
from typing import Callable

from deepspeed.utils import logger

from ...schedules.ir import CompiledSchedule
from ..ds.engine import Backward
from .split_backward import PendingWeightGrad, backward_input, backward_weight, check_coverage


class SplitBackward:
    """Per pipeline buffer, what backward_input left for backward_weight. Built with what it reads:
    ``module``, the stage's ``PipelineModule``; ``params``, its trained parameters; ``store``, its
    :class:`~hippie_ds.adapter.gradients.store.GradStore`; ``buffers``, DeepSpeed's pipe buffers
    (``engine.pipe_buffers``, the dict its handlers fill); ``backward``
    (:class:`~hippie_ds.adapter.ds.engine.Backward`: DeepSpeed's loss scale, received gradient, output
    hooks' flag and backward epilogue); ``is_last_stage`` and ``accumulation_steps``, the engine's
    public methods of those names; ``partitioned``: DeepSpeed partitions pipeline activations or
    gradients (tensor-slice parallelism); ``logs``: this rank says what it does (global rank 0)."""

    def __init__(
        self,
        compiled: CompiledSchedule,
        module,
        params,
        store,
        buffers: dict,
        backward: Backward,
        is_last_stage: Callable[[], bool],
        accumulation_steps: Callable[[], int],
        partitioned: bool = False,
        logs: bool = False,
    ):
        self._stage_module, self._params, self._store = module, params, store
        self._buffers, self._backward = buffers, backward
        self._is_last_stage, self._accumulation_steps = is_last_stage, accumulation_steps
        self._pending: dict[int, PendingWeightGrad] = {}
        self.loss_scaled = False  # the loss stage's backward_input divided the loss itself (DeepSpeed's hook must not)
        self.meter = None  # what backward_input keeps beyond the graph, counted (engine.count_split_state_in)
        self._coverage_checked = set()  # the model chunks checked (one, without virtual stages)
        # DeepSpeed's activation checkpoint refuses autograd.grad(): with it, B runs the whole
        # backward (DeepSpeed's own) and W has nothing left; values and order stay 1F1B's.
        self.whole_backward_in_input = getattr(module, "activation_checkpoint_interval", 0) > 0
        if compiled.splits_backward:  # its torch version refused at start-up (adapter/startup/checks.py)
            if self.whole_backward_in_input and logs:
                logger.info(
                    f"hippie-ds: schedule {compiled.name!r} with activation_checkpoint_interval = "
                    f"{module.activation_checkpoint_interval}: backward_input runs the whole backward "
                    "(DeepSpeed's checkpoint needs it), backward_weight has nothing left to do"
                )
            if partitioned:
                raise ValueError(
                    f"schedule {compiled.name!r} splits the backward, which does not support "
                    "partitioned pipeline activations or gradients (tensor-slice parallelism)"
                )

    @contextlib.contextmanager
    def _engine_backward(self):
        """What PipelineEngine's backward sets for DeepSpeed's output hooks: the flag they check,
        and on the loss stage that the loss is already divided by the accumulation steps."""
        self._backward.set_running(True)
        self.loss_scaled = self._is_last_stage()
        try:
            yield
        finally:
            self._backward.set_running(False)
            self.loss_scaled = False

    def backward_input(self, buffer_id, loss, chunk) -> None:
        """``inputs.grad = d out / d inputs`` of buffer ``buffer_id`` (``loss``: its loss on the loss
        stage, else None; ``chunk``: the model chunk selected), no parameter gradients."""
        buffers = self._buffers
        if loss is not None:
            # DeepSpeedEngine.backward's scaling; its per-tensor hook must not scale again
            outputs, grads = self._backward.scale_loss(loss / self._accumulation_steps()), None
        else:
            outputs, grads = buffers["outputs"][buffer_id], self._backward.received_gradient()
        inputs = buffers["inputs"][buffer_id]
        if chunk not in self._coverage_checked:
            check_coverage(
                outputs, inputs, self._params, [n for n, p in self._stage_module.named_parameters() if p.requires_grad]
            )
            self._coverage_checked.add(chunk)
        with self._engine_backward():
            self._pending[buffer_id] = backward_input(outputs, grads, inputs, self._params)
        if self.meter is not None:
            self.meter.hold(self._pending[buffer_id].tensors())
        if loss is not None:
            self._backward.epilogue()  # what engine.backward(loss) runs after loss.backward()
        buffers["output_tensors"][buffer_id] = None
        buffers["outputs"][buffer_id] = None

    def backward_weight(self, buffer_id) -> None:
        """``grads += d out / d params`` of the buffer's micro-batch; frees what backward_input kept."""
        # A stage without input gradients runs its whole backward here, through DeepSpeed's hooks.
        with self._engine_backward():
            backward_weight(self._pending.pop(buffer_id), self._params)
        self._store.collect_weight_pass()  # bf16: into the optimizer's accumulator
