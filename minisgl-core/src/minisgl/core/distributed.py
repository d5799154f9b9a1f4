"""Tensor-parallel communication: the Communicator interface, its single-rank identity, the
torch.distributed implementation, and the control channel that keeps the ranks in lockstep.

Layers take a communicator and call it unconditionally; with one rank every collective is the
identity, so the same model code runs at TP=1 and TP=N.

Inside torch.compile (compile.py) a process group's Python calls cannot be traced, so there
``all_reduce`` and ``all_gather`` become the ops ``minisgl::tp_all_reduce`` / ``tp_all_gather``,
opaque to Inductor. They run on the communicator the calling thread has bound (``bind``; the
compiled step binds its engine's), so a graph belongs to no particular group and a cached graph
serves any engine with the same rank and shapes. While a graph is being compiled (a
warm-up step on dummy inputs, on one rank, at any time) the thread binds ``LOCAL`` instead: the
ops then act as if this rank were alone (all_reduce returns its input, all_gather repeats it), so
the shapes are right and no other rank is waited for. With nothing bound they raise.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


class Communicator:
    """Collectives over the tensor-parallel group. Subclasses implement ``_all_reduce``,
    ``_all_gather`` and ``broadcast`` for N > 1 ranks."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks (in place where possible) and return it."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return torch.ops.minisgl.tp_all_reduce(x)  # type: ignore[no-any-return]
        return self._all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return torch.ops.minisgl.tp_all_gather(x, self.world_size, dim)  # type: ignore[no-any-return]
        return self._all_gather(x, dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Make every rank's ``x`` equal to rank ``src``'s."""
        assert self.world_size == 1, "single-rank communicator used with world_size > 1"
        return x

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot all-reduce over "
                                  f"{self.world_size} ranks")

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot all-gather over "
                                  f"{self.world_size} ranks")


# -- collectives inside compiled graphs ----------------------------------------------------------

LOCAL = Communicator()  # bound while compiling: every collective acts as if alone
_bound = threading.local()


@contextlib.contextmanager
def bind(comm: Communicator) -> Iterator[None]:
    """Run the compiled collectives of this thread on ``comm`` (``LOCAL``: as if alone)."""
    previous = getattr(_bound, "comm", None)
    _bound.comm = comm
    try:
        yield
    finally:
        _bound.comm = previous


def _bound_comm(op: str) -> Communicator:
    comm: Communicator | None = getattr(_bound, "comm", None)
    if comm is None:
        raise RuntimeError(f"minisgl::{op} ran with no communicator bound to this thread "
                           "(distributed.bind)")
    return comm


@torch.library.custom_op("minisgl::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    comm = _bound_comm("tp_all_reduce")
    out = x.clone()  # the op's output must not alias its input
    return out if comm is LOCAL else comm._all_reduce(out)


@_tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("minisgl::tp_all_gather", mutates_args=())
def _tp_all_gather(x: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    comm = _bound_comm("tp_all_gather")
    if comm is LOCAL:
        return torch.cat([x] * world_size, dim=dim)
    if comm.world_size != world_size:
        raise RuntimeError(f"minisgl::tp_all_gather: graph built for {world_size} ranks, "
                           f"bound communicator has {comm.world_size}")
    return comm._all_gather(x, dim)


@_tp_all_gather.register_fake
def _(x: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


class TorchCommunicator(Communicator):
    """Collectives over a torch.distributed process group (gloo on CPU, NCCL on GPU).

    The group is an explicit object, not torch.distributed's global default group, so one process
    can hold several engines (tests, notebooks) and nothing global has to be torn down.
    """

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.group = group

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([x], opts).wait()
        return x


class ControlChannel:
    """Rank 0 -> every rank: one JSON message per scheduler iteration (never pickle).

    A fixed-size first chunk carries the length and, almost always, the whole message, so a step
    costs one small broadcast; a longer message (a batch of long prompts) follows in a second one.
    """

    CHUNK = 16384

    def __init__(self, group: Any, rank: int) -> None:
        self.group, self.rank = group, rank

    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def send(self, obj: Any) -> None:
        assert self.rank == 0, "only rank 0 sends control messages"
        data = json.dumps(obj, separators=(",", ":")).encode()
        head = torch.zeros(self.CHUNK, dtype=torch.uint8)
        head[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        first = data[: self.CHUNK - 8]
        head[8: 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._bcast(head)
        if len(data) > len(first):
            self._bcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8))

    def recv(self) -> Any:
        head = torch.empty(self.CHUNK, dtype=torch.uint8)
        self._bcast(head)
        n = int.from_bytes(bytes(head[:8].tolist()), "little")
        data = bytes(head[8: 8 + min(n, self.CHUNK - 8)].numpy())
        if n > len(data):
            rest = torch.empty(n - len(data), dtype=torch.uint8)
            self._bcast(rest)
            data += bytes(rest.numpy())
        return json.loads(data)


def connect(rank: int, world_size: int, addr: str, device: torch.device, timeout_s: float,
            dead_ranks: Callable[[], list[int]] | None = None, same_host: bool = False
            ) -> tuple[Communicator, ControlChannel]:
    """Join the group of ``world_size`` ranks that meets at ``addr`` ("host:port"; rank 0 listens).

    Tensors go through gloo (CPU) or NCCL (CUDA) with ``timeout_s`` per collective: a rank that
    dies or hangs surfaces as an error on the others instead of a hang (a dead peer is usually seen
    at once: its sockets close). Control messages use a second gloo group without a practical
    timeout, because ranks wait there while the deployment is idle.

    ``dead_ranks`` (rank 0, when it started the others): polled while waiting for them to join, so
    a rank that dies while starting fails this call at once instead of after the timeout.
    ``same_host``: every rank runs on this machine; CPU tensors then meet in shared memory
    (shm_comm.py, ~100x faster than gloo's loopback TCP for small tensors).
    """
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr: expected host:port (got {addr!r})")
    join_timeout = max(timeout_s, 60.0)
    store = dist.TCPStore(host, int(port), world_size, rank == 0,  # type: ignore[attr-defined]
                          timeout=datetime.timedelta(seconds=join_timeout), wait_for_workers=False)
    if rank == 0:
        _wait_for_ranks(store, world_size, join_timeout, dead_ranks)
    else:
        store.set(f"joined/{rank}", "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    data_store = dist.PrefixStore("data", store)  # type: ignore[attr-defined]
    group: Any
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(data_store, rank, world_size, opts)
    else:
        group = dist.ProcessGroupGloo(data_store, rank, world_size, timeout)
    control_store = dist.PrefixStore("control", store)  # type: ignore[attr-defined]
    control = dist.ProcessGroupGloo(control_store, rank, world_size, datetime.timedelta(days=30))
    comm: Communicator = TorchCommunicator(group, rank, world_size)
    if same_host and device.type == "cpu":
        from minisgl.core import shm_comm

        if shm_comm.supported():
            comm = shm_comm.ShmCommunicator.connect(comm, shm_comm.shm_tag(addr), timeout_s)
    return comm, ControlChannel(control, rank)


def _wait_for_ranks(store: Any, world_size: int, timeout_s: float,
                    dead_ranks: Callable[[], list[int]] | None) -> None:
    deadline = time.monotonic() + timeout_s
    missing = list(range(1, world_size))
    while missing:
        missing = [r for r in missing if not store.check([f"joined/{r}"])]
        dead = [r for r in (dead_ranks() if dead_ranks is not None else []) if r in missing]
        if dead:
            names = ", ".join(f"rank {r}" for r in dead)
            raise RuntimeError(f"tensor-parallel {names} exited before joining the group "
                               "(see its error output above)")
        if missing and time.monotonic() > deadline:
            names = ", ".join(f"rank {r}" for r in missing)
            raise RuntimeError(f"tensor-parallel {names} did not join within {timeout_s:.0f} s")
        if missing:
            time.sleep(0.05)
