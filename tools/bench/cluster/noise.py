"""Noise: CPU used by processes outside a job while it runs (with 4 busy ranks on 2 cores,
anything else running slows the steps), and how busy the machine's cores are."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class ForeignCpu:
    """Samples, once a second, the CPU time used by processes that are not this benchmark (not
    this process nor a descendant): with 4 busy ranks on 2 cores, anything else running slows
    the steps. Samples are (time.perf_counter(), cumulative foreign CPU seconds); perf_counter is
    CLOCK_MONOTONIC, the clock the ranks time their steps with."""

    def __init__(self, interval=1.0):
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._seen: dict[int, float] = {}
        self._total = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, first=False):
        import psutil  # a DeepSpeed dependency

        me = psutil.Process()
        ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
        for p in psutil.process_iter(["cpu_times"]):
            t = p.info["cpu_times"]
            if p.pid in ours or t is None:  # None: gone or not ours to read
                continue
            cpu = t.user + t.system
            before = self._seen.get(p.pid, cpu if first else 0.0)  # a new process: all its CPU is new
            self._total += max(0.0, cpu - before)
            self._seen[p.pid] = cpu
        self.samples.append((time.perf_counter(), self._total))

    def _run(self):
        self._sample(first=True)
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)

    def save(self, path: Path):
        path.write_text(json.dumps({"interval_s": self.interval, "samples": self.samples}))


def foreign_cpu_between(samples, start, end):
    """Foreign CPU seconds in [start, end], linearly interpolated between samples."""

    def at(t):
        if not samples or t <= samples[0][0]:
            return samples[0][1] if samples else 0.0
        for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
            if t <= t1:
                return c0 + (c1 - c0) * (t - t0) / ((t1 - t0) or 1)
        return samples[-1][1]

    return at(end) - at(start)


def core_ticks(cores: set[int] | None = None) -> tuple[int, int]:
    """(busy, total) clock ticks (``os.sysconf("SC_CLK_TCK")`` a second) of ``cores`` (None: the
    whole machine) since boot, from /proc/stat: busy is all but idle and iowait, every process and
    the kernel's own work included."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu"):
                break  # the cpu lines come first
            if name == "cpu" if cores is None else name[3:].isdigit() and int(name[3:]) in cores:
                ticks = [int(v) for v in fields]
                busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
    return busy, total
