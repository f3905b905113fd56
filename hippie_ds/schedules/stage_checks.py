"""The validator's per-stage analysis of flush schedules: data flow (every micro-batch loaded /
received / computed / sent in a valid order, a split backward's W after its B), pipeline buffer
slots and the gradient state machine. Continuous schedules: :mod:`.continuous_checks`. Pure Python."""

from __future__ import annotations

from typing import Mapping

from .ir import (
    BUFFER_KINDS,
    GRAD_RECEIVING_KINDS,
    GRADIENT_CONSUMER_KINDS,
    OP_INFO,
    RECV_GRAD_KINDS,
    CompiledSchedule,
    Op,
)
from .check_common import Problem, check_slots, problem
from .grad_buffer import REDUCED, GradBuffer

_MB_KINDS = BUFFER_KINDS  # ops that concern one micro-batch

# ---------------------------------------------------------------------------------------------
# Data flow, buffer slots and gradients: one stage at a time


def _name(chunk: int, mb) -> str:
    """A chunk's micro-batch in messages: 'micro-batch 3', 'micro-batch 3 of chunk 1'."""
    return f"micro-batch {mb}" + (f" of chunk {chunk}" if chunk else "")


class _StageChecker:
    """One stage's stream, run ``iterations`` times. Gradient and gradient-buffer state carry
    over between iterations; everything about micro-batches is per iteration. ``rules`` is
    ``op_rules.RULES``, whose ``stage`` entry of each kind lists functions below (handed in, not
    imported: the table refers to this class)."""

    def __init__(self, compiled: CompiledSchedule, stage: int, rules: Mapping):
        self.rules = rules
        self.s = stage
        self.K = compiled.stages
        self.M = compiled.micro_batches
        self.layout = compiled.layout
        # what a stage computes: (chunk, micro-batch) items; one chunk: (0, mb)
        self.items = [(c, m) for c in range(compiled.virtual_stages) for m in range(self.M)]
        self.num_buffers = compiled.num_buffers[stage]
        self.ops = list(compiled.ops(stage))
        self.problems: list[Problem] = []
        # Parameter gradients: "empty" | "accumulating" | "reduced", plus an async all-reduce flag.
        self.grads = "empty"
        self.grads_reducing = False
        self.chunks_reducing: set[int] = set()  # start_allreduce(chunk): chunks whose all-reduce is in flight
        self.buffer = GradBuffer()

    def run(self, iterations: int) -> list[Problem]:
        self._check_slots()  # the same in every iteration
        for _ in range(iterations):
            self._iteration()
        return self.problems

    def _add(self, op: Op, reason: str) -> None:
        self.problems.append(problem(op, reason, stage=self.s))

    def _iteration(self) -> None:
        s, M = self.s, self.M
        # per (chunk, micro-batch): received, computed; loads per (first, last, micro-batch)
        self.loaded, self.recv_act, self.recv_grad, self.fwd = set(), set(), set(), set()
        self.bwd = set()  # micro-batches whose parameter gradients are accumulated
        self.igrad: set = set()  # micro-batches whose input gradient is computed
        self.update: Op | None = None  # this iteration's optimizer step / copy
        self.weights_changed: Op | None = None  # an update that changed this stage's weights
        for op in self.ops:
            mb = op.micro_batch
            if op.kind in _MB_KINDS and mb is not None and not 0 <= mb < M:
                self._add(op, f"micro-batch {mb} outside 0..{M - 1}")
                continue
            if op.kind in GRADIENT_CONSUMER_KINDS:
                self._consume(op)
            for rule in self.rules[op.kind].stage:
                rule(self, op)
        for mb in self.items:
            if mb not in self.fwd:
                self.problems.append(Problem(s, None, None, f"{_name(*mb)} is never forwarded"))
            if mb in self.igrad and mb not in self.bwd:
                self.problems.append(
                    Problem(
                        s,
                        None,
                        None,
                        f"{_name(*mb)}'s backward_weight is missing (its "
                        "backward_input ran: parameter gradients never computed)",
                    )
                )
            elif mb not in self.bwd:
                self.problems.append(Problem(s, None, None, f"{_name(*mb)} is never backwarded"))
        self._end_of_iteration()

    # -- data flow ---------------------------------------------------------------------------
    def _ends(self, op: Op) -> tuple[bool, bool]:
        """Whether the op's chunk holds the first / the last model part."""
        return self.layout.is_first(self.s, op.chunk), self.layout.is_last(self.s, op.chunk)

    def _load(self, op: Op) -> None:
        # a stage holding the first and the last part (the V) loads inputs and labels apart; the
        # engine reads the data iterator once per micro-batch
        role = (*self._ends(op), op.micro_batch)
        if role in self.loaded:
            self._add(op, f"micro-batch {op.micro_batch} loaded twice (the data iterator advances on each load)")
        self.loaded.add(role)

    def _recv_activation(self, op: Op) -> None:
        self.recv_act.add((op.chunk, op.micro_batch))

    def _recv_grad(self, op: Op) -> None:
        self.recv_grad.add((op.chunk, op.micro_batch))

    def _send_activation(self, op: Op) -> None:
        if (op.chunk, op.micro_batch) not in self.fwd:
            self._add(op, f"sends {_name(op.chunk, op.micro_batch)}'s activation before its forward")

    def _send_grad(self, op: Op) -> None:
        if (op.chunk, op.micro_batch) not in self.igrad:
            self._add(op, f"sends {_name(op.chunk, op.micro_batch)}'s gradient before its backward")

    def _forward(self, op: Op) -> None:
        """forward / forward_backward: the inputs are there, once."""
        (first, last), mb = self._ends(op), (op.chunk, op.micro_batch)
        item = _name(*mb)
        if mb in self.fwd:
            self._add(op, f"{item} forwarded twice")
        if not first and mb not in self.recv_act:
            self._add(op, f"forward of {item} before its activation is received (recv_activation)")
        if (first or last) and (first, last, mb[1]) not in self.loaded:
            what = "inputs" if first else "labels"
            self._add(op, f"forward of {item} before its {what} are loaded (load_micro_batch)")
        self.fwd.add(mb)

    def _forward_before_update(self, op: Op) -> None:
        """forward (a fused forward_backward's backward says it): on this iteration's weights."""
        if self.weights_changed is not None:
            self._add(
                op,
                f"forward after this iteration's {self.weights_changed.kind.value} at step "
                f"{self.weights_changed.step}: runs on weights already updated",
            )

    def _input_grad(self, op: Op) -> None:
        """backward / forward_backward / backward_input: the gradient of the stage's input."""
        mb, name = (op.chunk, op.micro_batch), op.kind.value
        item = _name(*mb)
        if not OP_INFO[op.kind].forward and mb not in self.fwd:  # a fused one ran its own
            self._add(op, f"{name} of {item} before its forward")
        if mb in self.igrad:
            self._add(op, f"{item} backwarded twice")
        if not self.layout.is_last(self.s, op.chunk) and mb not in self.recv_grad:
            self._add(op, f"{name} of {item} before its output gradient is received (recv_grad)")
        self._check_weights_unchanged(op, "backward")
        self.igrad.add(mb)

    def _backward_weight(self, op: Op) -> None:
        """backward_weight: after its backward_input, once, on the same weights."""
        mb = (op.chunk, op.micro_batch)
        if mb not in self.igrad:
            self._add(op, f"backward_weight of {_name(*mb)} before its backward_input")
        elif mb in self.bwd:
            self._add(op, f"backward_weight of {_name(*mb)} twice")
        self._check_weights_unchanged(op, "backward_weight")

    def _weight_grad(self, op: Op) -> None:
        """backward / forward_backward / backward_weight: the parameter gradients, accumulated."""
        mb = (op.chunk, op.micro_batch)
        if self.grads_reducing or op.chunk in self.chunks_reducing:
            self._add(op, f"{op.kind.value} while the gradients' all-reduce is in flight")
        self.bwd.add(mb)
        self.grads = "accumulating"

    def _check_weights_unchanged(self, op: Op, name: str) -> None:
        if self.update is not None:
            self._add(
                op,
                f"{name} after this iteration's {self.update.kind.value} at step {self.update.step}: "
                "its gradient is lost or applied in the wrong step",
            )
        elif self.weights_changed is not None:
            self._add(
                op,
                f"{name} after this iteration's {self.weights_changed.kind.value} at step "
                f"{self.weights_changed.step}: weights changed between forward and backward",
            )

    def _report(self, op: Op, error: str | None) -> None:
        if error is not None:
            self._add(op, error)

    def _all_backwards_done(self, op: Op) -> bool:
        missing = [m for m in self.items if m not in self.bwd]
        if missing:
            self._add(
                op,
                f"{op.kind.value} before all {len(self.items)} backwards of this iteration "
                f"({', '.join(_name(*m) for m in missing)} not yet backwarded)",
            )
        return not missing

    # -- gradients and the gradient buffer ---------------------------------------------------
    def _consume(self, op: Op) -> None:
        """An op that applies or buffers the iteration's gradients (``consumes_grads``): once."""
        if self.update is not None:
            self._add(
                op,
                f"second update in one iteration (already {self.update.kind.value} at step "
                f"{self.update.step}); a stage applies or buffers its gradients exactly once",
            )
        self.update = self.update or op

    def _no_chunk_in_flight(self, op: Op) -> None:
        if self.chunks_reducing:
            self._add(
                op,
                f"{op.kind.value} while chunk {min(self.chunks_reducing)}'s all-reduce is in flight "
                "(start_allreduce(chunk) is for stages that update in-step: wait_allreduce(grads) first)",
            )

    def _reduce_grads(self, op: Op) -> None:
        self._no_chunk_in_flight(op)
        self._all_backwards_done(op)
        if self.grads_reducing:
            self._add(op, "reduce_grads while an async all-reduce of the gradients is in flight")
        if self.grads != "empty":
            self.grads = "reduced"

    def _start_allreduce(self, op: Op) -> None:
        if op.target == "chunk":
            missing = [m for m in self.items if m[0] == op.chunk and m not in self.bwd]
            if missing:
                self._add(
                    op,
                    f"start_allreduce(chunk {op.chunk}) before all of its backwards "
                    f"({', '.join(_name(*m) for m in missing)} not yet backwarded)",
                )
            if op.chunk in self.chunks_reducing or self.grads_reducing:
                self._add(op, f"start_allreduce(chunk {op.chunk}) while its all-reduce is already in flight")
            self.chunks_reducing.add(op.chunk)
        elif op.target == "grads":
            self._all_backwards_done(op)
            if self.grads_reducing:
                self._add(op, "start_allreduce(grads) while the previous one is still in flight")
            self.grads_reducing = True
        elif op.target == "buffer":
            self._report(op, self.buffer.start()[1])

    def _wait_allreduce(self, op: Op) -> None:
        if op.target == "grads":
            if not self.grads_reducing:
                self._add(
                    op,
                    "wait_allreduce(grads) with no all-reduce of the gradients in flight"
                    + (" (start_allreduce(grads) takes the rest after the chunks')" if self.chunks_reducing else ""),
                )
            elif self.grads == "accumulating":
                self.grads = "reduced"
            self.grads_reducing = False
            self.chunks_reducing = set()
        elif op.target == "buffer":
            self._report(op, self.buffer.wait()[1])

    def _update(self, op: Op) -> None:
        """optimizer_step / stage_optimizer_step: applies the reduced gradients."""
        self._all_backwards_done(op)
        if self.grads_reducing or self.chunks_reducing:
            self._add(
                op,
                f"{op.kind.value} before the gradients it applies are reduced "
                "(their all-reduce is still in flight: wait_allreduce(grads) comes later)",
            )
        elif self.grads != "reduced":
            self._add(op, f"{op.kind.value} before the gradients it applies are reduced (gradients {self.grads})")
        self.grads = "empty"
        self.weights_changed = self.weights_changed or op

    def _copy_to_buffer(self, op: Op) -> None:
        self._no_chunk_in_flight(op)
        self._all_backwards_done(op)
        if self.grads_reducing:
            self._add(op, "copy_grads_to_buffer while the gradients' all-reduce is in flight")
        self._report(op, self.buffer.copy())
        self.grads = "empty"

    def _apply_buffered_update(self, op: Op) -> None:
        if self.buffer.pending:  # empty: the first step, the update is skipped
            self.weights_changed = self.weights_changed or op
        self._report(op, self.buffer.apply()[1])

    def _end_of_iteration(self) -> None:
        s = self.s
        if self.update is None:
            self.problems.append(
                Problem(
                    s,
                    None,
                    None,
                    f"stage {s} never applies or buffers its gradients "
                    "(no optimizer_step, stage_optimizer_step or "
                    "copy_grads_to_buffer)",
                )
            )
        elif self.grads != "empty":
            self.problems.append(
                Problem(
                    s,
                    None,
                    None,
                    f"gradients {self.grads} after this iteration's "
                    f"{self.update.kind.value}: never applied or buffered",
                )
            )
        if self.grads_reducing or self.chunks_reducing:
            self.problems.append(
                Problem(
                    s,
                    None,
                    None,
                    "all-reduce of the gradients still in flight at the end of "
                    "the iteration (no wait_allreduce(grads))",
                )
            )
        if self.buffer.state == REDUCED:
            self.problems.append(
                Problem(s, None, None, "gradient buffer all-reduced but never applied (apply_buffered_update missing)")
            )

    def _check_slots(self) -> None:
        check_slots(
            [((op.chunk, op.micro_batch), op) for op in self.ops], self.num_buffers, self._add, lambda key: _name(*key)
        )


def check_single_grad_slot(compiled: CompiledSchedule, stage: int) -> None:
    """DeepSpeed receives gradients into one reused tensor (``grad_layer``; one per model chunk
    with virtual stages, adapter/engine/p2p.py): a stage must run a chunk's micro-batch's backward before
    it receives that chunk's next gradient. Not a rule of the language (any order is a schedule):
    the start-up refuses, for the engine, what breaks the slot (hippie_ds/adapter/startup/checks.py)."""
    holding: dict[int, int] = {}  # chunk -> the micro-batch whose received gradient it holds
    for op in compiled.ops(stage):
        if op.kind in RECV_GRAD_KINDS:
            if op.chunk in holding:
                raise ValueError(
                    f"schedule {compiled.name!r} stage {stage} step {op.step}: receives the gradient of "
                    f"micro-batch {op.micro_batch} before the backward of micro-batch "
                    f"{holding[op.chunk]}; hippie-ds receives a gradient in the step of its backward"
                )
            holding[op.chunk] = op.micro_batch
        elif op.kind in GRAD_RECEIVING_KINDS and holding.get(op.chunk) == op.micro_batch:
            del holding[op.chunk]
