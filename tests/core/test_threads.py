"""Fewer CPU threads beside busy processes (minisgl.core.threads): the tuner's choices against a
simulated machine whose step times are known, the load reading against a real busy process, and
the engine's steps at both counts against an engine that keeps its threads."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import pytest
import torch

from minisgl.core.threads import FIRST_GAP, MAX_GAP, SPAN, WINDOW, CpuLoad, ThreadTuner
from tests.procs import busy_loops


class Machine:
    """A fake clock and load: ``step(kind, rows)`` asks the tuner for a thread count and
    advances the clock by ``cost(threads, after, rows)`` seconds, ``after`` being the count the
    step before ran at."""

    def __init__(self, cost: Callable[[int, int, int], float], others: float, threads: int = 2,
                 cores: int = 2) -> None:
        self.now = 0.0
        self.others = others
        self.cost = cost
        self.tuner = ThreadTuner(threads, cores, lambda: self.others, clock=lambda: self.now)
        self.counts: list[int] = []

    def step(self, kind: object = "decode", rows: int = 1) -> int:
        n = self.tuner.begin(kind, rows)
        after = self.counts[-1] if self.counts else n
        self.now += self.cost(n, after, rows)
        self.tuner.end()
        self.counts.append(n)
        return n

    def run(self, seconds: float, **kw: object) -> list[int]:
        start, end = len(self.counts), self.now + seconds
        while self.now < end:
            self.step(**kw)  # type: ignore[arg-type]
        return self.counts[start:]


def busy_beside(two: float, one: float, switch: float = 0.005) -> Callable[[int, int, int], float]:
    """Seconds per row ``two`` at 2 threads, ``one`` at 1; a step after one at the other count
    pays ``switch`` seconds more (libgomp's workers still spinning, or asleep)."""
    return lambda n, after, rows: (two if n == 2 else one) * rows + (switch if n != after else 0)


def test_quiet_machine_keeps_every_thread() -> None:
    m = Machine(busy_beside(0.005, 0.001), others=0.3)  # 1.7 of 2 cores free: < ENTER short
    assert set(m.run(10.0)) == {2}
    assert m.tuner.fewer is None


def test_busy_core_settles_on_the_faster_count() -> None:
    # beside a busy process: 2 threads 20 ms a step, 1 thread 7 ms (as measured on 2 cores)
    m = Machine(busy_beside(0.020, 0.007), others=1.0)
    first = m.run(WINDOW * 1.01)  # the load is first read after a window
    assert set(first) == {2} and m.tuner.fewer == 1
    m.run(2.0)
    later = m.run(60.0)
    # after the trials, the trials of 2 threads back off to one per MAX_GAP seconds of steps
    share = later.count(2) / len(later)
    assert later.count(1) > 0 and share < 0.03, share


def test_light_load_keeps_the_faster_many() -> None:
    # a lighter load: 2 threads still faster (a batched step beside a process busy 25%)
    m = Machine(busy_beside(0.0011, 0.0015), others=0.5)
    m.run(WINDOW * 1.01)
    assert m.tuner.fewer == 1
    later = m.run(30.0)
    assert later.count(1) / len(later) < 0.05


def test_each_kind_of_step_gets_its_own_count() -> None:
    costs = {"small": busy_beside(0.020, 0.007), "big": busy_beside(0.0011, 0.0015)}
    m = Machine(busy_beside(0.001, 0.001), others=1.0)
    m.run(WINDOW * 1.01)
    chosen: dict[str, list[int]] = {"small": [], "big": []}
    for i in range(4000):
        kind = "small" if i % 3 else "big"
        m.cost = costs[kind]
        chosen[kind].append(m.step(kind=kind, rows=1 if kind == "small" else 64))
    assert chosen["small"][-1000:].count(1) > 950
    assert chosen["big"][-500:].count(2) > 475


def test_a_changed_winner_is_found_by_a_later_trial() -> None:
    m = Machine(busy_beside(0.020, 0.007), others=1.0)
    m.run(20.0)
    assert m.counts[-1] == 1
    m.cost = busy_beside(0.003, 0.007)  # the other process went quieter: 2 threads now win
    m.run(MAX_GAP + 2 * SPAN)  # at most one gap of steps at 1 thread, then a trial of 2
    assert set(m.run(1.0)) == {2}


def test_load_gone_gives_every_thread_back() -> None:
    m = Machine(busy_beside(0.020, 0.007), others=1.0)
    m.run(10.0)
    assert m.tuner.fewer == 1
    m.others = 0.0
    m.run(WINDOW * 1.01)
    assert m.tuner.fewer is None and set(m.run(1.0)) == {2}


def test_hysteresis_between_contended_and_quiet() -> None:
    m = Machine(busy_beside(0.001, 0.001), others=0.4)  # 0.4 short of 2 threads: contended
    m.run(WINDOW * 1.01)
    assert m.tuner.fewer == 1
    m.others = 0.25  # under ENTER, over LEAVE: stays contended
    m.run(WINDOW * 2.01)
    assert m.tuner.fewer == 1
    m.others = 0.1
    m.run(WINDOW * 2.01)
    assert m.tuner.fewer is None


def test_free_cores_set_the_fewer_count() -> None:
    m = Machine(busy_beside(0.001, 0.001), others=1.2, threads=8, cores=8)
    m.run(WINDOW * 1.01)
    assert m.tuner.fewer == 6  # 6.8 cores free
    m.others = 1.5  # 6.5 free: within the count's band, no restart
    m.run(WINDOW * 2.01)
    assert m.tuner.fewer == 6
    m.others = 3.4
    m.run(WINDOW * 2.01)
    assert m.tuner.fewer == 4
    # 4 threads on 8 cores beside 1.2 busy: each thread has a free core
    m = Machine(busy_beside(0.001, 0.001), others=1.2, threads=4, cores=8)
    m.run(WINDOW * 3.01)
    assert m.tuner.fewer is None


def test_idle_engine_window_is_not_read_as_load() -> None:
    m = Machine(busy_beside(0.020, 0.007), others=0.0)
    m.run(1.0)
    m.others = 2.0  # e.g. another engine ran while this one had no steps
    m.now += 10.0
    m.run(WINDOW * 0.5)
    assert m.tuner.fewer is None
    m.run(WINDOW * 1.5)  # a window full of steps: now it counts
    assert m.tuner.fewer == 1


def test_trials_back_off_to_one_per_max_gap() -> None:
    m = Machine(busy_beside(0.020, 0.007), others=1.0)
    starts = []  # when each trial of 2 threads (after the first two trials) began
    while m.now < 8 * MAX_GAP:
        t, previous = m.now, m.counts[-1] if m.counts else None
        if m.step() == 2 and previous == 1:
            starts.append(t)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) >= 5
    # each gap of steps at 1 thread doubles from FIRST_GAP, up to MAX_GAP
    assert gaps[0] < 2 * FIRST_GAP + 2 * SPAN
    assert all(b >= 1.5 * a or b >= MAX_GAP for a, b in zip(gaps, gaps[1:]))
    assert all(MAX_GAP <= g < MAX_GAP + 2 * SPAN for g in gaps[-2:])


