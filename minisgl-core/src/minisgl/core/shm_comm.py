"""A shared-memory communicator for CPU ranks on one machine.

gloo sends every all-reduce through loopback TCP: ~1 ms for one token's hidden state on 2 cores,
twice per layer. Ranks that share a machine can instead meet in a shared-memory segment: each
rank copies its tensor into its own slot, bumps its arrival counter, waits until every counter has
reached the same step, and reads all slots. Every rank sums the slots in rank order, so the result
is bitwise identical on all ranks (as a collective must be).

Two slots per rank alternate by step parity. A rank writes slot ``s % 2`` at step ``s`` only after
it passed the wait of step ``s - 1``, where every rank had arrived at ``s - 1`` and therefore
finished reading step ``s - 2``, the previous user of that slot. Tensors larger than a slot go
through the wrapped torch.distributed communicator. Waiting spins briefly, then yields the core
(ranks may outnumber cores), and gives up after ``timeout_s`` (the group's per-collective
timeout, as gloo's): a rank that failed or left the step surfaces as an error, not a hang.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch

from minisgl.core.distributed import Communicator

SLOT_BYTES = 1 << 20  # per rank and parity: one token's hidden state is a few KiB
SHM_DIR = "/dev/shm"
_HEADER = 64  # bytes of one rank's arrival counter (a cache line each)


class ShmCommunicator(Communicator):
    def __init__(self, name: str, fallback: Communicator, create: bool,
                 timeout_s: float = 300.0) -> None:
        super().__init__(fallback.rank, fallback.world_size)
        self.fallback = fallback
        self.timeout_s = timeout_s
        n = self.world_size
        size = n * _HEADER + 2 * n * SLOT_BYTES
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled: every counter starts at 0
            buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._counters = [np.frombuffer(buf, dtype=np.int64, count=1, offset=r * _HEADER)
                          for r in range(n)]
        self._slots = torch.frombuffer(buf, dtype=torch.uint8, offset=n * _HEADER,
                                       count=2 * n * SLOT_BYTES).view(2, n, SLOT_BYTES)
        self._step = 0

    @classmethod
    def connect(cls, fallback: Communicator, tag: str, timeout_s: float = 300.0
                ) -> ShmCommunicator:
        """Rank 0 creates the segment, the others open it (a fallback barrier orders the two).
        The segment is unlinked as soon as everyone has it open: nothing outlives the ranks."""
        name = f"minisgl-{tag}"
        flag = torch.zeros(1)
        if fallback.rank == 0:
            comm = cls(name, fallback, create=True, timeout_s=timeout_s)
            fallback.all_reduce(flag)  # created
            fallback.all_reduce(flag)  # everyone attached
            os.unlink(comm.path)
        else:
            fallback.all_reduce(flag)
            comm = cls(name, fallback, create=False, timeout_s=timeout_s)
            fallback.all_reduce(flag)
        return comm

    def _exchange(self, x: torch.Tensor) -> torch.Tensor | None:
        """Publish ``x``; return [world, *x.shape] of every rank's tensor (views into shared
        memory, valid until this rank's next collective), or None if ``x`` does not fit."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or x.device.type != "cpu":
            return None
        self._step += 1
        slots = self._slots[self._step % 2]
        slots[self.rank, :nbytes].copy_(x.view(-1).view(torch.uint8))
        self._counters[self.rank][0] = self._step  # after the data: x86 keeps store order
        spins, deadline = 0, 0.0
        for r, c in enumerate(self._counters):
            while c[0] < self._step:
                spins += 1
                if spins > 2000:
                    time.sleep(0) if spins < 20000 else time.sleep(1e-5)
                if spins % 4096 == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(
                            f"tensor-parallel rank {r} did not reach collective {self._step} "
                            f"within {self.timeout_s:.0f} s (it failed or left the step)")
        return slots[:, :nbytes].view(x.dtype).view(self.world_size, *x.shape)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        if parts is None:
            return self.fallback.all_reduce(x)
        out = parts[0].clone()
        for r in range(1, self.world_size):  # fixed order: the same bits on every rank
            out += parts[r]
        x.copy_(out)
        return x

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        parts = self._exchange(x)
        if parts is None:
            return self.fallback.all_gather(x, dim)
        return torch.cat(list(parts.clone().unbind(0)), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        parts = self._exchange(x)
        if parts is None:
            return self.fallback.broadcast(x, src)
        if self.rank != src:
            x.copy_(parts[src])
        return x


def shm_tag(addr: str) -> str:
    """A segment name unique to one group: its rendezvous address and rank 0's host pid space."""
    return addr.replace(":", "-").replace(".", "_") + f"-{os.getuid()}"


def supported() -> bool:
    """The counters rely on x86's store ordering (data before counter); elsewhere use gloo."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)
