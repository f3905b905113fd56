"""DeepSpeed's engines reached by name: ``PipelineEngine`` (the class ``HippiePipelineEngine``
subclasses) and the internals of it and of ``DeepSpeedEngine`` that hippie-ds reads, sets or calls,
each as a named operation. Every function says roughly what it does in DeepSpeed's own terms.

The engine subclass also overrides some of DeepSpeed's private methods by name (its schedule, its
forward and backward handlers, ...): those are :data:`hippie_ds._compat.OVERRIDES`, checked to
exist like the names here; ``tests/compat/test_seams.py`` allows them outside this package as overrides
only (``def _name`` and its ``super()._name(...)``).
"""

from __future__ import annotations

import contextlib

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.pipe.engine import PIPE_RECV_GRAD_TIMER, PIPE_SEND_GRAD_TIMER, PipelineEngine

__all__ = [
    "PipelineEngine",
    "PIPE_RECV_GRAD_TIMER",
    "PIPE_SEND_GRAD_TIMER",
    "P2P_STATE",
    "Boundary",
    "Backward",
    "ModelStep",
]

# ---------------------------------------------------------------- the instruction map


def stock_instruction_map() -> dict:
    """Roughly: ``PipelineEngine._INSTRUCTION_MAP`` (instruction class -> DeepSpeed's handler)."""
    return PipelineEngine._INSTRUCTION_MAP


