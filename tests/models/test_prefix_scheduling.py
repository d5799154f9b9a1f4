"""Prefix reuse and scheduling under pressure, end to end on tiny random checkpoints (float32).

Whatever the scheduler does (radix or naive cache, chunked prefill down to 3 tokens a step, a
pool so small that cached prefixes are evicted and running requests retracted, fcfs or lpm
order, overlap scheduling on or off), every greedy output must equal HF transformers' greedy reference token for token, and
once all requests are done the only pages not free are the prefix cache's. The shared-prefix
tests check the savings against bounds derived from the workload (not measured numbers); the
edge-case tests drive the scheduler by hand where timing matters (abort mid-prefill, the first
step of a fully cached prompt).

The last tests reproduce engine bugs these tests found in commit 871d970 (fixed in 3cff503).
Every model-running loop is bounded (MAX_STEPS), so a scheduler that stops making progress fails
a test instead of hanging it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import LLM
from minisgl.core.engine import Engine
from minisgl.core.request import Batch, Req
from minisgl.core.scheduler import Scheduler

from .conftest import VOCAB
from .reference import (
    DEVICE,
    assert_all_free,
    explain_mismatch,
    greedy,
    hf_greedy,
    hf_logits,
    make_engine,
    make_prompts,
    run_to_completion,
    submit,
)

LLAMA, QWEN = "llama-gqa-untied-llama3", "qwen3-tied"
MODELS = [LLAMA, QWEN]
ATOL = 1e-4  # engine vs HF logits (measured <= 6e-6; see test_hf_reference.py)
MAXN = 16  # HF references are computed once per prompt for MAXN tokens and sliced
MAX_STEPS = 2000  # far above what any workload here needs: past it, the scheduler is stuck

# One family of prompts sharing a 21-token prefix (not a multiple of 4 or 16, so page rounding
# matters): five different suffixes, an exact repeat, and one that shares a longer prefix with
# another member; plus an unrelated prompt.
SHARED = make_prompts([21], VOCAB, seed=101)[0]
SUFFIXES = make_prompts([3, 6, 1, 9, 2], VOCAB, seed=102)
FAMILY = [SHARED + s for s in SUFFIXES] + [SHARED + SUFFIXES[1], SHARED + SUFFIXES[3][:5] + [7, 8]]
OTHER = make_prompts([13], VOCAB, seed=103)[0]
PROMPTS = FAMILY + [OTHER]
MAX_TOKENS = [9, 5, 14, 3, 7, 11, 6, 8]


_OPEN: list[Scheduler | LLM] = []  # closed after each test: overlap runs a worker thread each


@pytest.fixture(autouse=True)
def _close_schedulers() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def new_scheduler(engine: Engine) -> Scheduler:
    scheduler = Scheduler(engine)
    _OPEN.append(scheduler)
    return scheduler


def new_llm(path: Path, backend: str, page_size: int, num_pages: int, **kw: Any) -> LLM:
    """An LLM whose generate() fails, instead of hanging, if the scheduler stops making progress
    (its loop has no step limit of its own)."""
    llm = LLM(model=str(path), dtype="float32", device=DEVICE, attention_backend=backend, page_size=page_size,
              num_pages=num_pages, **kw)
    _OPEN.append(llm)
    scheduler, steps = llm.scheduler, itertools.count(1)
    orig_step = scheduler.step

    def step() -> list[Req]:
        if next(steps) > MAX_STEPS:
            raise AssertionError(f"scheduler still busy after {MAX_STEPS} steps")
        return orig_step()

    scheduler.step = step  # type: ignore[method-assign]
    return llm


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def one_request_pages(prompts: list[list[int]], max_tokens: list[int], page_size: int) -> int:
    """Pages the largest request needs alone (what validation demands of the pool)."""
    return max(pages_for(len(p) + m, page_size) for p, m in zip(prompts, max_tokens))


def want(path: Path, prompt: list[int], n: int) -> list[int]:
    return hf_greedy(path, prompt, MAXN)[:n]


def check_outputs(path: Path, reqs: list[Req], what: str) -> None:
    for req in reqs:
        ref = want(path, req.prompt_ids, req.params.max_tokens)
        assert req.output_ids == ref, (
            f"{what}: {explain_mismatch(path, req.prompt_ids, req.output_ids, ref)}")
        assert req.finished and req.finish_reason == "length", what


def check_idle_and_clear(engine: Engine, scheduler: Scheduler, expect_cached: bool) -> None:
    """After load, nothing running: integrity holds, every page not free is the cache's (and the
    radix cache does hold some, so the check is not vacuous); clearing the cache frees all."""
    assert not scheduler.has_work()
    scheduler.check_integrity()
    cached = scheduler.cache.total_pages
    assert (cached > 0) == expect_cached, f"cache holds {cached} pages"
    assert engine.allocator.num_free + cached == engine.allocator.capacity
    assert_all_free(engine, scheduler)  # clears the cache, then everything is free
    assert scheduler.cache.total_pages == 0


def check_accounting(scheduler: Scheduler, reqs: list[Req], what: str) -> None:
    """Stats after a run of ``reqs``: each prompt counted once; every prompt token not found in
    the cache and every decode input is computed at least once, exactly once without retraction
    (the cache's savings are then exactly cached_tokens)."""
    stats = scheduler.stats
    assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in reqs), what
    assert stats.cached_tokens == sum(r.cached_tokens for r in reqs), what
    assert all(0 <= r.cached_tokens < len(r.prompt_ids) for r in reqs), what
    if not scheduler.cache.reuses:
        assert stats.cached_tokens == 0, what
    least = stats.prompt_tokens - stats.cached_tokens + sum(len(r.output_ids) - 1 for r in reqs)
    if stats.retractions == 0:
        assert stats.computed_tokens == least, what
    else:
        assert stats.computed_tokens >= least, what


