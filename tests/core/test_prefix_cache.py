"""RadixCache / NaiveCache against a brute-force model of the cache, plus targeted unit tests."""

from __future__ import annotations

import unittest
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.core.kvcache import PageAllocator
from minisgl.core.prefix_cache import (
    CacheNode,
    Handle,
    NaiveCache,
    PrefixCache,
    RadixCache,
    make_prefix_cache,
)

Tokens = tuple[int, ...]


# -- the brute-force reference ------------------------------------------------------------------


class RefCache:
    """Every cached whole-page prefix -> (its last page's id, last use). Prefix-closed, like a tree;
    answers every question by scanning all entries."""

    def __init__(self, page_size: int) -> None:
        self.size = page_size
        self.pages: dict[Tokens, int] = {}
        self.time: dict[Tokens, int] = {}
        self.clock = 0

    def prefixes(self, tokens: Sequence[int]) -> list[Tokens]:
        return [tuple(tokens[:k * self.size]) for k in range(1, len(tokens) // self.size + 1)]

    def match(self, tokens: Sequence[int]) -> list[int]:
        self.clock += 1
        out = []
        for key in self.prefixes(tokens):
            if key not in self.pages:
                break
            out.append(self.pages[key])
            self.time[key] = self.clock
        return out

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Returns the caller's pages that duplicate cached ones (the cache frees those)."""
        self.clock += 1
        duplicates = []
        for key, page in zip(self.prefixes(tokens), pages):
            if self.pages.setdefault(key, page) != page:
                duplicates.append(page)
            self.time[key] = self.clock
        return duplicates

    def is_leaf(self, key: Tokens) -> bool:
        return not any(len(k) > len(key) and k[:len(key)] == key for k in self.pages)

    def evict(self, n: int, locked: set[Tokens]) -> list[int]:
        freed: list[int] = []
        while len(freed) < n:
            leaves = [k for k in self.pages if k not in locked and self.is_leaf(k)]
            if not leaves:
                break
            times = sorted(self.time[k] for k in leaves)
            assert len(times) < 2 or times[0] < times[1], "LRU tie: the model is ambiguous"
            key = min(leaves, key=self.time.__getitem__)
            freed.append(self.pages.pop(key))
            del self.time[key]
        return freed


def tree_contents(cache: RadixCache) -> dict[Tokens, int]:
    """The cache's tree flattened into the reference's shape: prefix -> its last page."""
    out: dict[Tokens, int] = {}
    stack: list[tuple[Tokens, CacheNode]] = [((), cache._root)]
    while stack:
        prefix, node = stack.pop()
        for i, page in enumerate(node.pages):
            out[prefix + node.key[:(i + 1) * cache.page_size]] = page
        stack.extend((prefix + node.key, child) for child in node.children.values())
    return out


# -- random operations, as the scheduler would do them ------------------------------------------

BASES = [[0] * 24, [0, 1, 2, 3] * 6, [1, 2] * 12, [3, 2, 1, 0, 0, 1] * 4]


@st.composite
def prompts(draw: st.DrawFn, max_len: int) -> list[int]:
    """Shared stems with random tails: prefixes collide often and diverge anywhere."""
    base = draw(st.sampled_from(BASES))
    cut = draw(st.integers(0, max_len))
    tail = draw(st.lists(st.integers(0, 3), max_size=min(3, max_len - cut)))
    return (base[:cut] + tail)[:max_len] or [0]


@dataclass
class SimReq:
    tokens: list[int]
    pages: list[int]  # one per started page; pages[:cached] belong to the cache (locked)
    cached: int
    handle: Handle


class CacheMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    NUM_PAGES = 12
    MAX_LEN = 10
    MAX_REQS = 3

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.cache = RadixCache(self.alloc, self.PAGE_SIZE)
        self.ref = RefCache(self.PAGE_SIZE)
        self.reqs: list[SimReq] = []

    # helpers
    def locked(self) -> set[Tokens]:
        return {k for r in self.reqs for k in self.ref.prefixes(r.tokens[:r.cached * self.PAGE_SIZE])}

    def match(self, tokens: list[int]) -> Handle:
        want, got = self.ref.match(tokens), self.cache.match(tokens)
        assert got.length == len(want) * self.PAGE_SIZE
        assert got.pages == want and handle_pages(got.handle) == want
        return got.handle

    def evict(self, n: int) -> None:
        want = self.ref.evict(n, self.locked())
        assert self.cache.evict(n) == len(want)
        event("evicted some pages" if want else "evicted nothing")
        assert all(self.alloc.is_free(p) for p in want)

    def alloc_pages(self, n: int) -> list[int] | None:
        pages = self.alloc.alloc(n)
        if pages is None:  # pool exhausted: evict the shortfall, then retry once
            event("pool exhausted")
            self.evict(n - self.alloc.num_free)
            pages = self.alloc.alloc(n)
        return pages

    def pick(self, i: int) -> SimReq:
        return self.reqs[i % len(self.reqs)]

    def checkpoint(self, req: SimReq) -> None:
        """Insert the request's whole pages and move its lock to their end (it may go on)."""
        full = len(req.tokens) // self.PAGE_SIZE
        tokens, pages = req.tokens[:full * self.PAGE_SIZE], req.pages[:full]
        duplicates = self.ref.insert(tokens, pages)
        handle = self.cache.insert(tokens, pages)
        assert all(self.alloc.is_free(p) for p in duplicates)
        event("duplicate pages freed" if duplicates else "no duplicates")
        self.cache.lock(handle)
        self.cache.unlock(req.handle)
        req.cached, req.handle = full, handle
        assert self.match(tokens) is handle
        req.pages[:full] = self.ref.match(tokens)  # the cache's copies replace duplicates

    # rules
    @precondition(lambda self: len(self.reqs) < self.MAX_REQS)
    @rule(data=st.data(), twins=st.booleans())
    def start(self, data: st.DataObject, twins: bool) -> None:
        tokens = data.draw(prompts(self.MAX_LEN))
        self.start_one(tokens)
        if twins:  # the same prompt twice before either is cached: duplicate pages at insert
            self.start_one(tokens)

    def start_one(self, tokens: list[int]) -> None:
        handle = self.match(tokens)
        event("start: prefix hit" if handle is not self.cache._root else "start: miss")
        self.cache.lock(handle)
        matched = handle_pages(handle)
        req = SimReq(tokens, matched, len(matched), handle)
        self.reqs.append(req)  # before allocating: its lock must protect the match from eviction
        fresh = self.alloc_pages(-(-len(tokens) // self.PAGE_SIZE) - len(matched))
        if fresh is None:
            self.cache.unlock(handle)
            self.reqs.remove(req)
            return
        req.pages = matched + fresh

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 99), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, i: int, new: list[int]) -> None:
        req = self.pick(i)
        tokens = req.tokens + new
        more = self.alloc_pages(-(-len(tokens) // self.PAGE_SIZE) - len(req.pages))
        if more is not None:
            req.tokens, req.pages = tokens, req.pages + more

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 99))
    def cache_unfinished(self, i: int) -> None:
        self.checkpoint(self.pick(i))

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 99), abort=st.booleans())
    def finish(self, i: int, abort: bool) -> None:
        req = self.pick(i)
        if not abort:
            self.checkpoint(req)
        self.cache.unlock(req.handle)
        self.alloc.free(req.pages[req.cached:])
        self.reqs.remove(req)

    @rule(n=st.integers(0, 8))
    def evict_some(self, n: int) -> None:
        self.evict(n)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        self.match(data.draw(prompts(self.MAX_LEN + 4)))

    @precondition(lambda self: not self.reqs)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref = RefCache(self.PAGE_SIZE)

    @invariant()
    def consistent(self) -> None:
        held = [p for r in self.reqs for p in r.pages[r.cached:]]
        self.cache.check_integrity(held)
        assert tree_contents(self.cache) == self.ref.pages
        assert self.cache.total_pages == len(self.ref.pages)
        assert self.cache.evictable_pages == len(self.ref.pages) - len(self.locked())


