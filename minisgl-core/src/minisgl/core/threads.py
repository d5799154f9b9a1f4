"""Fewer CPU threads while other processes keep the machine's cores busy (``adapt_threads``).

A CPU step's threads meet many times per step (~150 OpenMP regions, or the team's jobs, per
decode step). When another process takes a core, the OS time-slices it with one of the engine's
threads, and each meeting then waits for the thread that is off its core; libgomp's idle
workers, spinning between regions, take time slices too. Measured on 2 cores (AMD Zen 5,
SmolLM2) beside one busy loop, 2 threads against 1: batch-1 decode 19.1 vs 6.7 ms/token, 8
requests 292 vs 510 tok/s, 32 requests 496 vs 860, a 1,024-token prefill 1,440-1,630 vs 1,780;
on an idle machine 2 threads read 5.6 ms, 820, 1,550 and 3,550. Under a lighter load the answer
depends on the step: beside a process busy 25% of each 10 ms, 1 thread won batch 1 (7.1 vs 8.2
ms) and lost every batched step (8 requests 510 vs 655 tok/s, prefill 1,755 vs 2,740).

So the engine watches the other processes (``CpuLoad``: cores busy on this process's CPUs
less its own CPU time, read every half second) and, while they leave it fewer free cores than
it has threads, times each kind and size of step both ways, with all its threads and with as
many as there are free cores, and runs the faster (``ThreadTuner``), trying the other count
again now and then (after 1 s of that kind's steps, doubling each time it loses, up to 16 s).
On a quiet machine it reads the load and nothing else: every step gets every thread (measured
in one process, the tuner on and off alternating, batch-1 decode 0.996x). Beside one busy loop
(``minisgl bench latency --busy 1 --vs-fixed-threads``): decode 7.5 vs 19.1 ms/token, prefill
1.41x; offline-mixed 1.46x.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Hashable

WINDOW = 0.5  # seconds between load reads
ENTER, LEAVE = 0.35, 0.2  # cores short of the threads: contended from ENTER, quiet again below LEAVE
SPAN, TRIAL = 0.25, 3  # a trial of a thread count: this many seconds of steps, and steps
FIRST_GAP, MAX_GAP = 1.0, 16.0  # seconds of steps between trials of the other thread count
MARGIN = 0.95  # a trial wins if its time per row is under this times the other count's

log = logging.getLogger("minisgl.threads")


class CpuLoad:
    """Cores kept busy by other processes on this process's CPUs, averaged since the last call
    (Linux: /proc/stat's per-CPU busy time less this process's own CPU time)."""

    def __init__(self) -> None:
        self.cpus = frozenset(os.sched_getaffinity(0))
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[float, float, float]:
        busy = 0
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break  # the per-CPU lines come first
                name, *fields = line.split()
                if name == b"cpu" or int(name[3:]) not in self.cpus:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
                busy += user + nice + system + irq + softirq
        own = os.times()
        return time.monotonic(), busy / self._tick, own.user + own.system

    def __call__(self) -> float:
        now = self._snapshot()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        return max(0.0, (busy1 - busy0 - (own1 - own0)) / max(t1 - t0, 1e-3))


class _Counts:
    """One kind of step's times at two thread counts, and the faster one.

    Each count is tried in trials of at least TRIAL steps and SPAN seconds in a row, compared by
    time per row over the same span: beside a busy process, steps at 2 threads mostly ran fast
    and every few steps lost a time slice to the other process (8 requests: 12 ms median, 52 ms
    at the 90th percentile, 32 ms mean), so a few steps say little. The first trial is of the
    count the step before ran at. A trial whose steps go untimed (each followed by an idle
    engine) ends after 4 x TRIAL steps with what it has."""

    def __init__(self, many: int, few: int, first: int) -> None:
        # per count: (seconds, rows) of its latest steps
        self.times = {many: deque[tuple[float, int]](maxlen=64),
                      few: deque[tuple[float, int]](maxlen=64)}
        self.best = first
        self.trying: int | None = first  # the count on trial (None: running the best)
        self.trial: list[tuple[float, int]] = []  # the running trial's steps (timed ones)
        self.asked = 0  # steps the running trial was given
        self.gap = self.countdown = FIRST_GAP

    def other(self, n: int) -> int:
        a, b = self.times
        return b if n == a else a

    def per_row(self, n: int) -> float:
        """Seconds per row at ``n`` threads over its latest SPAN seconds of steps."""
        seconds = rows = 0.0
        for s, r in reversed(self.times[n]):
            seconds, rows = seconds + s, rows + r
            if seconds >= SPAN:
                break
        return seconds / rows

    def choose(self) -> int:
        if self.trying is None and self.countdown <= 0:
            self.trying = self.other(self.best)
        if self.trying is None:
            return self.best
        self.asked += 1
        if self.asked > 4 * TRIAL:
            self._end_trial(self.trying)
            return self.choose()
        return self.trying

    def record(self, n: int, seconds: float, rows: int) -> None:
        if n != self.trying:
            if n == self.best and self.trying is None:
                self.times[n].append((seconds, rows))
                self.countdown -= seconds
            return
        self.trial.append((seconds, rows))
        if len(self.trial) >= TRIAL and sum(s for s, _ in self.trial) >= SPAN:
            self._end_trial(n)

    def _end_trial(self, n: int) -> None:
        other = self.other(n)
        if self.trial:
            self.times[n].clear()
            self.times[n].extend(self.trial)
        self.trial, self.trying, self.asked = [], None, 0
        if not self.times[n] or not self.times[other]:
            if self.times[n]:  # the first trial of the first count: the other's next
                self.trying = other
        elif self.per_row(n) < MARGIN * self.per_row(other):
            self.best, self.gap = n, FIRST_GAP
        elif n != self.best:
            self.gap = min(2 * self.gap, MAX_GAP)
        self.countdown = self.gap


class ThreadTuner:
    """Threads for each step: ``threads`` on a quiet machine; while other processes leave fewer
    than ``threads`` of the ``cores`` free, per kind of step (a key) the faster of ``threads``
    and the free cores' count. A step's time runs from its start to the next step's start: the
    scheduler's work in between pays for the thread count too (beside a busy process, 8-request
    steps at 2 threads took ~1.2 ms per row inside the step, timed alone, and 2.1-2.7 from start
    to start over a quarter second, where libgomp's workers, spinning after a step, shared the
    two cores with the scheduler's Python and the other process; at 1 thread 1.5 either way). A
    gap of more than twice the step's own time plus 5 ms after it (an idle server) drops the
    step's time."""

    def __init__(self, threads: int, cores: int, load: Callable[[], float],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.threads, self.cores = threads, cores
        self._load, self._clock = load, clock
        self._next_read = clock() + WINDOW
        self.fewer: int | None = None  # the other count while contended; None: quiet
        self._kinds: dict[Hashable, _Counts] = {}
        # the last step: kind, thread count, rows, start, timed?; its end (None: still running)
        self._last: tuple[Hashable, int, int, float, bool] | None = None
        self._ended: float | None = None

    @classmethod
    def for_this_process(cls, threads: int) -> ThreadTuner | None:
        """A tuner reading this machine's load, or None where there is nothing to tune (one
        thread) or no load to read (not Linux)."""
        if threads < 2:
            return None
        try:
            load = CpuLoad()
        except (OSError, ValueError, AttributeError):
            return None
        return cls(threads, len(load.cpus), load)

    def begin(self, key: Hashable, rows: int) -> int:
        """A step of kind ``key`` over ``rows`` rows starts: the threads it should use."""
        now = self._clock()
        before, last_key = self.threads, None  # the step before this one: count and kind
        if self._last is not None:
            last_key, before, last_rows, start, clean = self._last
            counts = self._kinds.get(last_key)
            if (clean and self._ended is not None and counts is not None and before in counts.times
                    and now - self._ended <= 2 * (self._ended - start) + 0.005):
                counts.record(before, now - start, last_rows)
        if now >= self._next_read:
            others = self._load()
            if now < self._next_read + WINDOW:  # (else the engine sat idle: a fresh window)
                self._update(others)
            self._next_read = now + WINDOW
        threads = self.threads
        if self.fewer is not None:
            counts = self._kinds.get(key)
            if counts is None:
                first = before if before == self.fewer else self.threads
                counts = self._kinds[key] = _Counts(self.threads, self.fewer, first)
            threads = counts.choose()
        # Not timed after a step of its kind at the other count (a trial's first step): a step
        # after one at more threads pays for libgomp's workers still spinning, after one at fewer
        # for waking them. After another kind's step it is: kinds alternate in steady state.
        clean = threads == before or key != last_key
        self._last, self._ended = (key, threads, max(rows, 1), now, clean), None
        return threads

    def end(self) -> None:
        """The step ``begin`` announced is done."""
        self._ended = self._clock()

    def _update(self, others: float) -> None:
        free = self.cores - others
        short = self.threads - free  # threads without a free core of their own
        if short < (ENTER if self.fewer is None else LEAVE):
            if self.fewer is not None:
                log.info("other processes keep %.1f cores busy: steps at %d threads again",
                         others, self.threads)
                self.fewer = None
                self._kinds.clear()
            return
        if self.fewer is not None and self.fewer - 0.25 <= free < self.fewer + 1.25:
            return  # (a load that hovers at a whole number of cores does not flip the count)
        fewer = max(1, min(self.threads - 1, int(free)))
        if fewer != self.fewer:  # times at another count are no guide: start over
            log.info("other processes keep %.1f of %d cores busy: steps timed at %d and %d "
                     "threads, the faster kept", others, self.cores, self.threads, fewer)
            self.fewer = fewer
            self._kinds.clear()