class EvictionCounter:
    """Counts the pages the prefix cache evicts (wraps ``cache.evict`` on the instance)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.pages = 0
        cache = scheduler.cache
        orig = cache.evict

        def evict(num_pages: int) -> int:
            freed = orig(num_pages)
            self.pages += freed
            return freed

        cache.evict = evict  # type: ignore[method-assign]


def run_workload(path: Path, backend: str, prompts: list[list[int]], max_tokens: list[int],
                 **kw: Any) -> tuple[Engine, Scheduler, list[Req], EvictionCounter]:
    engine = make_engine(path, backend, **kw)
    scheduler = new_scheduler(engine)
    evictions = EvictionCounter(scheduler)
    reqs = submit(scheduler, prompts, [greedy(n) for n in max_tokens])
    run_to_completion(scheduler, MAX_STEPS)
    return engine, scheduler, reqs, evictions


# -- 1. identical greedy outputs across every scheduling configuration --------------------------


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_greedy_outputs_identical_across_configurations(
        tiny_dirs: dict[str, Path], attention_backend: str, model: str, page_size: int) -> None:
    """radix / naive x unchunked / 3 / 7-token prefill chunks x roomy / tight pool x fcfs / lpm
    x overlap scheduling on / off: every run gives HF's greedy tokens. The tight pool (room for
    the largest request and a fifth more) must really evict cached prefixes and retract running
    requests in every run."""
    path = tiny_dirs[model]
    need = one_request_pages(PROMPTS, MAX_TOKENS, page_size)
    tight = need + need // 5
    roomy = pages_for(sum(len(p) + m for p, m in zip(PROMPTS, MAX_TOKENS)), page_size) * 2
    for cache, chunk, pool, policy, overlap in itertools.product(
            ["radix", "naive"], [4096, 3, 7], ["roomy", "tight"], ["fcfs", "lpm"], [True, False]):
        what = f"{model} page {page_size} {cache} chunk {chunk} {pool} {policy} overlap {overlap}"
        engine, scheduler, reqs, evictions = run_workload(
            path, attention_backend, PROMPTS, MAX_TOKENS, page_size=page_size,
            num_pages=(tight if pool == "tight" else roomy) + 1, max_prefill_tokens=chunk,
            cache=cache, schedule_policy=policy, overlap=overlap)
        check_outputs(path, reqs, what)
        check_accounting(scheduler, reqs, what)
        if pool == "tight":
            assert scheduler.stats.retractions > 0, f"{what}: nothing was retracted"
            if cache == "radix":
                assert evictions.pages > 0, f"{what}: nothing was evicted"
        else:
            assert scheduler.stats.retractions == 0 and evictions.pages == 0, what
        assert (scheduler.stats.cached_tokens > 0) == (cache == "radix"), what
        check_idle_and_clear(engine, scheduler, expect_cached=cache == "radix")
        scheduler.close()


def arrive_while_decoding(scheduler: Scheduler, n: int) -> list[Req]:
    """The first ``n`` PROMPTS (14 tokens each) run until all are decoding; then the rest arrive
    (MAX_TOKENS) and everything runs to completion. Returns the requests in PROMPTS order."""
    first = submit(scheduler, PROMPTS[:n], [greedy(14)] * n)
    for _ in range(MAX_STEPS):
        if not any(r.in_prefill for r in first):
            break
        scheduler.step()
    later = submit(scheduler, PROMPTS[n:], [greedy(m) for m in MAX_TOKENS[n:]])
    run_to_completion(scheduler, MAX_STEPS)
    return first + later


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_mixed_steps_carry_the_decoding_requests(tiny_dirs: dict[str, Path], attention_backend: str,
                                                 model: str, overlap: bool) -> None:
    """mixed_steps: a prefill step also computes one token of every decoding request. Two
    requests decode while six more arrive and prefill in 7-token chunks: every output is HF's
    greedy one, every token is computed once (accounting), steps with both prompt chunks and
    decode rows really ran, and with mixed_steps off none did."""
    path = tiny_dirs[model]
    for mixed in (True, False):
        what = f"{model} overlap {overlap} mixed {mixed}"
        engine = make_engine(path, attention_backend, page_size=4, num_pages=200,
                             max_prefill_tokens=7, mixed_steps=mixed, overlap=overlap)
        scheduler = new_scheduler(engine)
        steps: list[tuple[int, int]] = []  # per prefill step: (prompt rows, decode rows)
        prepare = engine.prepare

        def recording(batch: Batch, prepare: Any = prepare, steps: Any = steps) -> Any:
            if batch.phase == "prefill":  # called at launch, before the rows are counted done
                decoding = sum(not r.in_prefill for r in batch.reqs)
                steps.append((len(batch.reqs) - decoding, decoding))
            return prepare(batch)

        engine.prepare = recording  # type: ignore[method-assign]
        reqs = arrive_while_decoding(scheduler, 2)
        check_outputs(path, reqs, what)
        check_accounting(scheduler, reqs, what)
        assert any(p and d for p, d in steps) == mixed, (what, steps)
        scheduler.close()
        assert_all_free(engine, scheduler)


def test_mixed_steps_keep_within_the_prefill_graphs_rows(tiny_dirs: dict[str, Path],
                                                          attention_backend: str) -> None:
    """An engine whose compiled prefill graph covers few sampled rows (int8: up to
    INT8_MM_MAX_ROWS) gets mixed steps with at most that many; the decoding requests left out
    take the next step, and outputs stay HF's."""
    path = tiny_dirs[LLAMA]
    engine = make_engine(path, attention_backend, page_size=4, num_pages=200,
                         max_prefill_tokens=7, mixed_steps=True)
    engine.prefill_graph_rows = 3  # as the int8 graphs' limit, scaled down (eager here)
    scheduler = new_scheduler(engine)
    sampled: list[int] = []
    prepare = engine.prepare

    def recording(batch: Batch) -> Any:
        if batch.phase == "prefill":
            sampled.append(sum(batch.sample))
        return prepare(batch)

    engine.prepare = recording  # type: ignore[method-assign]
    check_outputs(path, arrive_while_decoding(scheduler, 5), "rows cap")
    assert max(sampled) == 3, sampled  # reached (five requests were decoding), never passed
    scheduler.close()
    assert_all_free(engine, scheduler)