def handle_pages(handle: Handle) -> list[int]:
    chain: list[int] = []
    node: CacheNode | None = handle
    while node is not None:
        chain[:0] = node.pages
        node = node.parent
    return chain


def machine_test(page_size: int, num_pages: int, max_len: int) -> type[unittest.TestCase]:
    @settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True)
    class Machine(CacheMachine):
        PAGE_SIZE, NUM_PAGES, MAX_LEN = page_size, num_pages, max_len

    Machine.__name__ = Machine.__qualname__ = f"CacheMachinePage{page_size}"
    return Machine.TestCase


TestRadixPage1 = machine_test(page_size=1, num_pages=16, max_len=10)
TestRadixPage2 = machine_test(page_size=2, num_pages=12, max_len=12)
TestRadixPage4 = machine_test(page_size=4, num_pages=10, max_len=18)


# -- unit tests ---------------------------------------------------------------------------------


def radix(page_size: int, num_pages: int = 16) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(alloc, page_size), alloc


def put(cache: PrefixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """Insert ``tokens`` (whole pages) with fresh pages; returns the pages given."""
    pages = alloc.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    cache.insert(tokens, pages)
    return pages


def test_split_inside_a_node_at_a_page_boundary() -> None:
    cache, alloc = radix(page_size=2)
    a, b, c = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 9, 9])
    assert (m.pages, m.length) == ([a, b], 4)
    assert [n.key for n in cache._root.children.values()] == [(1, 2, 3, 4)]
    assert handle_pages(m.handle) == [a, b] and [n.key for n in m.handle.children.values()] == [(5, 6)]
    # diverging inside a page: that page never matches, the split lands on the page before it
    m = cache.match([1, 2, 3, 9])
    assert (m.pages, m.length) == ([a], 2)
    d = put(cache, alloc, [1, 2, 3, 4, 7, 8])
    assert cache.total_pages == 4 and cache.match([1, 2, 3, 4, 7, 8]).pages == [a, b, d[2]]
    assert alloc.is_free(d[0]) and alloc.is_free(d[1])  # duplicates went back to the pool
    cache.check_integrity()