def wrap_handlers(engine, wrap) -> None:
    """Roughly: ``engine._INSTRUCTION_MAP = {cls: wrap(cls, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}``:
    this instance's map, looked up before the class's (the bench times a stock engine so)."""
    engine._INSTRUCTION_MAP = {cls: wrap(cls, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}


# ---------------------------------------------------------------- pipe buffers and p2p state

# PipelineEngine attributes describing one p2p boundary (reset_activation_shape's list), with their
# values before any transfer: virtual stages keep one set per model chunk (chunk_selector)
P2P_STATE = {
    "first_output_send": True,
    "pipe_recv_buf": None,
    "grad_layer": None,
    "meta_buffer": None,
    "pipe_partition_input_meta_cache": None,
    "pipe_partition_output_meta_cache": None,
    "pipe_partition_grad_meta_cache": None,
    "grad_partition_grad_layer_meta_cache": None,
}


def p2p_state(engine) -> dict:
    """Roughly: ``{name: getattr(engine, name) for name in P2P_STATE}`` (the boundary's shapes and buffers)."""
    return {name: getattr(engine, name) for name in P2P_STATE}


def set_p2p_state(engine, state: dict) -> None:
    """Roughly: ``setattr(engine, name, value)`` for each of :data:`P2P_STATE` (``P2P_STATE`` itself: a fresh
    boundary)."""
    for name, value in state.items():
        setattr(engine, name, value)


def reserve_pipe_buffers(engine, num_buffers: int) -> None:
    """Roughly: ``engine._reserve_pipe_buffers(num_buffers)`` (slots in every ``pipe_buffers`` list)."""
    engine._reserve_pipe_buffers(num_buffers)


def send_meta_once(engine, outputs) -> None:
    """Roughly: ``_exec_send_activations``' shape handshake: with dynamic shapes or before the first
    send, ``engine._send_tensor_meta(outputs, engine.next_stage)``; ``first_output_send`` goes False."""
    if engine.dynamic_shape or engine.first_output_send:
        engine.first_output_send = False
        engine._send_tensor_meta(outputs, engine.next_stage)


def received_gradient(engine):
    """Roughly: ``engine.grad_layer`` (the gradient received from the next stage; one reused tensor, or a list)."""
    return engine.grad_layer


def set_received_gradient(engine, grad) -> None:
    """Roughly: ``engine.grad_layer = grad`` (as if ``_exec_recv_grads`` had received it)."""
    engine.grad_layer = grad


def receive_buffers(engine, outputs):
    """Roughly: ``_exec_recv_grads``' allocation (not partitioned): when the shapes may change or none
    is held, ``engine.grad_layer`` becomes ``_allocate_or_extend_buffers`` for ``outputs`` (one per
    floating-point output); returns ``grad_layer``."""
    if engine.dynamic_shape or engine.grad_layer is None:
        if torch.is_tensor(outputs):
            engine.grad_layer = engine._allocate_or_extend_buffers(0, list(torch.Tensor.size(outputs)), outputs.dtype)
        else:
            floating = [t for t in outputs if torch.Tensor.is_floating_point(t)]
            engine.grad_layer = [
                engine._allocate_or_extend_buffers(i, list(torch.Tensor.size(t)), t.dtype)
                for i, t in enumerate(floating)
            ]
    return engine.grad_layer


def receive_buffer_tensors(engine) -> list:
    """Roughly: ``[*engine._grad_layer_buf, *grad_layer]``: the tensors DeepSpeed receives gradients into."""
    layer = engine.grad_layer
    return [*engine._grad_layer_buf, *((layer,) if torch.is_tensor(layer) else layer or ())]


class Boundary:
    """One engine's p2p boundary as DeepSpeed's handlers read it: its neighbours and its
    :data:`P2P_STATE`, for virtual stages' per-chunk state (``engine/chunk_selector.py``), which holds
    this and not the engine."""

    def __init__(self, engine):
        self._engine = engine

    def neighbours(self) -> tuple[int, int]:
        """Roughly: ``(engine.prev_stage, engine.next_stage)`` (the stages DeepSpeed's p2p handlers talk to)."""
        return self._engine.prev_stage, self._engine.next_stage

    def set_neighbours(self, prev_stage: int, next_stage: int) -> None:
        """Roughly: ``engine.prev_stage, engine.next_stage = prev_stage, next_stage``."""
        self._engine.prev_stage, self._engine.next_stage = prev_stage, next_stage

    def state(self) -> dict:
        """Roughly: :func:`p2p_state` of the engine."""
        return p2p_state(self._engine)

    def set_state(self, state: dict) -> None:
        """Roughly: :func:`set_p2p_state` of the engine."""
        set_p2p_state(self._engine, state)


# ---------------------------------------------------------------- backward and step


def set_running_engine_backward(engine, running: bool) -> None:
    """Roughly: ``engine._running_engine_backward = running`` (what ``PipelineEngine``'s backward sets
    for DeepSpeed's output hooks, which check it)."""
    engine._running_engine_backward = running


def backward_epilogue(engine) -> None:
    """Roughly: ``engine._backward_epilogue()`` (what ``engine.backward(loss)`` runs after ``loss.backward()``)."""
    engine._backward_epilogue()


def scale_loss(engine, loss):
    """The loss scale ``DeepSpeedEngine.backward`` applies, applied the same way. Roughly: a ZeRO-family
    wrapper's ``optimizer.scale_if_loss(loss)`` (DeepSpeedZeroOptimizer's dynamic fp16 scale;
    BF16_Optimizer has none), else ``engine.torch_autocast_z0_gradscaler.scale(loss)``, else ``loss``.
    DeepSpeed 0.19 scales nothing for ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` (not ZeRO-family):
    their step divides the unscaled gradients by the scale all the same; so does the split backward's
    input pass that calls this, bit-identical to stock (docs/precision.md)."""
    if isinstance(engine.optimizer, ZeROOptimizer):
        return engine.optimizer.scale_if_loss(loss)
    if engine.torch_autocast_z0_gradscaler is not None:
        return engine.torch_autocast_z0_gradscaler.scale(loss)
    return loss


class Backward:
    """DeepSpeed's backward on one engine as the split backward (``gradients/split.py``) runs it, which
    holds this and not the engine: the loss scale, the received gradient, the flag DeepSpeed's output
    hooks check, the epilogue."""

    def __init__(self, engine):
        self._engine = engine

    def scale_loss(self, loss):
        """Roughly: :func:`scale_loss` of the engine."""
        return scale_loss(self._engine, loss)

    def received_gradient(self):
        """Roughly: :func:`received_gradient` of the engine (``engine.grad_layer``)."""
        return received_gradient(self._engine)

    def set_running(self, running: bool) -> None:
        """Roughly: :func:`set_running_engine_backward` of the engine."""
        set_running_engine_backward(self._engine, running)

    def epilogue(self) -> None:
        """Roughly: :func:`backward_epilogue` of the engine (``engine._backward_epilogue()``)."""
        backward_epilogue(self._engine)


def take_model_step(engine) -> None:
    """Roughly: ``engine._take_model_step(None)`` (DeepSpeedEngine's update: clip, step, zero, counters)."""
    engine._take_model_step(None)


def set_global_grad_norm(engine, norm: float) -> None:
    """Roughly: ``engine._global_grad_norm = norm`` (what ``get_global_grad_norm()`` returns; DeepSpeed
    sets it from the optimizer after each step)."""
    engine._global_grad_norm = norm


def clipping_setting(engine) -> float:
    """Roughly: ``engine._config.gradient_clipping`` (the config's value ``_take_model_step`` reads)."""
    return engine._config.gradient_clipping


def set_clipping_setting(engine, value: float) -> None:
    """Roughly: ``engine._config.gradient_clipping = value``."""
    engine._config.gradient_clipping = value


def set_grad_boundary(engine, forced: bool) -> None:
    """Roughly: ``engine._force_grad_boundary = forced`` (``is_gradient_accumulation_boundary()``
    answers True while set: DeepSpeed's ``OptimizerStep`` sets it around its step too)."""
    engine._force_grad_boundary = forced


def configure_python_gc(engine) -> None:
    """Roughly: ``engine._configure_python_gc()`` (DeepSpeedEngine's garbage-collection setting, from its config)."""
    engine._configure_python_gc()


class ModelStep:
    """DeepSpeed's model step on one engine and the engine settings it reads, for the per-stage step
    (``precision/step.py``), which holds this and not the engine: the step itself, the settings it
    takes for a stage's step (:meth:`settings`), its counters and its gradient norm."""

    def __init__(self, engine):
        self._engine = engine

    def take(self) -> None:
        """Roughly: :func:`take_model_step` (``engine._take_model_step(None)``)."""
        take_model_step(self._engine)

    def clipping(self) -> float:
        """Roughly: ``engine.gradient_clipping()`` (:func:`clipping_setting`)."""
        return self._engine.gradient_clipping()

    @contextlib.contextmanager
    def settings(self, mpu, clipping: float | None, counters: bool):
        """Inside: the engine's mpu is ``mpu``, its config's gradient clipping ``clipping`` (None: as
        it is), ``_force_grad_boundary`` holds; ``counters`` False: no LR scheduler, and
        ``global_steps`` / ``global_samples`` / ``skipped_steps`` come back as they were. All put back
        after, when the body raises too. Roughly: ``engine.mpu = mpu``, :func:`set_clipping_setting`,
        :func:`set_grad_boundary`, ``engine.lr_scheduler = None``."""
        e = self._engine
        mpu_before, clipping_before = e.mpu, clipping_setting(e)
        scheduler, steps, samples, skipped = e.lr_scheduler, e.global_steps, e.global_samples, e.skipped_steps
        try:
            if not counters:
                e.lr_scheduler = None
            e.mpu = mpu
            if clipping is not None:
                set_clipping_setting(e, clipping)
            set_grad_boundary(e, True)
            yield
        finally:
            set_grad_boundary(e, False)
            e.mpu = mpu_before
            set_clipping_setting(e, clipping_before)
            if not counters:
                e.lr_scheduler, e.global_steps, e.global_samples, e.skipped_steps = scheduler, steps, samples, skipped

    def set_global_grad_norm(self, norm: float) -> None:
        """Roughly: :func:`set_global_grad_norm` of the engine."""
        set_global_grad_norm(self._engine, norm)

    def count_skipped(self) -> None:
        """Roughly: ``engine.skipped_steps += 1`` (an fp16 update skipped, as stock counts it)."""
        self._engine.skipped_steps += 1

    def advance(self, schedule: bool = True) -> None:
        """Roughly: what ``_take_model_step`` advances after an update: ``engine.lr_scheduler.step()``
        (unless ``schedule`` is False; Megatron's scheduler takes ``train_batch_size()``), then
        ``global_steps += 1`` and ``global_samples += train_batch_size()``."""
        e = self._engine
        if e.lr_scheduler is not None and schedule:
            try:
                e.lr_scheduler.step()
            except TypeError:  # as DeepSpeed's _take_model_step: Megatron's scheduler takes the samples
                e.lr_scheduler.step(e.train_batch_size())
        e.global_steps += 1
        e.global_samples += e.train_batch_size()