def test_a_kind_whose_steps_go_untimed_ends_its_trial() -> None:
    m = Machine(busy_beside(0.020, 0.007), others=1.0)
    m.run(WINDOW * 1.01)
    counts = []
    for _ in range(40):  # each step followed by an idle engine: never timed
        counts.append(m.step(kind="lone"))
        m.now += 1.0
        m.tuner._next_read = m.now + 10 * WINDOW  # (and no load read meanwhile)
    assert len(set(counts[-10:])) == 1  # trials ended; runs what it last chose


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_cpu_load_sees_a_busy_process() -> None:
    load = CpuLoad()
    time.sleep(1.0)
    quiet = load()
    with busy_loops(1):
        time.sleep(0.3)
        load()
        time.sleep(1.0)
        busy = load()
    assert 0.7 < busy < 1.5 and busy - quiet > 0.5, (quiet, busy)
    # its own CPU time is not counted
    load()
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        pass
    assert load() < 0.5 + quiet


@pytest.fixture(scope="module")
def two_thread_llm(smollm2_path: str):  # type: ignore[no-untyped-def]
    from minisgl.core import LLM

    before = torch.get_num_threads()
    llm = LLM(model=smollm2_path, threads=2)
    yield llm
    llm.close()
    torch.set_num_threads(before)


