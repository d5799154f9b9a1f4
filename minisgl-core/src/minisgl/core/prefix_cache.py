"""Prefix caches: which KV pages hold which token prefixes, so requests sharing a prefix reuse them.

Page-granular: only whole pages are cached or matched; a partial last page stays private to its
request (its free slots will still be written). The cache owns the pages it holds. Requests keep
the pages they read alive by locking the path to a node (ref counts); unlocked leaves are evicted,
least recently used first. ``check_integrity`` verifies every invariant at any time (for tests).
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from minisgl.core.kvcache import PageAllocator

Tokens = tuple[int, ...]


@dataclass(eq=False)
class CacheNode:
    """A run of whole pages in the tree; also the handle callers lock and unlock."""

    key: Tokens  # the tokens whose K/V the pages hold, len(key) == len(pages) * page_size
    pages: list[int]
    parent: CacheNode | None
    uid: int  # creation order: a total order for heap ties
    children: dict[Tokens, CacheNode] = field(default_factory=dict)  # by first page of tokens
    ref: int = 0
    last_used: int = 0


Handle = CacheNode


@dataclass(frozen=True)
class MatchResult:
    pages: list[int]
    length: int  # tokens covered: len(pages) * page_size
    handle: Handle


class PrefixCache(abc.ABC):
    reuses = True  # False: inserting frees the pages (no reuse), so never insert a live prefix
    """Owns the KV pages of cached token prefixes; see the module docstring."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.allocator, self.page_size = allocator, page_size
        self._uids = itertools.count()
        self._root = self._new_node((), [], None)
        self._total = self._evictable = 0

    @abc.abstractmethod
    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages; refreshes its LRU time. No lock."""

    @abc.abstractmethod
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> Handle:
        """Hand ``pages`` (holding ``tokens``) to the cache; returns the node ending at len(tokens)."""

    @abc.abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages, LRU first; returns how many were freed."""

    @property
    def total_pages(self) -> int:
        return self._total

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    def lock(self, handle: Handle) -> None:
        for node in self._path(handle):
            if node.ref == 0:
                self._evictable -= len(node.pages)
            node.ref += 1

    def unlock(self, handle: Handle) -> None:
        path = self._path(handle)
        if handle.ref <= 0:  # parents' refs are >= the handle's, so checking it suffices
            raise RuntimeError("unlock: the handle is not locked")
        for node in path:
            node.ref -= 1
            if node.ref == 0:
                self._evictable += len(node.pages)

    def reset(self) -> None:
        if self._root.ref:
            raise RuntimeError(f"reset: {self._root.ref} lock(s) still held")
        self.allocator.free([p for node in self._nodes() for p in node.pages])
        self._root = self._new_node((), [], None)  # old handles now lead to a stale root
        self._total = self._evictable = 0

    # -- helpers shared by the implementations ------------------------------------------------
    def _new_node(self, key: Tokens, pages: list[int], parent: CacheNode | None) -> CacheNode:
        return CacheNode(key, pages, parent, next(self._uids))

    def _path(self, handle: Handle) -> list[CacheNode]:
        """handle, its parent, ..., root; refuses handles of evicted nodes or from before reset."""
        path: list[CacheNode] = []
        node: CacheNode | None = handle
        while node is not None:
            path.append(node)
            node = node.parent
        if path[-1] is not self._root:
            raise ValueError("stale handle: its node was evicted or the cache was reset")
        return path

    def _nodes(self) -> Iterator[CacheNode]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_insert(self, tokens: Tokens, pages: Sequence[int]) -> None:
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(tokens)} tokens do not fill {len(pages)} pages of "
                             f"{self.page_size}")

    # -- invariants -------------------------------------------------------------------------
    def check_integrity(self, held: Iterable[int] = ()) -> None:
        """Every page 1.. is exactly one of: free, in ``held``, in one node; the tree is sound."""
        owner: dict[int, str] = {}
        num_pages = self.allocator.num_pages

        def claim(page: int, who: str) -> None:
            assert 0 < page < num_pages, f"page {page} ({who}) is outside 1..{num_pages - 1}"
            assert page not in owner, f"page {page} is {who} and also {owner[page]}"
            owner[page] = who

        for p in self.allocator.free_pages():
            claim(p, "free")
        for p in held:
            claim(p, "held by a request")
        total = evictable = 0
        for node in self._nodes():
            self._check_node(node)
            for p in node.pages:
                claim(p, f"cached in node {node.uid}")
            total += len(node.pages)
            evictable += 0 if node.ref else len(node.pages)
        leaked = sorted(set(range(1, num_pages)) - owner.keys())
        assert not leaked, f"pages {leaked} leaked: neither free, held nor cached"
        assert total == self._total, f"total_pages is {self._total}, recount {total}"
        assert evictable == self._evictable, f"evictable_pages is {self._evictable}, recount {evictable}"

    def _check_node(self, node: CacheNode) -> None:
        size, name = self.page_size, f"node {node.uid}"
        assert node.ref >= 0, f"{name} has ref count {node.ref}"
        for first, child in node.children.items():
            assert child.parent is node, f"node {child.uid} is listed under {name}, not its parent"
            assert child.key[:size] == first, f"node {child.uid} is filed under a wrong first page"
            assert node.ref >= child.ref, \
                f"{name} has ref {node.ref} below its child {child.uid}'s {child.ref}"
        if node is self._root:
            assert not node.key and not node.pages and node.parent is None, "root is not empty"
            return
        assert node.pages, f"{name} is empty"
        assert len(node.key) == len(node.pages) * size, \
            f"{name} has {len(node.key)} tokens for {len(node.pages)} pages of {size}"
        assert node.parent is not None and node.parent.children.get(node.key[:size]) is node, \
            f"{name} is not reachable from its parent"


