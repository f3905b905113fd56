"""Where a continuous schedule (2bw, pipedream: the pipeline stays full across ``train_batch``
calls) stands: :class:`CallCursor`, owned by ``HippiePipelineEngine`` and read by its step loop,
its handlers and its checkpoints. Pure Python.

An op of a continuous schedule names its batch relative to the call that runs it (``op.batch``:
0 the call's own batch, -1 the previous call's, ...); the cursor turns that into an absolute
batch and says which ops to skip: those of batches that do not exist (the pipeline filling up)
or were completed by ``drain()``.
"""

from __future__ import annotations


class CallCursor:
    """The calls run so far, the earliest batch not yet drained, whether batches are in flight,
    and each batch's learning rates.

    * :meth:`start` -- a ``train_batch`` (or ``drain``) call begins: ops' batches are relative to it;
    * :meth:`batch` -- the absolute batch of an op's relative batch;
    * :meth:`skips` -- whether an op of that batch is skipped (filling, or drained);
    * :meth:`advance` -- a ``train_batch`` call completed: its batch is in flight;
    * :meth:`drained` -- ``drain()`` completed every batch in flight;
    * :meth:`keep_lrs` / :meth:`lrs` -- a batch's updates take the learning rates set for its call;
    * :meth:`state_dict` / :meth:`load_state_dict` -- checkpoints (saved after a drain).
    """

    KEPT_CALLS = 2  # a batch's updates run at most this many calls after its own (2bw, pipedream)

    def __init__(self):
        self.call = 0  # train_batch calls completed
        self.first_batch = 0  # the earliest batch not yet drained
        self.op_call = 0  # the call ops' relative batches refer to
        self.in_flight = False
        self._lrs: dict[int, list[float]] = {}  # batch -> its call's learning rates

    def start(self) -> None:
        """A call begins (``train_batch``, or ``drain``: its ops' batches are relative to the
        call that would come next)."""
        self.op_call = self.call

    def batch(self, relative: int) -> int:
        """The absolute batch of an op of the running call whose batch is ``relative``."""
        return self.op_call + relative

    def skips(self, relative: int) -> bool:
        """An op of a batch that does not exist (pipeline fill) or was drained."""
        return self.batch(relative) < self.first_batch

    def keep_lrs(self, lrs: list[float]) -> None:
        """The learning rates of the call starting now, for its batch's updates (kept while the
        batch can still be in flight)."""
        self._lrs = {b: r for b, r in self._lrs.items() if b >= self.call - self.KEPT_CALLS}
        self._lrs[self.call] = list(lrs)

    def lrs(self, relative: int) -> list[float] | None:
        """The learning rates kept for the batch of an op (None: none kept, the current ones apply)."""
        return self._lrs.get(self.batch(relative))

    def advance(self) -> None:
        """A ``train_batch`` call completed: the next call begins, this one's batch is in flight."""
        self.call += 1
        self.in_flight = True

    def drained(self) -> None:
        """Every batch in flight completed: the next call fills the pipeline again."""
        self.first_batch = self.call
        self.in_flight = False

    def state_dict(self) -> dict:
        return {"call": self.call}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's cursor: saved after a drain, so nothing is in flight."""
        self.call = self.op_call = self.first_batch = state["call"]
        self.in_flight = False