def test_a_fully_cached_prompt_matches_entirely() -> None:
    cache, alloc = radix(page_size=2)
    pages = put(cache, alloc, [5, 6, 7, 8])
    assert cache.match([5, 6, 7, 8]).length == 4  # the scheduler backs off one page itself
    assert cache.match([5, 6, 7, 8, 9]).pages == pages
    assert cache.match([5, 6, 7]).pages == pages[:1]
    assert cache.match([]).length == 0


def test_insert_of_matched_pages_keeps_them() -> None:
    cache, alloc = radix(page_size=1)
    put(cache, alloc, [1, 2])
    m = cache.match([1, 2, 3])
    cache.lock(m.handle)
    new = alloc.alloc(1)
    assert new is not None
    handle = cache.insert([1, 2, 3], m.pages + new)
    cache.check_integrity()  # nothing freed twice, nothing leaked
    assert handle_pages(handle) == m.pages + new
    cache.unlock(m.handle)


def test_locked_paths_are_never_evicted() -> None:
    cache, alloc = radix(page_size=1)
    kept = put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 9, 9])
    m = cache.match([1, 2, 3])
    cache.lock(m.handle)
    assert cache.evictable_pages == 2
    assert cache.evict(100) == 2
    assert cache.match([1, 2, 3, 4]).pages == kept and cache.match([1, 2, 9]).length == 2
    cache.unlock(m.handle)
    assert cache.evict(100) == 3 and cache.total_pages == 0
    cache.check_integrity()


def test_least_recently_used_leaf_goes_first() -> None:
    cache, alloc = radix(page_size=1)
    put(cache, alloc, [1, 1])
    put(cache, alloc, [2, 2])
    put(cache, alloc, [3, 3])
    cache.match([1, 1])  # now [2, 2] is the oldest
    assert cache.evict(2) == 2
    assert cache.match([2, 2]).length == 0
    assert cache.match([1, 1]).length == 2 and cache.match([3, 3]).length == 2
    # a parent becomes a leaf once its children are gone, and competes by its own age
    put(cache, alloc, [1, 1, 5])
    assert cache.evict(3) == 3 and cache.match([3, 3]).length == 0


def test_a_partly_evicted_leaf_keeps_its_age() -> None:
    cache, alloc = radix(page_size=1)
    put(cache, alloc, [5, 5])
    m = cache.match([5, 5])
    cache.lock(m.handle)
    put(cache, alloc, [1, 1, 1])  # younger than [5, 5]
    assert cache.evict(1) == 1  # only [1, 1, 1] is unlocked: its last page goes
    cache.unlock(m.handle)
    assert cache.evict(2) == 2  # [5, 5] is now the oldest leaf
    assert cache.match([5, 5]).length == 0 and cache.match([1, 1]).length == 2


def test_eviction_with_pages_larger_than_one_frees_whole_pages() -> None:
    cache, alloc = radix(page_size=4)
    pages = put(cache, alloc, list(range(12)))
    free = alloc.num_free
    assert cache.evict(1) == 1 and alloc.num_free == free + 1
    assert alloc.is_free(pages[2])
    assert cache.match(list(range(12))).pages == pages[:2]
    assert cache.evict(0) == 0
    cache.check_integrity()