class RadixCache(PrefixCache):
    """Radix tree over token pages (RadixAttention); LRU by a counter, for determinism."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self._clock = itertools.count(1)

    def match(self, tokens: Sequence[int]) -> MatchResult:
        toks, size, now = tuple(tokens), self.page_size, next(self._clock)
        node, pos, pages = self._root, 0, []
        while (child := node.children.get(toks[pos:pos + size])) is not None:
            n = self._common_pages(child.key, toks, pos)
            if n < len(child.pages):  # the handle must end exactly where the match does
                child = self._split(child, n)
            child.last_used = now
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return MatchResult(pages, pos, node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> Handle:
        toks, size, now = tuple(tokens), self.page_size, next(self._clock)
        self._check_insert(toks, pages)
        node, i, duplicates = self._root, 0, []
        while i < len(pages):
            child = node.children.get(toks[i * size:(i + 1) * size])
            if child is None:
                child = self._adopt(node, toks[i * size:], list(pages[i:]))
                i = len(pages)
            else:
                n = self._common_pages(child.key, toks, i * size)
                if n < len(child.pages):
                    child = self._split(child, n)
                duplicates += [p for p, q in zip(pages[i:i + n], child.pages) if p != q]
                i += n
            child.last_used = now
            node = child
        self.allocator.free(duplicates)  # same tokens computed twice: keep the cached copy
        return node

    def evict(self, num_pages: int) -> int:
        # A full scan per call: eviction runs only when the pool is short, and it keeps no index.
        heap = [(n.last_used, n.uid, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[2]
            keep = len(leaf.pages) - (num_pages - freed)
            if keep > 0:  # free only the tail; the split-off head stays cached
                self._split(leaf, keep)
            parent = leaf.parent
            assert parent is not None
            freed += self._remove_leaf(leaf)
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_used, parent.uid, parent))
        return freed

    def _common_pages(self, key: Tokens, toks: Tokens, pos: int) -> int:
        """Whole pages ``key`` shares with ``toks[pos:]``."""
        limit, i = min(len(key), len(toks) - pos), 0
        while i < limit and key[i] == toks[pos + i]:
            i += 1
        return i // self.page_size

    def _split(self, node: CacheNode, n: int) -> CacheNode:
        """Cut ``node`` after ``n`` pages. A new head node takes its place, so handles to
        ``node`` keep meaning "the path down to its last token"."""
        parent, cut = node.parent, n * self.page_size
        assert parent is not None and 0 < n < len(node.pages)
        head = self._new_node(node.key[:cut], node.pages[:n], parent)
        head.ref, head.last_used = node.ref, node.last_used
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n:], head
        head.children[node.key[:self.page_size]] = node
        parent.children[head.key[:self.page_size]] = head
        return head

    def _adopt(self, parent: CacheNode, key: Tokens, pages: list[int]) -> CacheNode:
        node = self._new_node(key, pages, parent)
        parent.children[key[:self.page_size]] = node
        self._total += len(pages)
        self._evictable += len(pages)
        return node

    def _remove_leaf(self, leaf: CacheNode) -> int:
        assert leaf.parent is not None
        del leaf.parent.children[leaf.key[:self.page_size]]
        leaf.parent = None  # its handle is stale from now on
        self.allocator.free(leaf.pages)
        self._total -= len(leaf.pages)
        self._evictable -= len(leaf.pages)
        return len(leaf.pages)

    def _is_evictable_leaf(self, node: CacheNode) -> bool:
        return node is not self._root and not node.children and node.ref == 0


class NaiveCache(PrefixCache):
    reuses = False
    """No reuse: nothing is ever cached; inserted pages go straight back to the allocator."""

    def match(self, tokens: Sequence[int]) -> MatchResult:
        return MatchResult([], 0, self._root)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> Handle:
        self._check_insert(tuple(tokens), pages)
        self.allocator.free(list(pages))
        return self._root

    def evict(self, num_pages: int) -> int:
        return 0


_KINDS: dict[str, type[PrefixCache]] = {"radix": RadixCache, "naive": NaiveCache}


def make_prefix_cache(kind: str, allocator: PageAllocator, page_size: int) -> PrefixCache:
    if kind not in _KINDS:
        raise ValueError(f"cache: unknown kind {kind!r}; allowed: {', '.join(sorted(_KINDS))}")
    return _KINDS[kind](allocator, page_size)
