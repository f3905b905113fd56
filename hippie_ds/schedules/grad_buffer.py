"""A deferred stage's gradient buffer: its one state machine. The validator reports the illegal
transitions, the simulator times the legal ones, the engine runs them. Pure Python.

    empty --copy_grads_to_buffer--> filled --start_allreduce(buffer)--> reducing
          --wait_allreduce(buffer)--> reduced --apply_buffered_update--> empty

At the first step the buffer is empty: start, wait and apply find nothing and do nothing (the
update is skipped). With one replica there is nothing to reduce: start goes straight to reduced.
"""

from __future__ import annotations

EMPTY, FILLED, REDUCING, REDUCED = "empty", "filled", "reducing", "reduced"


class GradBuffer:
    """The state; each transition returns what it does and, for an illegal one, why (None: legal)."""

    def __init__(self, state: str = EMPTY) -> None:
        self.state = state

    def copy(self) -> str | None:
        """copy_grads_to_buffer: this step's gradients into the buffer."""
        error = None if self.state == EMPTY else f"gradient buffer overwritten while live (state {self.state})"
        self.state = FILLED
        return error

    def start(self, reduce: bool = True) -> tuple[bool, str | None]:
        """start_allreduce(buffer): (whether an all-reduce starts, error). ``reduce=False``: one
        replica, nothing to reduce."""
        if self.state == REDUCING:
            return False, "start_allreduce(buffer) while the previous one is still in flight"
        if self.state != FILLED:
            return False, None  # empty: the first step, nothing buffered yet
        self.state = REDUCING if reduce else REDUCED
        return reduce, None

    def wait(self) -> tuple[bool, str | None]:
        """wait_allreduce(buffer): (whether there is an all-reduce to wait for, error)."""
        if self.state == REDUCING:
            self.state = REDUCED
            return True, None
        if self.state == FILLED:
            return False, (
                f"wait_allreduce(buffer) with no all-reduce of the gradient buffer in flight (buffer {self.state})"
            )
        return False, None

    def apply(self) -> tuple[bool, str | None]:
        """apply_buffered_update: (whether a reduced buffer is applied, error)."""
        error = None
        if self.state in (FILLED, REDUCING):
            error = f"buffered gradient read before its all-reduce was waited for (buffer {self.state})"
        applies = self.state == REDUCED
        self.state = EMPTY
        return applies, error

    @property
    def pending(self) -> bool:
        """A buffered gradient not yet applied."""
        return self.state != EMPTY