# -- 2. shared prefixes are computed once ------------------------------------------------------


@pytest.mark.parametrize("mode", ["one-by-one", "all-at-once"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("model", MODELS)
def test_shared_prefix_is_computed_once(tiny_dirs: dict[str, Path], attention_backend: str,
                                        model: str, page_size: int, mode: str) -> None:
    """The family prompts share SHARED: with the radix cache, each prompt after the first reuses
    at least SHARED rounded down to whole pages (all family prompts are longer than SHARED, so
    the "keep one token to compute" rule does not cut into it). That must hold both for separate
    generate() calls and for one call with all prompts (in-batch deferral: the others wait one
    step for the first to compute the prefix). Naive computes every prompt and decode token."""
    path = tiny_dirs[model]
    prompts, max_tokens = FAMILY, MAX_TOKENS[:len(FAMILY)]
    assert all(len(p) > len(SHARED) for p in prompts)
    saved = (len(prompts) - 1) * (len(SHARED) // page_size * page_size)
    naive_total = sum(len(p) for p in prompts) + sum(n - 1 for n in max_tokens)
    stats = {}
    for cache in ("radix", "naive"):
        llm = new_llm(path, attention_backend, page_size, pages_for(2048, page_size) + 1,
                      cache=cache)
        if mode == "one-by-one":
            outs = [llm.generate(p, greedy(n))[0] for p, n in zip(prompts, max_tokens)]
        else:
            outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
        for p, n, out in zip(prompts, max_tokens, outs):
            assert out.token_ids == want(path, p, n), f"{cache}: {p}"
        stats[cache] = llm.scheduler.stats
        assert sum(o.cached_tokens for o in outs) == stats[cache].cached_tokens
        assert stats[cache].prompt_tokens == sum(len(p) for p in prompts)
        check_idle_and_clear(llm.engine, llm.scheduler, expect_cached=cache == "radix")
    radix, naive = stats["radix"], stats["naive"]
    assert naive.cached_tokens == 0 and naive.computed_tokens == naive_total
    assert radix.cached_tokens >= saved > 0
    assert radix.computed_tokens < naive.computed_tokens
    assert radix.computed_tokens <= naive.computed_tokens - saved, (
        f"radix computed {radix.computed_tokens}, naive {naive.computed_tokens}: the shared "
        f"prefix was recomputed (expected savings >= {saved})")
    # and the savings are exactly what the cache reported
    assert radix.computed_tokens == naive.computed_tokens - radix.cached_tokens


# -- 3. edge cases -------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("model", MODELS)
def test_fully_cached_prompt_recomputes_one_page(tiny_dirs: dict[str, Path],
                                                 attention_backend: str, model: str,
                                                 page_size: int) -> None:
    """A prompt of 32 tokens (a multiple of every page size) sent twice: the second time it is
    cached in full, yet one page is recomputed so there are logits to sample from, and those
    logits are HF's."""
    path = tiny_dirs[model]
    prompt = make_prompts([32], VOCAB, seed=104)[0]
    engine = make_engine(path, attention_backend, page_size=page_size)
    scheduler = new_scheduler(engine)
    first = submit(scheduler, [prompt], greedy(4))
    run_to_completion(scheduler, MAX_STEPS)
    check_outputs(path, first, "first time")
    computed_before = scheduler.stats.computed_tokens

    (req,) = submit(scheduler, [prompt], greedy(5))
    batch = scheduler.next_batch()
    assert batch is not None and batch.phase == "prefill" and batch.reqs == [req]
    assert req.cached_tokens == req.num_computed == len(prompt) - page_size
    assert batch.extend_lens == [page_size] and batch.sample == [True]
    logits = engine.forward(engine.prepare(batch))
    ref = hf_logits(path, prompt)[-1]
    assert float((logits[0].cpu() - ref).abs().max()) <= ATOL
    assert int(logits[0].argmax()) == want(path, prompt, 1)[0]
    run_to_completion(scheduler, MAX_STEPS)  # schedules the same prefill again, then decodes
    check_outputs(path, [req], "second time")
    assert scheduler.stats.cached_tokens == len(prompt) - page_size
    assert scheduler.stats.computed_tokens - computed_before == page_size + 5 - 1
    check_idle_and_clear(engine, scheduler, expect_cached=True)


class PrefillRecorder:
    """Records (request, outputs so far, first position, tokens) of every prefill entry."""

    def __init__(self, engine: Engine) -> None:
        self.entries: list[tuple[Req, int, int, int]] = []
        orig = engine.prepare

        def prepare(batch: Batch) -> Any:
            if batch.phase == "prefill":
                for req, n in zip(batch.reqs, batch.extend_lens):
                    self.entries.append((req, len(req.output_ids), req.num_computed, n))
            return orig(batch)

        engine.prepare = prepare  # type: ignore[method-assign]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_retracted_request_resumes_from_its_own_cached_prefix(
        tiny_dirs: dict[str, Path], attention_backend: str, model: str, page_size: int) -> None:
    """Unrelated prompts (no prefix shared between them) with long outputs in a pool about 1.4x
    the largest request: small enough that requests are retracted mid-decode, large enough that
    a retracted request's cached tokens are not all evicted before it resumes. Its prefill then
    starts past its prompt: it found its own prompt + outputs in the cache."""
    path = tiny_dirs[model]
    prompts = make_prompts([9, 11, 10, 12], VOCAB, seed=105)
    max_tokens = [16] * len(prompts)
    need = one_request_pages(prompts, max_tokens, page_size)
    engine = make_engine(path, attention_backend, page_size=page_size,
                         num_pages=need + 3 * need // 7 + 1)
    scheduler = new_scheduler(engine)
    recorder = PrefillRecorder(engine)
    reqs = submit(scheduler, prompts, [greedy(n) for n in max_tokens])
    run_to_completion(scheduler, MAX_STEPS)
    check_outputs(path, reqs, "tight pool")
    assert scheduler.stats.retractions > 0
    assert scheduler.stats.cached_tokens == 0  # nothing shared at first admission
    resumed = [(r, n_out, start) for r, n_out, start, _ in recorder.entries if n_out > 0]
    assert resumed, "no retracted request was resumed"
    own_hits = [(r.rid, n_out, start) for r, n_out, start in resumed if start > len(r.prompt_ids)]
    assert own_hits, f"resumed requests recomputed from scratch: {resumed}"
    for r, n_out, start in resumed:
        assert start % page_size == 0 and start <= len(r.prompt_ids) + n_out - 1
    check_idle_and_clear(engine, scheduler, expect_cached=True)


@pytest.mark.parametrize("model", MODELS)
def test_eviction_with_pages_of_four(tiny_dirs: dict[str, Path], attention_backend: str,
                                     model: str) -> None:
    """Prompts run one after another through a pool of 12 pages of 4 tokens: the cache fills up
    and must give older prefixes back (LRU, whole pages; an evicted prefix can lose only its tail
    pages). Re-running old and new prompts then reuses what is left and stays correct."""
    path = tiny_dirs[model]
    page = 4
    prompts = make_prompts([20, 19, 22, 21], VOCAB, seed=106)
    engine = make_engine(path, attention_backend, page_size=page, num_pages=13)
    scheduler = new_scheduler(engine)
    evictions = EvictionCounter(scheduler)
    capacity = engine.allocator.capacity
    for i, p in enumerate(prompts + [prompts[-1], prompts[0]]):
        cached_before = scheduler.stats.cached_tokens
        (req,) = submit(scheduler, [p], greedy(5))
        run_to_completion(scheduler, MAX_STEPS)
        check_outputs(path, [req], f"prompt {i}")
        scheduler.check_integrity()
        assert 0 < scheduler.cache.total_pages <= capacity
        assert engine.allocator.num_free + scheduler.cache.total_pages == capacity
        assert scheduler.stats.cached_tokens - cached_before == req.cached_tokens
        if i == len(prompts):  # the last prompt again: the most recent prefix, still cached
            assert req.cached_tokens == (len(p) - 1) // page * page
        if i == len(prompts) + 1:  # the first prompt again: least recently used, evicted
            assert req.cached_tokens < (len(p) - 1) // page * page
    assert evictions.pages > 0
    assert scheduler.stats.retractions == 0
    check_idle_and_clear(engine, scheduler, expect_cached=True)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_abort_mid_chunked_prefill(tiny_dirs: dict[str, Path], attention_backend: str,
                                   model: str, page_size: int) -> None:
    """A 30-token prompt prefilled 5 tokens a step is aborted after its first chunk. Integrity
    holds right away; the others (one sharing the aborted prompt's first 12 tokens, so it may
    reuse the aborted request's cached chunk) finish with HF's tokens; afterwards every page is
    the cache's, and clearing it frees all."""
    path = tiny_dirs[model]
    long, b, c = make_prompts([30, 6, 9], VOCAB, seed=107)
    b = long[:12] + b
    engine = make_engine(path, attention_backend, page_size=page_size, max_prefill_tokens=5)
    scheduler = new_scheduler(engine)
    victim, *others = submit(scheduler, [long, b, c], [greedy(8), greedy(7), greedy(6)])
    scheduler.step()
    assert victim.num_computed == 5 and victim.in_prefill and not victim.output_ids
    scheduler.check_integrity()
    assert scheduler.abort(victim.rid) is victim
    assert victim.finished and victim.finish_reason == "abort" and not victim.output_ids
    scheduler.check_integrity()
    assert scheduler.abort(victim.rid) is None  # already gone
    run_to_completion(scheduler, MAX_STEPS)
    check_outputs(path, others, "after abort")
    assert victim.output_ids == []
    check_idle_and_clear(engine, scheduler, expect_cached=True)


@pytest.mark.parametrize("chunk", [4096, 5])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_pool_with_room_for_one_request_completes_all(
        tiny_dirs: dict[str, Path], attention_backend: str, model: str, page_size: int,
        chunk: int) -> None:
    """Six requests at once into a pool exactly as large as the largest of them needs alone."""
    path = tiny_dirs[model]
    prompts = [SHARED + SUFFIXES[0], OTHER, *make_prompts([7, 17, 4], VOCAB, seed=108),
               SHARED + SUFFIXES[0]]
    max_tokens = [10, 14, 12, 6, 16, 9]
    capacity = one_request_pages(prompts, max_tokens, page_size)
    llm = new_llm(path, attention_backend, page_size, capacity + 1, max_prefill_tokens=chunk)
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    for p, n, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == want(path, p, n), explain_mismatch(path, p, out.token_ids,
                                                                   want(path, p, n))
    check_idle_and_clear(llm.engine, llm.scheduler, expect_cached=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_request_that_can_never_fit_is_rejected(tiny_dirs: dict[str, Path],
                                                attention_backend: str, page_size: int) -> None:
    """Prompt + max_tokens beyond the whole pool: a ValueError naming max_tokens at once (not a
    hang), nothing submitted (not even the valid request of the same call), nothing leaked, and
    the engine still serves; a request needing exactly the whole pool runs."""
    path = tiny_dirs[LLAMA]
    capacity = 12 // page_size  # 12 tokens
    llm = new_llm(path, attention_backend, page_size, capacity + 1)
    ok, big = make_prompts([4, 9], VOCAB, seed=109)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([ok, big], [greedy(3), greedy(4)])  # 9 + 4 = 13 tokens > 12
    with pytest.raises(ValueError, match="max_tokens"):
        llm.scheduler.add(Req(list(big), greedy(4)))
    scheduler, engine = llm.scheduler, llm.engine
    assert not scheduler.has_work() and scheduler.stats.prompt_tokens == 0
    scheduler.check_integrity()
    assert engine.allocator.num_free == engine.allocator.capacity
    assert engine.table.num_free == engine.config.max_running_requests
    outs = llm.generate([ok, big], [greedy(3), greedy(3)])  # 9 + 3 = 12: exactly the pool
    assert [o.token_ids for o in outs] == [want(path, ok, 3), want(path, big, 3)]
    check_idle_and_clear(engine, scheduler, expect_cached=True)


# -- 5. random workloads -------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    """2-8 prompts cut from two random prefixes (anywhere, so families share 0..24 tokens) plus
    random suffixes, some exact repeats, max_tokens 1..10 each (the tokens come from a drawn
    seed); a pool from just the largest request (pressure is the common case) to roomy."""
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    bases = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 24))] for _ in range(2)]
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(2, 8))):
        if prompts and rng.random() < 0.25:
            prompts.append(list(rng.choice(prompts)))  # an exact repeat
            continue
        base = rng.choice(bases)
        prompt = base[:rng.randint(0, len(base))] + [
            rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 6))]
        prompts.append(prompt or [rng.randrange(3, VOCAB)])
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    page_size = draw(st.sampled_from([1, 2, 4]))
    need = one_request_pages(prompts, max_tokens, page_size)
    slack = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 4.0]))
    return dict(prompts=prompts, max_tokens=max_tokens, page_size=page_size,
                num_pages=need + int(need * slack) + 1,
                max_prefill_tokens=draw(st.sampled_from([1, 2, 3, 5, 8, 4096])),
                schedule_policy=draw(st.sampled_from(["fcfs", "lpm"])),
                cache=draw(st.sampled_from(["radix", "radix", "naive"])),
                overlap=draw(st.booleans()), mixed_steps=draw(st.booleans()))


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(work=workloads())
def test_random_workloads_match_hf(tiny_dirs: dict[str, Path], attention_backend: str,
                                   work: dict[str, Any]) -> None:
    path = tiny_dirs[LLAMA]
    prompts, max_tokens = work.pop("prompts"), work.pop("max_tokens")
    engine, scheduler, reqs, _ = run_workload(path, attention_backend, prompts, max_tokens, **work)
    check_outputs(path, reqs, f"{work} with {len(prompts)} prompts")
    check_accounting(scheduler, reqs, str(work))
    assert not scheduler.has_work()
    scheduler.check_integrity()
    assert engine.allocator.num_free + scheduler.cache.total_pages == engine.allocator.capacity
    assert_all_free(engine, scheduler)
    scheduler.close()


# -- regressions: engine bugs these tests found in 871d970 (fixed in 3cff503) ---------------------


def test_stats_count_each_prompt_once_despite_retraction_mid_prefill(
        tiny_dirs: dict[str, Path], attention_backend: str) -> None:
    """A decodes while B (10 tokens, 4 a step) prefills in a 16-page pool; A's decode runs out of
    pages, B (no output yet) is retracted mid-prefill and later re-admitted. Was: _admit took
    "cached_tokens == 0 and no output yet" for a first admission, so B's prompt was counted
    twice (prompt_tokens 24, not 14) and its own re-used chunk counted as cached."""
    path = tiny_dirs[LLAMA]
    a, b = make_prompts([4, 10], VOCAB, seed=110)
    # separate prefill and decode steps: the interleaving this regression needs
    engine = make_engine(path, attention_backend, page_size=1, num_pages=17,
                         max_prefill_tokens=4, mixed_steps=False)
    scheduler = new_scheduler(engine)
    recorder = PrefillRecorder(engine)
    reqs = submit(scheduler, [a, b], [greedy(12), greedy(2)])
    run_to_completion(scheduler, MAX_STEPS)
    check_outputs(path, reqs, "retraction mid-prefill")  # the outputs themselves are right
    assert scheduler.stats.retractions > 0
    # B's prompt was (partly) prefilled twice before its first token: retracted mid-prefill
    assert sum(n for r, n_out, _, n in recorder.entries if r is reqs[1] and n_out == 0) > len(b)
    assert scheduler.stats.cached_tokens <= scheduler.stats.prompt_tokens
    assert scheduler.stats.prompt_tokens == len(a) + len(b)
    assert reqs[1].cached_tokens == 0  # nothing was cached when it was first admitted


def test_shared_prefix_computed_once_with_chunked_prefill(tiny_dirs: dict[str, Path],
                                                          attention_backend: str) -> None:
    """Two prompts sharing 10 tokens, 7 prefill tokens a step: step 1 computes A[0:7], step 2
    A[7:11]; B must not be admitted with the 3 tokens left in step 2 (it would match only A[0:7]
    and recompute B[7:10] == A[7:10] alongside A). Was: deferral only compared B with requests
    newly admitted in the same step, not with A's continuing chunk (radix computed 15 tokens,
    the bound is 22 - 10 = 12)."""
    path = tiny_dirs[LLAMA]
    shared = make_prompts([10], VOCAB, seed=111)[0]
    prompts = [shared + [7], shared + [9]]
    computed = {}
    for cache in ("radix", "naive"):
        _, scheduler, reqs, _ = run_workload(path, attention_backend, prompts, [1, 1],
                                             page_size=1, max_prefill_tokens=7, cache=cache)
        check_outputs(path, reqs, cache)
        computed[cache] = scheduler.stats.computed_tokens
    assert computed["radix"] <= computed["naive"] - len(shared), computed


def test_request_with_cached_shared_prefix_is_not_deferred(tiny_dirs: dict[str, Path],
                                                           attention_backend: str) -> None:
    """Deferral is for prefixes not yet cached: with the shared 10 tokens already in the cache,
    two siblings start in the same step. Was: the common prefix was measured from
    req.num_computed (0 for every waiting request), so B waited a step for nothing."""
    path = tiny_dirs[LLAMA]
    shared = make_prompts([10], VOCAB, seed=112)[0]
    engine = make_engine(path, attention_backend, page_size=1)
    scheduler = new_scheduler(engine)
    submit(scheduler, [shared + [3]], greedy(1))
    run_to_completion(scheduler, MAX_STEPS)  # the shared prefix is now cached
    a, b = submit(scheduler, [shared + [7], shared + [9]], greedy(1))
    batch = scheduler.next_batch()
    assert batch is not None
    assert batch.reqs == [a, b], "b had nothing left to wait for, yet was deferred"


def test_workload_is_what_the_docstrings_say() -> None:
    """Guards the derived bounds above against edits of the prompt constants."""
    assert len(SHARED) == 21 and all(p[:21] == SHARED for p in FAMILY)
    assert FAMILY[5] == FAMILY[1] and OTHER[:1] != SHARED[:1]
    assert len(MAX_TOKENS) == len(PROMPTS) and max(MAX_TOKENS) <= MAXN
    assert torch.get_num_threads() == 1  # the autouse fixture of conftest.py
