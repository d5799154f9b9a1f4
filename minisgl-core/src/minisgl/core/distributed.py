"""The Communicator interface for tensor parallelism, and its single-rank implementation.

Layers take a communicator and call it unconditionally; with one rank every collective is the
identity, so the same model code runs at TP=1 and TP=N.
"""

from __future__ import annotations

import torch


class Communicator:
    """Collectives over the tensor-parallel group. Subclasses implement them for N > 1 ranks."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks (in place where possible) and return it."""
        assert self.world_size == 1, "single-rank communicator used with world_size > 1"
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
        assert self.world_size == 1, "single-rank communicator used with world_size > 1"
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Make every rank's ``x`` equal to rank ``src``'s."""
        assert self.world_size == 1, "single-rank communicator used with world_size > 1"
        return x
