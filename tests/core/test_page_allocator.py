"""PageAllocator against a brute-force model (a set of free pages), plus its placement rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from minisgl.core.kv_manager import KVManager
from minisgl.core.kvcache import PageAllocator, ReqToTokenTable
from minisgl.core.prefix_cache import make_prefix_cache
from minisgl.core.request import Req
from minisgl.core.sampling_params import SamplingParams


def runs_of(free: set[int], n: int) -> list[int]:
    """Starts of every run of n free pages, ascending."""
    return [s for s in sorted(free) if all(p in free for p in range(s, s + n))]


class AllocatorMachine(RuleBasedStateMachine):
    NUM_PAGES = 24

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.free = set(range(1, self.NUM_PAGES))  # the model
        self.held: list[list[int]] = []

    @rule(n=st.integers(0, 8), after=st.one_of(st.none(), st.integers(0, NUM_PAGES + 2)),
          room=st.integers(0, 6))
    def alloc(self, n: int, after: int | None, room: int) -> None:
        before = set(self.free)
        pages = self.alloc.alloc(n, after, room)
        if n > len(before):
            assert pages is None
            event("refused")
            return
        assert pages is not None and len(pages) == n == len(set(pages))
        assert set(pages) <= before, f"{pages} were not all free"
        self.free -= set(pages)
        if n == 0:
            return
        follow = list(range(after + 1, after + 1 + n)) if after is not None and after > 0 else []
        if follow and set(follow) <= before:
            assert pages == follow, "the pages right after `after` were free"
            event("after")
        elif room and runs_of(before, n + room):
            assert pages[0] in runs_of(before, n + room) and pages == list(range(pages[0], pages[0] + n))
            event("run with room")
        elif runs_of(before, n):
            assert pages == list(range(pages[0], pages[0] + n)), "a run of n was free"
            event("run")
        else:
            assert pages == sorted(before)[:n], "no run: the lowest free pages"
            event("scattered")
        self.held.append(pages)

    @rule(i=st.integers(0, 100), k=st.integers(0, 8))
    def free_some(self, i: int, k: int) -> None:
        if not self.held:
            return
        pages = self.held[i % len(self.held)]
        out, keep = pages[:k], pages[k:]
        self.alloc.free(out)
        self.free |= set(out)
        self.held[i % len(self.held)] = keep

    @rule(i=st.integers(0, 100))
    def bad_free_changes_nothing(self, i: int) -> None:
        page = 1 + i % (self.NUM_PAGES - 1)
        if page in self.free:
            with pytest.raises(RuntimeError, match="not allocated"):
                self.alloc.free([page])
        else:  # twice in one call: refused before anything is freed
            with pytest.raises(RuntimeError, match="not allocated"):
                self.alloc.free([page, page])
        assert not self.alloc.is_free(page) or page in self.free

    @invariant()
    def agrees(self) -> None:
        assert self.alloc.num_free == len(self.free)
        assert self.alloc.free_pages() == sorted(self.free)
        assert all(self.alloc.is_free(p) == (p in self.free) for p in range(self.NUM_PAGES))


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_out_of_range_and_scratch_page_refused() -> None:
    alloc = PageAllocator(4)
    for page in (0, 4, -1):
        with pytest.raises(RuntimeError, match="not allocated"):
            alloc.free([page])
    assert alloc.num_free == 3 and 0 not in (alloc.alloc(3) or [])


def test_room_is_left_for_growth() -> None:
    alloc = PageAllocator(40)
    a = alloc.alloc(3, room=4)
    b = alloc.alloc(3, room=4)
    assert a == [1, 2, 3] and b == [8, 9, 10], "b starts past a's room"
    assert alloc.alloc(1, after=a[-1]) == [4] and alloc.alloc(2, after=b[-1]) == [11, 12]


def _req(prompt: int, max_tokens: int) -> Req:
    return Req(list(range(prompt)), SamplingParams(max_tokens=max_tokens), frozenset())


@pytest.mark.parametrize("cache", ["radix", "naive"])
def test_interleaved_decode_keeps_each_request_contiguous(cache: str) -> None:
    """Requests admitted together and decoding in lockstep take a page each in turn; a free
    list hands them out alternately (every request's pages scattered), placement with room
    keeps each request's pages in one run."""
    page, alloc = 4, PageAllocator(200)
    kv = KVManager(alloc, ReqToTokenTable(4, 256, torch.device("cpu")),
                   make_prefix_cache(cache, alloc, page), page)
    reqs = [_req(10 + 3 * i, 40) for i in range(4)]
    for r in reqs:
        assert kv.admit(r) and kv.grow(r, len(r.prompt_ids))
        r.num_computed = len(r.prompt_ids)
    for _ in range(40):
        for r in reqs:
            assert kv.grow(r, r.num_computed + 1)
            r.num_computed += 1
    for r in reqs:
        assert r.pages == list(range(r.pages[0], r.pages[0] + len(r.pages))), r.pages
        assert len(r.pages) == kv.pages_for(r.num_computed)
    spans = sorted((r.pages[0], r.pages[-1]) for r in reqs)
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), "runs overlap"


def test_growth_in_a_full_pool_evicts_a_run() -> None:
    """A pool full of cached pages: a request that grows page by page gets one run (eviction
    frees its room with the shortfall), not one page of some evicted leaf per step."""
    page, alloc = 1, PageAllocator(31)
    kv = KVManager(alloc, ReqToTokenTable(2, 64, torch.device("cpu")),
                   make_prefix_cache("radix", alloc, page), page)
    old = _req(30, 1)
    assert kv.admit(old) and kv.grow(old, 30)
    old.num_computed = 30
    kv.release(old)  # all 30 pages now cached, unlocked
    assert alloc.num_free == 0
    new = Req(list(range(100, 103)), SamplingParams(max_tokens=10), frozenset())
    assert kv.admit(new) and kv.grow(new, 3)
    new.num_computed = 3
    for _ in range(10):
        assert kv.grow(new, new.num_computed + 1)
        new.num_computed += 1
    assert new.pages == list(range(new.pages[0], new.pages[0] + 13)), new.pages
