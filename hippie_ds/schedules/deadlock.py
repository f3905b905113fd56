"""The validator's communication analysis: every stage's stream run together, p2p modelled as the
engine runs it (blocking sends are rendezvous, non-blocking ones queue until WAIT_SENDS, FIFO
channels, pipeline collectives matched by count), to find deadlocks and mis-matched messages.
Pure Python."""

from __future__ import annotations

from collections import deque
from typing import Mapping

from .ir import OP_INFO, CompiledSchedule, Op, OpKind
from .check_common import Problem, problem, scenario_ops, short


def link_of(compiled: CompiledSchedule, src: int, dst: int, kind: OpKind) -> tuple:
    """The FIFO channel a message between two stages takes. DeepSpeed's engine sends everything
    on one (process group, tag); with virtual stages the engine tags activations and gradients
    apart (a stage pair's link may carry both in each direction, in different orders)."""
    if compiled.virtual_stages == 1:
        return (src, dst)
    return (src, dst, OP_INFO[kind].carries)  # "activation" | "gradient"


def peer_of(layout, op: Op) -> tuple[int, int] | None:
    """(stage, chunk) at the other end of a send or receive (its OP_INFO direction along the model:
    +1 to the next model part; the layout says which stage and chunk hold it); None past the model's ends."""
    return (layout.next if OP_INFO[op.kind].direction > 0 else layout.prev)(op.stage, op.chunk)


# ---------------------------------------------------------------------------------------------
# Communication: all stages together


class _Message:
    __slots__ = ("op", "iteration", "received", "batch")

    def __init__(self, op: Op, iteration: int, batch: int | None = None):
        self.op = op
        self.iteration = iteration  # the train_batch call (or drain) it was sent in
        self.batch = iteration if batch is None else batch  # the batch it belongs to
        self.received = False


