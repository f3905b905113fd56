"""The validator's per-stage analysis of continuous schedules (2bw, pipedream): one stage over a
whole scenario of calls and drains. Pure Python."""

from __future__ import annotations

from typing import Mapping

from .check_common import Problem, check_slots, problem, scenario_ops
from .ir import CompiledSchedule, Op, weight_version


class ContinuousStageChecker:
    """Data flow, buffer slots, gradients and weight versions of one stage of a continuous
    schedule over a scenario. Micro-batches are (batch, mb) pairs; every batch a call starts
    must be completed, at the latest by the drain. Weight versions: a stage's version counts its
    updates; an op of batch b declaring version d uses b * updates_per_batch + d (below 0: the
    initial weights, i.e. version 0). A compute op must find its version current or stashed;
    a backward must use its forward's version; stash_weights keeps the current version;
    free_weights drops a stashed one, after which no op may use it. ``rules`` is
    ``op_rules.RULES``, whose ``continuous`` entry of each kind lists functions below (handed in,
    not imported: the table refers to this class)."""

    def __init__(self, compiled: CompiledSchedule, stage: int, scenario, rules: Mapping):
        self.rules = rules
        self.c = compiled
        self.s = stage
        self.K = compiled.stages
        self.M = compiled.micro_batches
        self.U = compiled.updates_per_batch[stage] if compiled.updates_per_batch else 0
        self.seq = scenario_ops(compiled, stage, scenario)
        self.scenario = scenario
        self.problems: list[Problem] = []
        self.peak_versions = 1
        # data flow, per (batch, mb)
        self.loaded, self.recv_act, self.recv_grad, self.bwd = set(), set(), set(), set()
        self.fwd: dict[tuple, int | None] = {}  # -> the weight version its forward used
        self.last_load = None
        self.started: set[int] = set()  # batches with at least one op
        # gradients and weight versions
        self.grads: set = set()  # (batch, mb) accumulated since the last update
        self.reducing = False
        self.count = 0  # updates so far: the current version
        self.stashed: set[int] = set()
        self.freed: dict[int, Op] = {}
        self.version: int | None = None  # the weight version of the compute op being checked

    def _add(self, op: Op, reason: str) -> None:
        self.problems.append(problem(op, reason, stage=self.s))

    def _phase(self, phase: int) -> str:
        kind, t = self.scenario[phase]
        return f"train_batch call {t + 1}" if kind == "call" else f"the drain after call {t}"

    def run(self) -> list[Problem]:
        self._check_slots()
        for _, batch, op in self.seq:
            if op.micro_batch is not None:
                if not 0 <= op.micro_batch < self.M:
                    self._add(op, f"micro-batch {op.micro_batch} outside 0..{self.M - 1}")
                    continue
                self.started.add(batch)
            for rule in self.rules[op.kind].continuous:
                rule(self, op, batch)
            self.peak_versions = max(self.peak_versions, len(self.stashed - {self.count}) + 1)
        self._finish()
        return self.problems

    # -- the functions per op kind (op_rules.RULES[kind].continuous) --
    def _load(self, op: Op, batch: int) -> None:
        key = (batch, op.micro_batch)
        if key in self.loaded:
            self._add(op, f"micro-batch {op.micro_batch} of batch {batch} loaded twice")
        if self.last_load is not None and key < self.last_load:
            self._add(
                op,
                f"loads micro-batch {op.micro_batch} of batch {batch} after micro-batch "
                f"{self.last_load[1]} of batch {self.last_load[0]}: the data iterator is read out of "
                "order",
            )
        self.loaded.add(key)
        self.last_load = key

    def _recv_activation(self, op: Op, batch: int) -> None:
        self.recv_act.add((batch, op.micro_batch))

    def _recv_grad(self, op: Op, batch: int) -> None:
        self.recv_grad.add((batch, op.micro_batch))

    def _send_activation(self, op: Op, batch: int) -> None:
        if (batch, op.micro_batch) not in self.fwd:
            self._add(op, f"sends micro-batch {op.micro_batch}'s activation before its forward")

    def _send_grad(self, op: Op, batch: int) -> None:
        if (batch, op.micro_batch) not in self.bwd:
            self._add(op, f"sends micro-batch {op.micro_batch}'s gradient before its backward")

    def _version_used(self, op: Op, batch: int) -> int | None:
        """The absolute weight version a compute op uses, checked to be current or stashed."""
        if op.version is None:
            return None
        version = weight_version(batch, self.U, op.version)
        if version > self.count:
            self._add(
                op,
                f"uses weight version {version}, which does not exist yet (the stage has "
                f"applied {self.count} update(s))",
            )
        elif version < self.count and version not in self.stashed:
            if version in self.freed:
                f = self.freed[version]
                self._add(
                    op,
                    f"uses weight version {version}, freed while needed (free_weights at "
                    f"step {f.step}{self._where(f)})",
                )
            else:
                self._add(
                    op,
                    f"uses weight version {version}, which was updated in place and never "
                    "stashed (stash_weights missing before the update)",
                )
        return version

    def _version(self, op: Op, batch: int) -> None:
        """A compute op: the weight version it uses (checked), for the rules after it."""
        self.version = self._version_used(op, batch)

    def _forward(self, op: Op, batch: int) -> None:
        key, mb = (batch, op.micro_batch), op.micro_batch
        if key in self.fwd:
            self._add(op, f"micro-batch {mb} of batch {batch} forwarded twice")
        if self.s > 0 and key not in self.recv_act:
            self._add(op, f"forward of micro-batch {mb} before its activation is received (recv_activation)")
        if self.s in (0, self.K - 1) and key not in self.loaded:
            what = "inputs" if self.s == 0 else "labels"
            self._add(op, f"forward of micro-batch {mb} before its {what} are loaded (load_micro_batch)")
        self.fwd[key] = self.version

    def _backward(self, op: Op, batch: int) -> None:
        """backward / forward_backward (whose own forward ran just before, on the same version)."""
        key, mb, version = (batch, op.micro_batch), op.micro_batch, self.version
        if key not in self.fwd:
            self._add(op, f"backward of micro-batch {mb} before its forward")
        elif self.fwd[key] != version:
            self._add(
                op,
                f"backward of micro-batch {mb} of batch {batch} uses weight version "
                f"{version}, its forward used {self.fwd[key]}",
            )
        if key in self.bwd:
            self._add(op, f"micro-batch {mb} of batch {batch} backwarded twice")
        if self.s < self.K - 1 and key not in self.recv_grad:
            self._add(op, f"backward of micro-batch {mb} before its output gradient is received (recv_grad)")
        if self.reducing:
            self._add(op, "backward while the gradients' all-reduce is in flight")
        self.bwd.add(key)
        self.grads.add(key)

    def _stash_weights(self, op: Op, batch: int) -> None:
        version = weight_version(batch, self.U, op.version)
        if version != self.count:
            self._add(op, f"stash_weights of version {version}, but the current version is {self.count}")
        self.stashed.add(version)
        self.freed.pop(version, None)

    def _free_weights(self, op: Op, batch: int) -> None:
        version = weight_version(batch, self.U, op.version, clamp=False)
        if version >= 0:  # below 0: the initial weights, freed as version 0
            if version not in self.stashed:
                self._add(op, f"free_weights of version {version}, which is not stashed")
            self.stashed.discard(version)
            self.freed[version] = op

    def _start_allreduce(self, op: Op, batch: int) -> None:
        if op.target != "grads":
            self._add(op, "only target grads is supported in continuous schedules")
        if self.reducing:
            self._add(op, "start_allreduce(grads) while the previous one is still in flight")
        self.reducing = True

    def _wait_allreduce(self, op: Op, batch: int) -> None:
        if not self.reducing:
            self._add(op, "wait_allreduce(grads) with no all-reduce of the gradients in flight")
        self.reducing = False

    def _update(self, op: Op, batch: int) -> None:
        """An update (a new weight version): applies the gradients of its batch, reduced."""
        kind = op.kind
        if self.reducing:
            self._add(
                op, f"{kind.value} before the gradients it applies are reduced (their all-reduce is still in flight)"
            )
        if not self.grads:
            self._add(op, f"{kind.value} of batch {batch} with no gradients accumulated since the last update")
        other = sorted({b for b, _ in self.grads if b != batch})
        if other:
            self._add(
                op, f"{kind.value} of batch {batch} applies gradients of batch(es) {', '.join(map(str, other))} too"
            )
        self.grads = set()
        self.count += 1

    def _finish(self) -> None:
        s = self.s
        for b in sorted(self.started):
            for m in range(self.M):
                if (b, m) not in self.fwd:
                    self.problems.append(Problem(s, None, None, f"micro-batch {m} of batch {b} is never forwarded"))
                elif (b, m) not in self.bwd:
                    self.problems.append(
                        Problem(
                            s,
                            None,
                            None,
                            f"micro-batch {m} of batch {b} is never backwarded (lost: not completed by the drain)",
                        )
                    )
        if self.grads:
            self.problems.append(
                Problem(
                    s,
                    None,
                    None,
                    f"gradients of {len(self.grads)} micro-batch(es) never applied (no update after their backward)",
                )
            )
        if self.reducing:
            self.problems.append(Problem(s, None, None, "all-reduce of the gradients still in flight at the end"))

    def _where(self, op: Op) -> str:
        for phase, _, o in self.seq:
            if o is op:
                return f" of {self._phase(phase)}"
        return ""

    def _check_slots(self) -> None:
        check_slots(
            [((batch, op.micro_batch), op) for _, batch, op in self.seq],
            self.c.num_buffers[self.s],
            self._add,
            lambda key: f"micro-batch {key[1]} of batch {key[0]}",
        )
