"""Batching policies: which waiting requests to admit first. Policies are scheduler plugins."""

from __future__ import annotations

import abc

from minisgl.core.config import EngineConfig
from minisgl.core.request import Req


class SchedulePolicy(abc.ABC):
    """Orders the waiting queue before admission; the scheduler admits in that order."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def order(self, waiting: list[Req]) -> list[Req]:
        """Return the waiting requests in the order they should be admitted."""


class FCFSPolicy(SchedulePolicy):
    """First come, first served."""

    def order(self, waiting: list[Req]) -> list[Req]:
        return sorted(waiting, key=lambda r: r.rid)