def test_engine_steps_at_both_counts_match_fixed_threads(two_thread_llm, smollm2_path: str
                                                         ) -> None:  # type: ignore[no-untyped-def]
    """Beside a (simulated) busy core the engine times its steps at 2 and 1 threads; the tokens
    and log-probs are those of an engine that always runs 2, and the caller's thread count is
    left as it was."""
    from minisgl.core import LLM, SamplingParams

    llm = two_thread_llm
    tuner = llm.engine.thread_tuner
    assert tuner is not None and tuner.threads == 2
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 20 + 30 * i)) for i in range(6)]
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, top_logprobs=2)
    fixed = LLM(model=smollm2_path, threads=2, adapt_threads=False)
    try:
        assert fixed.engine.thread_tuner is None
        want = [fixed.generate([p], sp)[0] for p in prompts]
        want_batch = fixed.generate(prompts, sp)
    finally:
        fixed.close()
    seen: list[int] = []  # the thread count of each step, and of its caller after it
    after: list[int] = []
    inner, outer = llm.engine._run, llm.engine.run

    def spy_inner(*args: object) -> object:
        seen.append(torch.get_num_threads())
        return inner(*args)  # type: ignore[arg-type]

    def spy_outer(*args: object) -> object:
        out = outer(*args)  # type: ignore[arg-type]
        after.append(torch.get_num_threads())
        return out

    tuner._load = lambda: 1.0  # one core busy
    tuner._next_read = 0.0
    llm.engine._run, llm.engine.run = spy_inner, spy_outer  # type: ignore[method-assign]
    try:
        got = [llm.generate([p], sp)[0] for p in prompts]  # batch 1: many decode steps
        got_batch = llm.generate(prompts, sp)
    finally:
        del llm.engine._run, llm.engine.run
        tuner._load = CpuLoad() if sys.platform.startswith("linux") else (lambda: 0.0)
    assert set(after) == {2}  # the caller's count, whatever the step ran at
    assert tuner.fewer == 1 and set(seen) == {1, 2}, seen
    for a, b in [*zip(got, want), *zip(got_batch, want_batch)]:  # to the bit
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) > 8,
                    reason="reads /proc/stat; one busy process per CPU but one")
def test_engine_tries_fewer_threads_beside_real_busy_processes(two_thread_llm) -> None:  # type: ignore[no-untyped-def]
    from minisgl.core import SamplingParams

    llm = two_thread_llm
    tuner = llm.engine.thread_tuner
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU")
    with busy_loops(cpus - 1):  # one CPU left free: short by ~1 of the 2 threads
        time.sleep(0.2)
        deadline = time.monotonic() + 60
        while tuner.fewer is None and time.monotonic() < deadline:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=32, ignore_eos=True))
    assert tuner.fewer == 1
    deadline = time.monotonic() + 60
    while tuner.fewer is not None and time.monotonic() < deadline:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=32, ignore_eos=True))
    assert tuner.fewer is None


def test_no_tuner_where_there_is_nothing_to_tune(smollm2_path: str) -> None:
    from minisgl.core import LLM

    llm = LLM(model=smollm2_path, threads=1)
    try:
        assert llm.engine.thread_tuner is None
    finally:
        llm.close()
    assert ThreadTuner.for_this_process(1) is None
