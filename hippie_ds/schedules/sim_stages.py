"""The simulator's stages: every stage's stream, run as a process of the event kernel
(:mod:`.sim_resources`), and one function per op kind, the op's time and its waits, which
``op_rules.RULES[kind].simulate`` names. What the simulation means and the figures it gives:
:mod:`.simulator`. Pure Python."""

from __future__ import annotations

from typing import Iterator, Mapping

from .costs import Costs, DelayedPart
from .sim_results import SimEvent
from .sim_resources import SimulationError, _Acc, _AllReduce, _Channel, _Kernel, _Link, _Signal, _StageState, _Transfer
from .deadlock import link_of, peer_of
from .ir import (
    ALLREDUCE_TARGETS,
    CATEGORY,
    OP_INFO,
    WHOLE_BACKWARD_KINDS,
    weight_version,
    CompiledSchedule,
    Op,
    OpKind,
    op_name,
)


class _Sim:
    """Every stage's stream for ``iterations`` calls under ``costs``; ``rules`` is
    ``op_rules.RULES``, whose ``simulate`` entry of each kind is one of the functions below
    (handed in, not imported: the table refers to this class)."""

    def __init__(
        self,
        compiled: CompiledSchedule,
        costs: Costs,
        iterations: int,
        delayed: Mapping[int, DelayedPart],
        rules: Mapping,
    ) -> None:
        self.c, self.costs, self.iterations, self.rules = compiled, costs, iterations, rules
        # the share of each stage's gradient that the 'grads' and 'buffer' all-reduces carry
        deferred = set(compiled.deferred_stages())
        self.share = {
            (s, t): (1.0 if s not in deferred else (f if t == "buffer" else 1.0 - f))
            for s in range(compiled.stages)
            for f in [delayed[s].fraction if s in delayed else 1.0]
            for t in ALLREDUCE_TARGETS
        }
        # partial deferral: how long before its last whole backward of a call ends a stage starts
        # its 'grads' all-reduce (only when part of the gradient is delayed, as the engine does:
        # its hooks start it inside that backward, ahead of any WAIT_SENDS the stream declares
        # after it)
        self.lead = {s: p.lead for s, p in delayed.items() if s in deferred and 0 < p.fraction < 1}
        self.K = compiled.stages
        self.k = _Kernel()
        self.link = _Link(self.k, costs.comm.shared_link)
        self.layout = compiled.layout
        self.v = compiled.virtual_stages  # a chunk op takes 1/v of its stage's costs
        self.channels: dict[tuple[int, int], _Channel] = {}  # (from, to) stage: one FIFO link, as in the engine
        self.collectives: dict[tuple, list] = {}  # (kind, k) -> [arrived, signal]
        self.last_done = [_Signal() for _ in range(iterations)]  # last stage finished call i
        self.events: list[SimEvent] = []
        self.isend_events: list[tuple[int, Op, float, _Transfer]] = []
        self.allreduces: list[_AllReduce] = []
        self.acc = [[_Acc() for _ in range(iterations)] for _ in range(self.K)]
        self.starts = [[] for _ in range(self.K)]
        self.ends = [[] for _ in range(self.K)]
        self.where: list[str | None] = ["not started"] * self.K  # for deadlock reports
        self.uses_buffer = [False] * self.K
        # Continuous schedules: call i skips the ops of batches before the first (pipeline fill).
        self.ops = [
            [list(compiled.call_ops(s, i)) if compiled.continuous else list(compiled.ops(s)) for i in range(iterations)]
            for s in range(self.K)
        ]
        self.updates = [compiled.updates_per_batch[s] if compiled.updates_per_batch else 0 for s in range(self.K)]
        self.last_whole_backward = {
            (s, i): [op for op in self.ops[s][i] if op.kind in WHOLE_BACKWARD_KINDS][-1]
            for s in self.lead
            for i in range(iterations)
            if any(op.kind in WHOLE_BACKWARD_KINDS for op in self.ops[s][i])
        }

    # -- one stage -------------------------------------------------------------------------
    def stage(self, s: int) -> Iterator:
        st = _StageState()
        for it in range(self.iterations):
            self.starts[s].append(self.k.now)
            for op in self.ops[s][it]:
                self.where[s] = f"call {it}, step {op.step}: {op}"
                yield from self._exec(s, it, op, st)
            if s != self.K - 1:
                # DeepSpeed broadcasts the loss from the last stage at the end of train_batch.
                t0 = self.k.now
                self.where[s] = f"call {it}: end-of-call loss broadcast from stage {self.K - 1}"
                yield self.last_done[it]
                self.acc[s][it].sync += self.k.now - t0
                self.events.append(SimEvent(s, "loss_broadcast", "sync", t0, self.k.now, None))
            else:
                self.events.append(SimEvent(s, "loss_broadcast", "sync", self.k.now, self.k.now, None))
                self.k.fire(self.last_done[it])
            self.ends[s].append(self.k.now)
        self.where[s] = None

    def _cost(self, s: int, kind: OpKind) -> float:
        """The op's time: the sum of its ``OP_INFO`` cost terms of the stage's costs (a micro-batch
        op: one chunk's, 1/v; a re-entrant checkpoint re-computes when its backward starts)."""
        info = OP_INFO[kind]
        total = sum(getattr(self.costs.stages[s], term) for term in info.cost)
        return total / self.v if info.micro_batch else total

    def _channel(self, op: Op) -> tuple[_Channel, str, tuple]:
        """The link a send or receive uses, its side, and the message it carries: (activation or
        gradient, the model-part boundary it crosses, micro-batch)."""
        s, kind, info = op.stage, op.kind, OP_INFO[op.kind]
        peer = peer_of(self.layout, op)
        if peer is None:
            raise SimulationError(f"stage {s}: {kind.value} has no neighbour to talk to")
        part = self.layout.part(s, op.chunk)
        boundary = part if info.direction > 0 else part - 1  # towards the next model part, or back
        side = info.role  # "send" | "recv"
        src, dst = (s, peer[0]) if side == "send" else (peer[0], s)
        link = link_of(self.c, src, dst, kind)
        activation = info.carries == "activation"
        if link not in self.channels:
            # the activation crossing it is the sending side's output (its gradient the same size);
            # a hand-over between two chunks of one stage (the V's turn) is local: no time
            out = src if activation else dst
            self.channels[link] = _Channel(
                self.k, f"stage {src}->{dst}", 0.0 if src == dst else self.costs.p2p_time(out)
            )
        message = op.micro_batch if self.v == 1 else ("A" if activation else "G", boundary, op.micro_batch)
        return self.channels[link], side, message

    def _issue_allreduce(self, s: int, target: str, st: "_StageState") -> Iterator:
        """START_ALLREDUCE: starts it and holds the stage while it issues it."""
        cost, share = self.costs.stages[s], self._begin_allreduce(s, target, st)
        hold = cost.allreduce_issue_time + share * cost.allreduce_cpu_time if share else 0.0
        if hold:
            yield hold

    def _begin_allreduce(self, s: int, target: str, st: "_StageState") -> float:
        """Starts stage ``s``'s all-reduce of ``target``; its share of the stage's gradient, 0 when
        nothing starts."""
        if target == "buffer" and not st.buffer.start()[0]:
            return 0.0  # first call: nothing buffered yet
        if target == "chunk":  # one chunk of the stage's gradient, now; the rest later with 'grads'
            share = self.share[s, "grads"] / self.v
            st.chunk_share += share
            target = "grads"
        elif target == "grads":
            share, st.chunk_share = self.share[s, "grads"] - st.chunk_share, 0.0
        else:
            share = self.share[s, target]
        work, latency = self.costs.allreduce_work(s) * share, self.costs.allreduce_latency_total()
        if share <= 0 or (work <= 0 and latency <= 0):
            return 0.0  # data_parallel == 1: no data-parallel peers
        ar = _AllReduce(s, target, work, latency, self.k.now)
        self.allreduces.append(ar)
        st.pending[target].append(ar)
        self.link.start(ar)
        return share

    def _await_allreduce(self, s: int, it: int, target: str, st: "_StageState") -> Iterator:
        for ar in st.pending[target]:
            yield ar.done
            ar.iteration = it
        st.pending[target] = []

    def _exec(self, s: int, it: int, op: Op, st: "_StageState") -> Iterator:
        k, acc, kind = self.k, self.acc[s][it], op.kind
        t0 = k.now
        if (yield from self.rules[kind].simulate(self, s, it, op, st, acc)):
            return  # a non-blocking send: drawn on the comm track once it has completed
        self.events.append(SimEvent(s, op_name(op), CATEGORY[kind], t0, k.now, op.micro_batch))

    # -- the functions per op kind (op_rules.RULES[kind].simulate); each a generator of the stage's
    # waits, a non-blocking send's returning True (drawn on the comm track once it has completed)
    def _no_time(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        """An op whose time is not modelled (a load): it takes no simulated time."""
        yield from ()

    def _compute(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        """Forward, backward, fused and split: the op's cost; a micro-batch's activations are held
        from its forward's start until its parameter gradients are computed (OP_INFO's flags)."""
        k, t0, info = self.k, self.k.now, OP_INFO[op.kind]
        acc.versions = max(acc.versions, len(st.stashed) + 1)
        if info.forward:  # its activations are held from the forward's start ...
            st.live += 1  # with v chunks per stage, one chunk's micro-batch: 1/v of the stage's activations
            acc.peak = max(acc.peak, st.live)
            if acc.first_forward is None:
                acc.first_forward = t0
        duration = self._cost(s, op.kind)
        early = self.last_whole_backward.get((s, it)) is op
        lead = min(self.lead[s], duration) if early else 0.0
        yield duration - lead
        if early:  # partial deferral: the synchronous part is final, the delayed layers' backward still runs
            yield from self._issue_allreduce(s, "grads", st)
            st.started_early = True
            yield lead
        if info.weight_grad:  # ... until its parameter gradients are computed
            st.live -= 1
            acc.last_backward = k.now
        acc.busy += k.now - t0
        acc.compute_start = t0 if acc.compute_start is None else acc.compute_start
        acc.compute_end = k.now

    def _p2p(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        """A send or receive; True for a non-blocking send (still in flight)."""
        k, t0 = self.k, self.k.now
        channel, side, message = self._channel(op)
        tr = channel.post(side, message)
        if side == "send" and not op.blocking:
            st.isends.append(tr)
            self.isend_events.append((s, op, t0, tr))
            if self.costs.stages[s].send_issue_time:
                yield self.costs.stages[s].send_issue_time
                acc.p2p += k.now - t0
            return True
        yield tr.done
        acc.p2p += k.now - t0
        return False

    def _wait_sends(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        t0 = self.k.now
        for tr in st.isends:
            yield tr.done
        st.isends = []
        acc.p2p += self.k.now - t0

    def _rendezvous(self, s: int, op: Op, st: "_StageState", acc, groups) -> Iterator:
        """A stage's k-th pipeline collective of a kind waits, group by group, for the k-th of
        every member of each group."""
        k, t0, kind = self.k, self.k.now, op.kind
        n = st.collective_count.get(kind, 0)
        st.collective_count[kind] = n + 1
        for g, members in groups:
            entry = self.collectives.setdefault((kind, g, n), [0, _Signal()])
            entry[0] += 1
            if entry[0] == len(members):
                k.fire(entry[1])
            yield entry[1]
        acc.sync += k.now - t0

    def _reduce_tied_grads(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        """Waits for the stages of each of its tied groups in turn, then is free."""
        yield from self._rendezvous(s, op, st, acc, self.costs.tied_groups_of(s))

    def _pipeline_collective(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        """Waits for every stage (optimizer_step: DeepSpeed's norm over the pipeline), then takes its cost."""
        yield from self._rendezvous(s, op, st, acc, [(None, range(self.K))])
        yield self._cost(s, op.kind)

    def _start_allreduce(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        if op.target == "grads" and st.started_early:
            st.started_early = False  # in flight since the last backward (partial deferral)
        else:
            yield from self._issue_allreduce(s, op.target, st)

    def _wait_allreduce(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        t0 = self.k.now
        if op.target == "buffer":
            st.buffer.wait()
        yield from self._await_allreduce(s, it, op.target, st)
        acc.allreduce += self.k.now - t0

    def _reduce_grads(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        """Blocking: starts the 'grads' all-reduce and waits for it."""
        t0 = self.k.now
        self._begin_allreduce(s, "grads", st)
        yield from self._await_allreduce(s, it, "grads", st)
        acc.allreduce += self.k.now - t0

    def _copy_grads_to_buffer(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        st.buffer.copy()  # its time is not modelled
        self.uses_buffer[s] = True
        yield from ()

    def _apply_buffered_update(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        if st.buffer.apply()[0]:  # nothing to apply at the first call
            yield self._cost(s, op.kind)

    def _stage_optimizer_step(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        yield self._cost(s, op.kind)

    def _stash_weights(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        st.stashed.add(weight_version(it + op.batch, self.updates[s], op.version))  # the copy's time: not modelled
        acc.versions = max(acc.versions, len(st.stashed) + 1)
        yield from ()

    def _free_weights(self, s: int, it: int, op: Op, st: "_StageState", acc) -> Iterator:
        st.stashed.discard(weight_version(it + op.batch, self.updates[s], op.version, clamp=False))
        yield from ()

    # -- whole run -------------------------------------------------------------------------
    def run(self) -> None:
        for s in range(self.K):
            self.k.spawn(self.stage(s))
        self.k.run()
        stuck = [(s, w) for s, w in enumerate(self.where) if w is not None]
        if stuck:
            detail = "; ".join(f"stage {s} blocked at {w}" for s, w in stuck)
            raise SimulationError(
                f"schedule {self.c.name!r} deadlocks at t={self.k.now:g}: {detail} "
                "(run the validator for a precise diagnosis)"
            )
        for s, op, t0, tr in self.isend_events:
            self.events.append(SimEvent(s, op_name(op), "comm", t0, tr.end, op.micro_batch))
        for ar in self.allreduces:
            self.events.append(SimEvent(ar.stage, f"allreduce({ar.target})", "comm", ar.start, ar.end, None))
        self.events.sort(key=lambda e: (e.start, e.stage, e.end))
