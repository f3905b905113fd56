"""The CPU a rank's main thread spends per instruction class within a step (host-cost samples for the
planner: tools/bench/studies/host_samples.py). Each instruction is charged the main thread's CPU since
the previous one ended (its handler, and the engine's loop between them); a step's first instruction
counts from the step's start."""

from __future__ import annotations

import time


class InstructionCpu:
    """``mark(class name)`` after each instruction; ``take()`` returns {class: [count, cpu_s]} of the
    step and starts the next."""

    def __init__(self, clock=time.thread_time):
        self.clock = clock
        self.last, self.by_class = clock(), {}

    def start(self) -> None:
        self.last, self.by_class = self.clock(), {}

    def mark(self, name: str) -> None:
        now = self.clock()
        entry = self.by_class.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += now - self.last
        self.last = now

    def take(self) -> dict:
        out, self.by_class = self.by_class, {}
        return out

    def attach(self, engine) -> None:
        """Count ``engine``'s instructions: a hippie-ds engine's instruction hook, or the stock engine's
        timed handlers (tools/bench/engines.time_stock_instructions)."""
        from tools.bench.engines import stock_timeline

        stock = stock_timeline(engine)
        if hasattr(engine, "add_instruction_hook"):
            engine.add_instruction_hook(lambda event: self.mark(event.kind))
        elif stock is not None:
            stock.on_instruction.append(self.mark)