class _Simulation:
    """Runs the K streams round-robin, each as far as it can go, until all finish or none can
    move. Only p2p, WAIT_SENDS and pipeline collectives can block; every other op is local.
    ``rules`` is ``op_rules.RULES``, whose ``communicate`` entry of each kind pairs a function
    below with its reports (handed in, not imported: the table refers to this class)."""

    def __init__(self, compiled: CompiledSchedule, iterations: int, rules: Mapping, scenario=None):
        self.rules = rules
        self.K = compiled.stages
        self.compiled = compiled
        self.layout = compiled.layout
        self.iterations = iterations
        # stage -> [(iteration, op)] in execution order; continuous schedules: (phase, op), and
        # the batch of each op in self.batches
        if scenario is None:
            self.flat = [[(i, op) for i in range(iterations) for op in compiled.ops(s)] for s in range(self.K)]
            self.batches = [[i for i, _ in flat] for flat in self.flat]
        else:
            seq = [scenario_ops(compiled, s, scenario) for s in range(self.K)]
            self.flat = [[(phase, op) for phase, _, op in ops] for ops in seq]
            self.batches = [[b for _, b, _ in ops] for ops in seq]
        self.pc = [0] * self.K
        self.channels: dict[tuple[int, int], deque[_Message]] = {}
        self.blocked_send: list[_Message | None] = [None] * self.K  # blocking send issued, not yet received
        self.isends: list[list[_Message]] = [[] for _ in range(self.K)]  # non-blocking, not yet waited for
        self.collectives_done = [0] * self.K
        self.arrivals: list[dict[int, Op]] = []  # k-th pipeline collective: stage -> its op
        self.problems: list[Problem] = []

    def run(self) -> list[Problem]:
        progress = True
        while progress:
            progress = False
            for s in range(self.K):
                while self._advance(s):
                    progress = True
        if all(self._finished(s) for s in range(self.K)):
            for channel in self.channels.values():
                for msg in channel:
                    peer = self._peer(msg.op)
                    self.problems.append(
                        problem(msg.op, f"unmatched: {short(msg.op)} to stage {peer} is never received")
                    )
        else:
            for s in range(self.K):
                if not self._finished(s):
                    self.problems.append(self._stuck(s))
        return self.problems

    def _finished(self, s: int) -> bool:
        return self.pc[s] >= len(self.flat[s])

    def _advance(self, s: int) -> bool:
        """Run stage s's next op if it can; True if anything changed."""
        if self._finished(s):
            return False
        iteration, op = self.flat[s][self.pc[s]]
        return self.rules[op.kind].communicate.advance(self, s, iteration, op)

    def _local(self, s: int, iteration: int, op: Op) -> bool:
        """An op that never waits for another stage."""
        self.pc[s] += 1
        return True

    def _wait_sends(self, s: int, iteration: int, op: Op) -> bool:
        self.isends[s] = [m for m in self.isends[s] if not m.received]
        return False if self.isends[s] else self._local(s, iteration, op)

    def _peer(self, op: Op) -> int:
        """The peer stage of a send or receive (-1 or K: none, past the model's ends)."""
        found = peer_of(self.layout, op)
        return found[0] if found else (-1 if OP_INFO[op.kind].direction < 0 else self.K)

    def _send(self, s: int, iteration: int, op: Op) -> bool:
        peer = self._peer(op)
        if not 0 <= peer < self.K:
            self.problems.append(problem(op, f"unmatched: {short(op)} to stage {peer}, which does not exist"))
            self.pc[s] += 1
            return True
        if op.blocking:
            msg = self.blocked_send[s]
            if msg is None:  # issue it; the peer's recv may now complete
                msg = self.blocked_send[s] = _Message(op, iteration, self.batches[s][self.pc[s]])
                self.channels.setdefault(link_of(self.compiled, s, peer, op.kind), deque()).append(msg)
                return True
            if not msg.received:
                return False
            self.blocked_send[s] = None
        else:
            msg = _Message(op, iteration, self.batches[s][self.pc[s]])
            self.channels.setdefault(link_of(self.compiled, s, peer, op.kind), deque()).append(msg)
            self.isends[s].append(msg)
        self.pc[s] += 1
        return True

    def _recv(self, s: int, iteration: int, op: Op) -> bool:
        peer = self._peer(op)
        if not 0 <= peer < self.K:
            self.problems.append(problem(op, f"unmatched: {short(op)} from stage {peer}, which does not exist"))
            self.pc[s] += 1
            return True
        channel = self.channels.get(link_of(self.compiled, peer, s, op.kind))
        if not channel:
            return False
        msg = channel.popleft()
        msg.received = True
        batch = self.batches[s][self.pc[s]]
        # Sends and receives between two stages share one FIFO channel, as in the engine (one
        # process group, one tag): with virtual stages it carries activations and gradients.
        expected_chunk = peer_of(self.layout, op)[1]
        wrong_kind = msg.op.kind != OP_INFO[op.kind].peer or msg.op.chunk != expected_chunk
        if wrong_kind or msg.op.micro_batch != op.micro_batch or msg.iteration != iteration or msg.batch != batch:
            later = (
                ""
                if msg.iteration == iteration
                else f" (sent in train_batch call {msg.iteration + 1}, received in call {iteration + 1})"
            )
            other = "" if msg.batch == batch else f" of batch {msg.batch} (expected batch {batch})"
            what = f"{short(msg.op)}" if wrong_kind else f"mb={msg.op.micro_batch}{other}"
            self.problems.append(
                problem(op, f"mis-ordered: stage {s} {short(op)} received {what} from stage {peer}{later}")
            )
        self.pc[s] += 1
        return True

    def _collective(self, s: int, iteration: int, op: Op) -> bool:
        k = self.collectives_done[s]
        while len(self.arrivals) <= k:
            self.arrivals.append({})
        arrived = self.arrivals[k]
        new = s not in arrived
        arrived[s] = op
        if len(arrived) < self.K:
            return new
        if s == 0:  # every stage has arrived: check the kinds once, against stage 0's
            first = arrived[0]
            for other, other_op in sorted(arrived.items()):
                if other_op.kind != first.kind:
                    self.problems.append(
                        problem(
                            other_op,
                            f"pipeline collective #{k + 1} mismatched: stage {other} "
                            f"runs {other_op.kind.value} while stage {s} runs "
                            f"{first.kind.value}",
                        )
                    )
        self.collectives_done[s] += 1
        self.pc[s] += 1
        return True

    # -- reporting a stuck pipeline --

    def _at(self, s: int) -> str:
        """Where stage s is, for a reason naming it as a peer."""
        if self._finished(s):
            return f"stage {s} has finished its stream"
        iteration, op = self.flat[s][self.pc[s]]
        return f"stage {s} is blocked at step {op.step}{self._call(iteration)} on {self._doing(s, op)}"

    def _call(self, iteration: int) -> str:
        return f" of train_batch call {iteration + 1}" if iteration else ""

    def _doing(self, s: int, op: Op) -> str:
        """What stage s's op waits on, as a peer's report names it (its rule's ``waiting_on``)."""
        waiting_on = self.rules[op.kind].communicate.waiting_on
        return waiting_on(self, s, op) if waiting_on else short(op)

    def _stuck(self, s: int) -> Problem:
        """Why stage s cannot move: the ``stuck`` report its op's communication rule pairs with it
        (an op that never waits has none, and a stage is never stuck at one)."""
        iteration, op = self.flat[s][self.pc[s]]
        reason = self.rules[op.kind].communicate.stuck(self, s, op)
        return problem(op, reason + (f" (in train_batch call {iteration + 1})" if self._call(iteration) else ""))

    def _send_waiting_on(self, s: int, op: Op) -> str:
        return f"{short(op)} to stage {self._peer(op)}"

    def _recv_waiting_on(self, s: int, op: Op) -> str:
        return f"{short(op)} from stage {self._peer(op)}"

    def _collective_waiting_on(self, s: int, op: Op) -> str:
        return f"{op.kind.value} (pipeline collective #{self.collectives_done[s] + 1})"

    def _send_stuck(self, s: int, op: Op) -> str:
        peer = self._peer(op)
        if self._finished(peer):
            return f"unmatched: blocking {short(op)} to stage {peer} is never received ({self._at(peer)})"
        return (
            f"deadlock: blocking {short(op)} to stage {peer} waits for a matching "
            f"{OP_INFO[op.kind].peer.value}, but {self._at(peer)}"
        )

    def _recv_stuck(self, s: int, op: Op) -> str:
        peer = self._peer(op)
        if self._finished(peer):
            return f"unmatched: {short(op)} from stage {peer} is never sent ({self._at(peer)})"
        return (
            f"deadlock: {short(op)} waits for a {OP_INFO[op.kind].peer.value} from stage {peer}, but {self._at(peer)}"
        )

    def _wait_sends_stuck(self, s: int, op: Op) -> str:
        peers = [self._peer(m.op) for m in self.isends[s]]
        waits = "; ".join(f"{short(m.op)} to stage {p} ({self._at(p)})" for m, p in zip(self.isends[s], peers))
        if all(self._finished(p) for p in peers):
            return f"unmatched: wait_sends waits for sends that are never received: {waits}"
        return f"deadlock: wait_sends waits for sends to be received: {waits}"

    def _collective_stuck(self, s: int, op: Op) -> str:
        k = self.collectives_done[s]
        missing = [p for p in range(self.K) if p not in self.arrivals[k]]
        return f"deadlock: {op.kind.value} is pipeline collective #{k + 1} and waits for every stage, but " + "; ".join(
            self._at(p) for p in missing
        )
