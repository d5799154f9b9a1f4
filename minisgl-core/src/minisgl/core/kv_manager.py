"""Per-request KV bookkeeping between the scheduler, the page allocator and the prefix cache.

A request's ``pages`` cover its tokens in order. The first ``num_shared`` of them belong to the
prefix cache (the request keeps them alive by locking ``handle``); the rest are its own until it
hands them to the cache (``cache_prefix``) or frees them (``release``).
"""

from __future__ import annotations

from minisgl.core.kvcache import PageAllocator, ReqToTokenTable
from minisgl.core.prefix_cache import PrefixCache
from minisgl.core.request import Req

ROOM_TOKENS = 512  # the most a request's pages leave free behind them for its own growth


class KVManager:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, cache: PrefixCache,
                 page_size: int) -> None:
        self.allocator, self.table, self.cache, self.page_size = allocator, table, cache, page_size

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now: free ones plus unlocked cached ones."""
        return self.allocator.num_free + self.cache.evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def admit(self, req: Req) -> bool:
        """Give ``req`` a table row and its longest cached prefix (locked).

        At least one token is left to compute so a fully cached prompt still yields logits.
        """
        row = self.table.alloc()
        if row is None:
            return False
        tokens = req.all_ids
        match = self.cache.match(tokens[: len(tokens) - 1])
        self.cache.lock(match.handle)
        req.table_row, req.handle = row, match.handle
        req.pages, req.num_shared = list(match.pages), len(match.pages)
        req.num_computed = match.length
        req.prefill_target = len(tokens)
        self.table.write_pages(row, 0, req.pages, self.page_size)
        return True

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Make ``req``'s pages cover ``num_tokens`` tokens, evicting cached pages if needed."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        # right after its last page where free, else with room to grow into (PageAllocator)
        after = req.pages[-1] if req.pages else None
        most = self.pages_for(min(req.max_seq_len, num_tokens + ROOM_TOKENS))
        room = max(0, most - len(req.pages) - need)
        pages = self.allocator.alloc(need, after, room)
        if pages is None:
            # evict the room too (least recently used pages, going anyway): what comes free
            # is then a run, not one page here and there for each request that grows
            self.cache.evict(need + room - self.allocator.num_free)
            pages = self.allocator.alloc(need, after, room)
            if pages is None:
                return False
        self.table.write_pages(req.table_row, len(req.pages), pages, self.page_size)
        req.pages.extend(pages)
        return True

    def cache_prefix(self, req: Req) -> None:
        """Hand the full pages of ``req``'s computed tokens to the cache and keep them locked."""
        full = req.num_computed // self.page_size
        if not self.cache.reuses or full <= req.num_shared:
            return
        tokens = req.all_ids[: full * self.page_size]
        handle = self.cache.insert(tokens, req.pages[:full])
        self.cache.lock(handle)
        if req.handle is not None:
            self.cache.unlock(req.handle)
        req.handle = handle
        # the cache may have kept its own copy of some pages and freed ours: use its page ids
        match = self.cache.match(tokens)
        assert match.length == len(tokens), "just-inserted prefix must match in full"
        req.pages[:full] = match.pages
        req.num_shared = full
        self.table.write_pages(req.table_row, 0, match.pages, self.page_size)

    def release(self, req: Req) -> None:
        """Cache what ``req`` computed (radix), free the rest, unlock, give the row back."""
        if req.table_row < 0:
            return
        self.cache_prefix(req)
        own = req.pages[req.num_shared:]
        if own:
            self.allocator.free(own)
        if req.handle is not None:
            self.cache.unlock(req.handle)
        self.table.free(req.table_row)
        req.pages, req.num_shared, req.handle, req.table_row = [], 0, None, -1

    def held_pages(self, reqs: list[Req]) -> list[int]:
        """Pages running requests own exclusively (for ``PrefixCache.check_integrity``)."""
        return [p for r in reqs for p in r.pages[r.num_shared:]]
