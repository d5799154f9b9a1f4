"""The shared-prefix workload of benchmarks.md: prefix reuse (radix vs naive) and vs HF.

8 groups x 8 prompts: a 1024-token system prompt shared inside each group plus a 64-token question,
32 output tokens each, all submitted at once in shuffled order. Metrics: output tokens / wall time
and mean time to first token (from submission).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from minisgl.server.bench import HFSystem, Row, Workload, _scaled, _TokenClock, log, random_prompt


def shared_prefix(ids: Sequence[int], scale: float, seed: int, groups: int = 8,
                  per_group: int = 8) -> Workload:
    rng = random.Random(f"shared-prefix/{seed}")
    system_len, question_len, out_len = _scaled(1024, scale), _scaled(64, scale), _scaled(32, scale)
    prompts = []
    for _ in range(groups):
        system = random_prompt(rng, ids, system_len)
        prompts += [system + random_prompt(rng, ids, question_len) for _ in range(per_group)]
    rng.shuffle(prompts)
    return Workload("shared-prefix", prompts, [out_len] * len(prompts))


def run_minisgl(llm: Any, wl: Workload) -> tuple[int, float, float, dict[str, int]]:
    """(output tokens, wall seconds, mean TTFT seconds, scheduler stats) with a cold cache."""
    from minisgl.core import SamplingParams
    from minisgl.core.request import Req

    sched = llm.scheduler
    sched.drain()
    sched.clear_cache()  # every system starts cold
    before = dict(vars(sched.stats))
    eos = frozenset(llm.engine.model_config.eos_token_ids)
    reqs = [Req(list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), eos)
            for p, n in zip(wl.prompts, wl.output_lens)]
    first: dict[int, float] = {}
    t0 = time.perf_counter()
    for r in reqs:
        sched.add(r)
    while not all(r.finished for r in reqs):
        for r in sched.step():
            first.setdefault(r.rid, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    sched.drain()
    stats = {k: v - before[k] for k, v in vars(sched.stats).items()}
    return sum(len(r.output_ids) for r in reqs), wall, statistics.mean(first.values()), stats


def run_hf(hf: HFSystem, wl: Workload) -> tuple[int, float, float]:
    """Static batches in submission order; a request's first token comes with its batch's."""
    ttfts: list[float] = []
    counted = 0
    t0 = time.perf_counter()
    for start in range(0, len(wl.prompts), hf.batch_size):
        prompts = wl.prompts[start: start + hf.batch_size]
        ids, mask = hf._left_padded(prompts)
        clock = _TokenClock()
        counted += hf._generate(ids, mask, max(wl.output_lens), streamer=clock) * len(prompts)
        first = clock.times[1] if len(clock.times) > 1 else time.perf_counter()
        ttfts += [first - t0] * len(prompts)
    return counted, time.perf_counter() - t0, statistics.mean(ttfts)


def bench_shared_prefix(systems: Sequence[tuple[str, Any]], ids: Sequence[int], scale: float,
                        repeats: int, seed: int) -> list[Row]:
    """``systems``: (name, LLM or HFSystem) pairs, run interleaved within each repeat."""
    runs: dict[str, list[tuple[float, float, dict[str, int]]]] = {n: [] for n, _ in systems}
    for r in range(repeats):
        wl = shared_prefix(ids, scale, seed + r)
        for name, system in systems:
            log(f"shared-prefix: {name} run {r + 1}/{repeats} ({len(wl.prompts)} requests, "
                f"{sum(map(len, wl.prompts))} prompt tokens)")
            if isinstance(system, HFSystem):
                tokens, wall, ttft = run_hf(system, wl)
                stats: dict[str, int] = {}
            else:
                tokens, wall, ttft, stats = run_minisgl(system, wl)
            runs[name].append((tokens / wall, ttft * 1e3, stats))
            log(f"shared-prefix: {name} {tokens / wall:.1f} tok/s, mean TTFT {ttft * 1e3:.0f} ms "
                f"{stats}")
    rows = []
    for name, got in runs.items():
        details = {"runs": [{"tok_s": t, "ttft_ms": f, **s} for t, f, s in got]}
        rows.append(Row("shared-prefix", name, "output tok/s",
                        statistics.median(t for t, _, _ in got), True, details=details))
        rows.append(Row("shared-prefix", name, "mean TTFT ms",
                        statistics.median(f for _, f, _ in got), False, details=details))
    return rows
