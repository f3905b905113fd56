"""One pipeline stage as DeepSpeed's ``PipelineEngine`` holds it, seen by hippie-ds's stage runtime
(:class:`~hippie_ds.adapter.stage.runtime.StageRuntime`): DeepSpeed owns the pipe buffers, the
p2p boundary, the loss and its own instruction handlers, so the runtime reaches them here, each as a
named operation that says roughly what it does in DeepSpeed's terms. The engine itself stays behind
this object: nothing else the runtime holds is given it."""

from __future__ import annotations

import contextlib

from deepspeed.runtime.pipe.engine import PIPE_RECV_GRAD_TIMER, PIPE_SEND_GRAD_TIMER, PipelineEngine

from . import engine as ds_engine


class DeepSpeedStage:
    """DeepSpeed's side of one stage: its buffers, its p2p state and its handlers, on ``engine``
    (a ``PipelineEngine`` whose ``__init__`` has run)."""

    def __init__(self, engine):
        self._engine = engine
        self.grid = engine.grid
        self.stage_id = engine.stage_id
        self.global_rank = engine.global_rank

    # ------------------------------------------------------------------ what the handlers read
    @property
    def pipe_buffers(self) -> dict:
        """Roughly: ``engine.pipe_buffers`` ({"inputs", "outputs", ...}: one slot per buffer id)."""
        return self._engine.pipe_buffers

    @property
    def next_stage(self) -> int:
        """Roughly: ``engine.next_stage`` (the selected chunk's neighbour under virtual stages)."""
        return self._engine.next_stage

    @property
    def prev_stage(self) -> int:
        """Roughly: ``engine.prev_stage``."""
        return self._engine.prev_stage

    @property
    def masked_inputs(self) -> bool:
        """Roughly: ``engine.has_attention_mask or engine.has_bool_tensors`` (the last input is a mask
        sent as half, with no gradient)."""
        return self._engine.has_attention_mask or self._engine.has_bool_tensors

    def is_last_stage(self) -> bool:
        """Roughly: ``engine.is_last_stage()`` (the engine's answer: the last model part under chunks)."""
        return self._engine.is_last_stage()

    def take_loss(self):
        """Roughly: ``engine.loss`` (what the last forward computed)."""
        return self._engine.loss

    def set_loss(self, loss) -> None:
        """Roughly: ``engine.loss = loss`` (what DeepSpeed's backward on the last stage differentiates)."""
        self._engine.loss = loss

    def param_groups(self) -> list[dict]:
        """Roughly: ``engine.optimizer.param_groups`` (the wrapper's, whose learning rates the scheduler sets)."""
        return self._engine.optimizer.param_groups

    # ------------------------------------------------------------------ the schedule's loop
    def start_schedule(self, num_buffers: int) -> None:
        """Roughly: ``PipelineEngine._exec_schedule``'s start: ``_reserve_pipe_buffers(n)``, ``fwd_outputs = []``."""
        ds_engine.reserve_pipe_buffers(self._engine, num_buffers)
        self._engine.fwd_outputs = []

    def run_stock(self, instruction) -> None:
        """Roughly: ``PipelineEngine._INSTRUCTION_MAP[type(instruction)](engine, **instruction.kwargs)``:
        DeepSpeed's own handler (``_exec_forward_pass``, ``_exec_reduce_grads``, ...), not the subclass's."""
        handler = ds_engine.stock_instruction_map().get(type(instruction))
        if handler is None:
            raise RuntimeError(f"{type(self._engine).__name__} does not understand instruction {instruction!r}")
        handler(self._engine, **instruction.kwargs)

    def load_micro_batch(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_load_micro_batch(engine, buffer_id)``."""
        PipelineEngine._exec_load_micro_batch(self._engine, buffer_id)

    def forward_pass(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_forward_pass(engine, buffer_id)``."""
        PipelineEngine._exec_forward_pass(self._engine, buffer_id)

    def backward_pass(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_backward_pass(engine, buffer_id)``."""
        PipelineEngine._exec_backward_pass(self._engine, buffer_id)

    def reduce_tied_grads(self) -> None:
        """Roughly: ``PipelineEngine._exec_reduce_tied_grads(engine)``."""
        PipelineEngine._exec_reduce_tied_grads(self._engine)

    def reduce_grads(self) -> None:
        """Roughly: ``PipelineEngine._exec_reduce_grads(engine)`` (the bulk data-parallel all-reduce)."""
        PipelineEngine._exec_reduce_grads(self._engine)

    def optimizer_step(self) -> None:
        """Roughly: ``PipelineEngine._exec_optimizer_step(engine)`` (the pipeline-wide norm and overflow check)."""
        PipelineEngine._exec_optimizer_step(self._engine)

    # ------------------------------------------------------------------ p2p
    def send_meta_once(self, outputs) -> None:
        """Roughly: ``_exec_send_activations``' shape handshake (:func:`ds_engine.send_meta_once`)."""
        ds_engine.send_meta_once(self._engine, outputs)

    def receive_buffer_tensors(self) -> list:
        """Roughly: the tensors DeepSpeed receives gradients into (:func:`ds_engine.receive_buffer_tensors`)."""
        return ds_engine.receive_buffer_tensors(self._engine)

    def receive_buffers(self, outputs):
        """Roughly: ``_exec_recv_grads``' allocation of ``grad_layer`` (:func:`ds_engine.receive_buffers`)."""
        return ds_engine.receive_buffers(self._engine, outputs)

    def set_received_gradient(self, grad) -> None:
        """Roughly: ``engine.grad_layer = grad``."""
        ds_engine.set_received_gradient(self._engine, grad)

    def send_activations(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_send_activations(engine, buffer_id)``."""
        PipelineEngine._exec_send_activations(self._engine, buffer_id)

    def recv_activations(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_recv_activations(engine, buffer_id)``."""
        PipelineEngine._exec_recv_activations(self._engine, buffer_id)

    def send_grads(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_send_grads(engine, buffer_id)``."""
        PipelineEngine._exec_send_grads(self._engine, buffer_id)

    def recv_grads(self, buffer_id: int) -> None:
        """Roughly: ``PipelineEngine._exec_recv_grads(engine, buffer_id)``."""
        PipelineEngine._exec_recv_grads(self._engine, buffer_id)

    @contextlib.contextmanager
    def timed_p2p(self, what: str):
        """Roughly: DeepSpeed's p2p timer around the block (``what``: "send_grad" or "recv_grad"),
        when ``wall_clock_breakdown`` is on."""
        timer = {"send_grad": PIPE_SEND_GRAD_TIMER, "recv_grad": PIPE_RECV_GRAD_TIMER}[what]
        timed = self._engine.wall_clock_breakdown()
        if timed:
            self._engine.timers(timer).start()
        try:
            yield
        finally:
            if timed:
                self._engine.timers(timer).stop()