def test_reset_frees_everything() -> None:
    cache, alloc = radix(page_size=2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    m = cache.match([1, 2])
    cache.lock(m.handle)
    with pytest.raises(RuntimeError, match="lock"):
        cache.reset()
    cache.unlock(m.handle)
    cache.reset()
    assert alloc.num_free == alloc.capacity and cache.total_pages == 0
    assert cache.match([1, 2]).length == 0
    with pytest.raises(ValueError, match="stale"):
        cache.lock(m.handle)
    cache.check_integrity()


def test_misuse_is_refused() -> None:
    cache, alloc = radix(page_size=2)
    put(cache, alloc, [1, 2, 3, 4])
    m = cache.match([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(m.handle)
    with pytest.raises(ValueError, match="3 tokens"):
        cache.insert([1, 2, 3], [7, 8])
    cache.evict(2)
    with pytest.raises(ValueError, match="stale"):
        cache.lock(m.handle)


def corrupt_free_and_cached(cache: RadixCache, alloc: PageAllocator) -> None:
    alloc.free([cache.match([1, 2]).pages[0]])


def corrupt_page_in_two_nodes(cache: RadixCache, alloc: PageAllocator) -> None:
    x, y = (n for n in cache._root.children.values())
    alloc.free([y.pages[0]])  # keep the pool's count right: only the duplicate is wrong
    y.pages[0] = x.pages[0]


def corrupt_leak(cache: RadixCache, alloc: PageAllocator) -> None:
    alloc.alloc(1)


def corrupt_ref_below_child(cache: RadixCache, alloc: PageAllocator) -> None:
    node = cache.match([1, 2, 3]).handle
    node.ref = 1
    cache._evictable -= 1


def corrupt_negative_ref(cache: RadixCache, alloc: PageAllocator) -> None:
    cache.match([7]).handle.ref = -1


def corrupt_key_length(cache: RadixCache, alloc: PageAllocator) -> None:
    node = cache.match([1, 2, 3]).handle
    node.key = node.key[:-1]


def corrupt_count(cache: RadixCache, alloc: PageAllocator) -> None:
    cache._total += 1


@pytest.mark.parametrize("corrupt", [corrupt_free_and_cached, corrupt_page_in_two_nodes,
                                     corrupt_leak, corrupt_ref_below_child, corrupt_negative_ref,
                                     corrupt_key_length, corrupt_count])
def test_check_integrity_catches_corruption(
        corrupt: Callable[[RadixCache, PageAllocator], None]) -> None:
    cache, alloc = radix(page_size=1)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [7, 8])
    cache.match([1, 2])  # split, so [1, 2] and [3, 4] are separate nodes
    cache.check_integrity()
    corrupt(cache, alloc)
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_check_integrity_knows_held_pages() -> None:
    cache, alloc = radix(page_size=1)
    held = alloc.alloc(2)
    assert held is not None
    cache.check_integrity(held)
    with pytest.raises(AssertionError, match="leaked"):
        cache.check_integrity(held[:1])
    with pytest.raises(AssertionError, match="also"):
        cache.check_integrity(held + held[:1])


def test_naive_cache_reuses_nothing() -> None:
    alloc = PageAllocator(8)
    cache = make_prefix_cache("naive", alloc, 2)
    assert isinstance(cache, NaiveCache)
    pages = put(cache, alloc, [1, 2, 3, 4])
    assert all(alloc.is_free(p) for p in pages) and alloc.num_free == alloc.capacity
    m = cache.match([1, 2, 3, 4])
    assert (m.pages, m.length) == ([], 0)
    cache.lock(m.handle)
    assert cache.evict(4) == 0 and cache.total_pages == cache.evictable_pages == 0
    cache.check_integrity()
    cache.unlock(m.handle)
    cache.reset()
    cache.check_integrity()


def test_make_prefix_cache() -> None:
    alloc = PageAllocator(4)
    assert isinstance(make_prefix_cache("radix", alloc, 1), RadixCache)
    with pytest.raises(ValueError, match=r"cache: .*'lru'.*naive, radix"):
        make_prefix_cache("lru", alloc, 1)
    with pytest.raises(ValueError, match="page_size"):
        make_prefix_cache("radix", alloc, 0)
