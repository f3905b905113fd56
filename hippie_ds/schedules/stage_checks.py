"""The validator's per-stage analysis of flush schedules: data flow (every micro-batch loaded /
received / computed / sent in a valid order, a split backward's W after its B), pipeline buffer
slots and the gradient state machine. Continuous schedules: :mod:`.continuous_checks`. Pure Python."""
from __future__ import annotations

from .ir import (BUFFER_KINDS, GRADIENT_CONSUMER_KINDS, INPUT_GRAD_KINDS, WEIGHT_GRAD_KINDS, CompiledSchedule, Op,
                 OpKind)
from .check_common import Problem, check_slots, problem
from .grad_buffer import REDUCED, GradBuffer

_FORWARD_LIKE = frozenset({OpKind.FORWARD, OpKind.FORWARD_BACKWARD})
_MB_KINDS = BUFFER_KINDS  # ops that concern one micro-batch

# ---------------------------------------------------------------------------------------------
# Data flow, buffer slots and gradients: one stage at a time

def _name(chunk: int, mb) -> str:
    """A chunk's micro-batch in messages: 'micro-batch 3', 'micro-batch 3 of chunk 1'."""
    return f"micro-batch {mb}" + (f" of chunk {chunk}" if chunk else "")


class _StageChecker:
    """One stage's stream, run ``iterations`` times. Gradient and gradient-buffer state carry
    over between iterations; everything about micro-batches is per iteration."""

    def __init__(self, compiled: CompiledSchedule, stage: int):
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
        s, K, M = self.s, self.K, self.M
        loaded, recv_act, recv_grad, fwd, bwd = set(), set(), set(), set(), set()
        self.bwd = bwd  # micro-batches whose parameter gradients are accumulated
        self.igrad: set[int] = set()  # micro-batches whose input gradient is computed
        self.update: Op | None = None  # this iteration's optimizer step / copy
        self.weights_changed: Op | None = None  # an update that changed this stage's weights
        for op in self.ops:
            kind, mb = op.kind, op.micro_batch
            if kind in _MB_KINDS and mb is not None and not 0 <= mb < M:
                self._add(op, f"micro-batch {mb} outside 0..{M - 1}")
                continue
            first, last = self.layout.is_first(s, op.chunk), self.layout.is_last(s, op.chunk)
            item = _name(op.chunk, mb)
            mb = (op.chunk, mb)  # a chunk's micro-batch: what the stage computes
            if kind == OpKind.LOAD:
                # a stage holding the first and the last part (the V) loads inputs and labels
                # apart; the engine reads the data iterator once per micro-batch
                role = (first, last, mb[1])
                if role in loaded:
                    self._add(op, f"micro-batch {mb[1]} loaded twice (the data iterator advances on each load)")
                loaded.add(role)
            elif kind == OpKind.RECV_ACTIVATION:
                recv_act.add(mb)
            elif kind == OpKind.RECV_GRAD:
                recv_grad.add(mb)
            elif kind == OpKind.SEND_ACTIVATION and mb not in fwd:
                self._add(op, f"sends {item}'s activation before its forward")
            elif kind == OpKind.SEND_GRAD and mb not in self.igrad:
                self._add(op, f"sends {item}'s gradient before its backward")
            if kind in _FORWARD_LIKE:
                if mb in fwd:
                    self._add(op, f"{item} forwarded twice")
                if not first and mb not in recv_act:
                    self._add(op, f"forward of {item} before its activation is received (recv_activation)")
                if (first or last) and (first, last, mb[1]) not in loaded:
                    what = "inputs" if first else "labels"
                    self._add(op, f"forward of {item} before its {what} are loaded (load_micro_batch)")
                if self.weights_changed is not None and kind == OpKind.FORWARD:
                    self._add(op, f"forward after this iteration's {self.weights_changed.kind.value} at step "
                                  f"{self.weights_changed.step}: runs on weights already updated")
                fwd.add(mb)
            if kind in INPUT_GRAD_KINDS:
                self._input_grad(op, fwd, recv_grad)
            if kind in WEIGHT_GRAD_KINDS:
                self._weight_grad(op)
            elif kind not in _MB_KINDS:
                self._gradient_op(op)
        for mb in self.items:
            if mb not in fwd:
                self.problems.append(Problem(s, None, None, f"{_name(*mb)} is never forwarded"))
            if mb in self.igrad and mb not in bwd:
                self.problems.append(Problem(s, None, None, f"{_name(*mb)}'s backward_weight is missing (its "
                                                            "backward_input ran: parameter gradients never computed)"))
            elif mb not in bwd:
                self.problems.append(Problem(s, None, None, f"{_name(*mb)} is never backwarded"))
        self._end_of_iteration()

    def _input_grad(self, op: Op, fwd: set, recv_grad: set) -> None:
        """backward / forward_backward / backward_input: the gradient of the stage's input."""
        mb, name = (op.chunk, op.micro_batch), "backward" if op.kind == OpKind.BACKWARD else op.kind.value
        item = _name(*mb)
        if op.kind != OpKind.FORWARD_BACKWARD and mb not in fwd:
            self._add(op, f"{name} of {item} before its forward")
        if mb in self.igrad:
            self._add(op, f"{item} backwarded twice")
        if not self.layout.is_last(self.s, op.chunk) and mb not in recv_grad:
            self._add(op, f"{name} of {item} before its output gradient is received (recv_grad)")
        self._check_weights_unchanged(op, "backward")
        self.igrad.add(mb)

    def _weight_grad(self, op: Op) -> None:
        """backward / forward_backward / backward_weight: the parameter gradients, accumulated."""
        mb = (op.chunk, op.micro_batch)
        if op.kind == OpKind.BACKWARD_WEIGHT:
            if mb not in self.igrad:
                self._add(op, f"backward_weight of {_name(*mb)} before its backward_input")
            elif mb in self.bwd:
                self._add(op, f"backward_weight of {_name(*mb)} twice")
            self._check_weights_unchanged(op, "backward_weight")
        if self.grads_reducing or op.chunk in self.chunks_reducing:
            self._add(op, f"{'backward' if op.kind == OpKind.BACKWARD else op.kind.value} while the gradients' "
                          "all-reduce is in flight")
        self.bwd.add(mb)
        self.grads = "accumulating"

    def _check_weights_unchanged(self, op: Op, name: str) -> None:
        if self.update is not None:
            self._add(op, f"{name} after this iteration's {self.update.kind.value} at step {self.update.step}: "
                          "its gradient is lost or applied in the wrong step")
        elif self.weights_changed is not None:
            self._add(op, f"{name} after this iteration's {self.weights_changed.kind.value} at step "
                          f"{self.weights_changed.step}: weights changed between forward and backward")

    def _report(self, op: Op, error: str | None) -> None:
        if error is not None:
            self._add(op, error)

    def _all_backwards_done(self, op: Op) -> bool:
        missing = [m for m in self.items if m not in self.bwd]
        if missing:
            self._add(op, f"{op.kind.value} before all {len(self.items)} backwards of this iteration "
                          f"({', '.join(_name(*m) for m in missing)} not yet backwarded)")
        return not missing

    def _gradient_op(self, op: Op) -> None:
        kind = op.kind
        if kind in GRADIENT_CONSUMER_KINDS:
            if self.update is not None:
                self._add(op, f"second update in one iteration (already {self.update.kind.value} at step "
                              f"{self.update.step}); a stage applies or buffers its gradients exactly once")
            self.update = self.update or op
        if kind in (OpKind.REDUCE_GRADS, OpKind.COPY_GRADS_TO_BUFFER) and self.chunks_reducing:
            self._add(op, f"{kind.value} while chunk {min(self.chunks_reducing)}'s all-reduce is in flight "
                          "(start_allreduce(chunk) is for stages that update in-step: wait_allreduce(grads) first)")
        if kind == OpKind.REDUCE_GRADS:
            self._all_backwards_done(op)
            if self.grads_reducing:
                self._add(op, "reduce_grads while an async all-reduce of the gradients is in flight")
            if self.grads != "empty":
                self.grads = "reduced"
        elif kind == OpKind.START_ALLREDUCE and op.target == "chunk":
            missing = [m for m in self.items if m[0] == op.chunk and m not in self.bwd]
            if missing:
                self._add(op, f"start_allreduce(chunk {op.chunk}) before all of its backwards "
                              f"({', '.join(_name(*m) for m in missing)} not yet backwarded)")
            if op.chunk in self.chunks_reducing or self.grads_reducing:
                self._add(op, f"start_allreduce(chunk {op.chunk}) while its all-reduce is already in flight")
            self.chunks_reducing.add(op.chunk)
        elif kind == OpKind.START_ALLREDUCE and op.target == "grads":
            self._all_backwards_done(op)
            if self.grads_reducing:
                self._add(op, "start_allreduce(grads) while the previous one is still in flight")
            self.grads_reducing = True
        elif kind == OpKind.WAIT_ALLREDUCE and op.target == "grads":
            if not self.grads_reducing:
                self._add(op, "wait_allreduce(grads) with no all-reduce of the gradients in flight"
                              + (" (start_allreduce(grads) takes the rest after the chunks')" if self.chunks_reducing
                                 else ""))
            elif self.grads == "accumulating":
                self.grads = "reduced"
            self.grads_reducing = False
            self.chunks_reducing = set()
        elif kind in (OpKind.OPTIMIZER_STEP, OpKind.STAGE_OPTIMIZER_STEP):
            self._all_backwards_done(op)
            if self.grads_reducing or self.chunks_reducing:
                self._add(op, f"{kind.value} before the gradients it applies are reduced "
                              "(their all-reduce is still in flight: wait_allreduce(grads) comes later)")
            elif self.grads != "reduced":
                self._add(op, f"{kind.value} before the gradients it applies are reduced (gradients {self.grads})")
            self.grads = "empty"
            self.weights_changed = self.weights_changed or op
        elif kind == OpKind.COPY_GRADS_TO_BUFFER:
            self._all_backwards_done(op)
            if self.grads_reducing:
                self._add(op, "copy_grads_to_buffer while the gradients' all-reduce is in flight")
            self._report(op, self.buffer.copy())
            self.grads = "empty"
        elif kind == OpKind.START_ALLREDUCE and op.target == "buffer":
            self._report(op, self.buffer.start()[1])
        elif kind == OpKind.WAIT_ALLREDUCE and op.target == "buffer":
            self._report(op, self.buffer.wait()[1])
        elif kind == OpKind.APPLY_BUFFERED_UPDATE:
            if self.buffer.pending:  # empty: the first step, the update is skipped
                self.weights_changed = self.weights_changed or op
            self._report(op, self.buffer.apply()[1])

    def _end_of_iteration(self) -> None:
        s = self.s
        if self.update is None:
            self.problems.append(Problem(s, None, None, f"stage {s} never applies or buffers its gradients "
                                                        "(no optimizer_step, stage_optimizer_step or "
                                                        "copy_grads_to_buffer)"))
        elif self.grads != "empty":
            self.problems.append(Problem(s, None, None, f"gradients {self.grads} after this iteration's "
                                                        f"{self.update.kind.value}: never applied or buffered"))
        if self.grads_reducing or self.chunks_reducing:
            self.problems.append(Problem(s, None, None, "all-reduce of the gradients still in flight at the end of "
                                                        "the iteration (no wait_allreduce(grads))"))
        if self.buffer.state == REDUCED:
            self.problems.append(Problem(s, None, None, "gradient buffer all-reduced but never applied "
                                                        "(apply_buffered_update missing)"))

    def _check_slots(self) -> None:
        check_slots([((op.chunk, op.micro_batch), op) for op in self.ops], self.num_buffers, self._add,
                    lambda key: _name(*key))
