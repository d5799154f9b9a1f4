"""Batching policies: which waiting requests to admit first. Policies are scheduler plugins."""

from __future__ import annotations

import abc

from minisgl.core.config import EngineConfig
from minisgl.core.prefix_cache import PrefixCache
from minisgl.core.request import Req


class SchedulePolicy(abc.ABC):
    """Orders the waiting queue before admission; the scheduler admits in that order."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        """Return the waiting requests in the order they should be admitted.

        ``cache`` may be queried (``cache.match(tokens)``) but must not be changed."""


class FCFSPolicy(SchedulePolicy):
    """First come, first served."""

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return list(waiting)  # arrival order; retracted requests were put back at the front


class LongestPrefixMatchPolicy(SchedulePolicy):
    """SGLang's cache-aware policy: requests with the longest cached prefix first (they are the
    cheapest to start and keep their prefix from being evicted), ties in arrival order."""

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        if not cache.reuses:
            return list(waiting)
        matched = {r.rid: cache.match(r.all_ids).length for r in waiting}
        return sorted(waiting, key=lambda r: -matched[r.rid])
