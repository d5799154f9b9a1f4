"""Collectives of the TP communicators (gloo and shared memory) across real processes.

Each rank computes what every collective must return from its own knowledge of all ranks' inputs
(they are drawn from seeds, so each rank can redraw the others') in float64, and checks the
result, plus that the all-reduced bits are identical on every rank (hashes compared through the
control channel's JSON).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
import traceback
from typing import Any

import pytest
import torch

from minisgl.core import shm_comm
from minisgl.core.child import free_addr
from minisgl.core.distributed import LOCAL, Communicator, bind, connect

WORLD = 3


def _inputs(rank: int, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _rank_main(rank: int, addr: str, same_host: bool, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        comm, channel = connect(rank, WORLD, addr, torch.device("cpu"), 60.0,
                                same_host=same_host)
        kinds = []
        # many steps: both shared-memory slot parities, small and (fallback) large tensors
        shapes = [(1, 64), (7, 33), (3,), (300, 1024)]  # the last is 1.2 MB: over a slot
        for step in range(24):
            shape = shapes[step % len(shapes)]
            dtype = torch.bfloat16 if step % 3 == 0 else torch.float32
            x = _inputs(rank, step, shape, dtype)
            want = sum(_inputs(r, step, shape, dtype).double() for r in range(WORLD))
            got = comm.all_reduce(x.clone())
            tol = 0.05 if dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(got.double(), want, atol=tol, rtol=tol), (step, shape)
            digest = hashlib.sha256(got.float().numpy().tobytes()).hexdigest()
            if rank == 0:
                channel.send([digest])
            else:
                assert channel.recv() == [digest], f"ranks disagree at step {step}"
            gathered = comm.all_gather(x.clone(), dim=-1)
            assert torch.equal(gathered, torch.cat([_inputs(r, step, shape, dtype)
                                                    for r in range(WORLD)], dim=-1))
            src = step % WORLD
            b = comm.broadcast(x.clone(), src=src)
            assert torch.equal(b, _inputs(src, step, shape, dtype))
        kinds.append(type(comm).__name__)
        out.put((rank, "ok", kinds))
    except BaseException:
        out.put((rank, traceback.format_exc(), []))


@pytest.mark.parametrize("same_host", [False, True], ids=["gloo", "shared-memory"])
def test_collectives_across_processes(same_host: bool) -> None:
    if same_host and not shm_comm.supported():
        pytest.skip("shared-memory collectives need x86 and /dev/shm")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_addr()
    procs = [ctx.Process(target=_rank_main, args=(r, addr, same_host, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    failed = [f"rank {rank}:\n{status}" for rank, status, _ in sorted(results) if status != "ok"]
    assert not failed, "\n".join(failed)
    for _, _, kinds in results:
        assert kinds == ["ShmCommunicator" if same_host else "TorchCommunicator"]


def _skipping_rank_main(rank: int, addr: str, same_host: bool, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        comm, channel = connect(rank, 2, addr, torch.device("cpu"), 3.0, same_host=same_host)
        comm.all_reduce(torch.ones(4))  # both ranks: fine
        if rank == 0:
            start = time.monotonic()
            try:
                comm.all_reduce(torch.ones(4))  # rank 1 never comes
            except RuntimeError as e:
                out.put((rank, "raised", str(e), time.monotonic() - start))
            else:
                out.put((rank, "returned", "", time.monotonic() - start))
        channel.send(["done"]) if rank == 0 else channel.recv()  # rank 1 waits here meanwhile
        out.put((rank, "ok", "", 0.0)) if rank else None
    except BaseException:
        out.put((rank, traceback.format_exc(), "", 0.0))


@pytest.mark.parametrize("same_host", [False, True], ids=["gloo", "shared-memory"])
def test_collective_a_rank_skips_fails_within_the_timeout(same_host: bool) -> None:
    """A rank that raised mid-step never reaches the step's next collective: the others get a
    RuntimeError after the group's timeout (3 s here), not a wait without end."""
    if same_host and not shm_comm.supported():
        pytest.skip("shared-memory collectives need x86 and /dev/shm")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_addr()
    procs = [ctx.Process(target=_skipping_rank_main, args=(r, addr, same_host, out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    (_, status0, msg, waited), (_, status1, _, _) = results
    assert status0 == "raised", status0
    assert status1 == "ok", status1
    assert 2.5 < waited < 30, waited
    if same_host:
        assert "rank 1 did not reach collective 2 within 3 s" in msg, msg


# -- collectives inside torch.compile --------------------------------------------------------


def _layer(comm: Any, x: torch.Tensor) -> torch.Tensor:
    """What a row-parallel layer and a vocab-parallel head do: reduce, then gather."""
    y = comm.all_reduce(x * 2.0) + 1.0
    return comm.all_gather(y.relu(), dim=-1)


def _compiled_rank_main(rank: int, addr: str, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        comm, _ = connect(rank, 2, addr, torch.device("cpu"), 60.0, same_host=True)
        layer = torch.compile(_layer, fullgraph=True, dynamic=True)  # fullgraph: no graph break
        for step, rows in enumerate((3, 5, 3)):
            x = _inputs(rank, step, (rows, 8), torch.float32)
            xs = [_inputs(r, step, (rows, 8), torch.float32).double() for r in range(2)]
            want = torch.cat([(sum(2.0 * v for v in xs) + 1.0).relu()] * 2, dim=-1)
            with bind(comm):
                got = layer(comm, x)
            assert torch.allclose(got.double(), want, atol=1e-5), step
            with bind(LOCAL):  # as while compiling: this rank alone, no other rank waited for
                alone = layer(comm, x)
            assert torch.allclose(alone, torch.cat([(2.0 * x + 1.0).relu()] * 2, dim=-1))
        out.put((rank, "ok"))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_compiled_collectives_across_processes() -> None:
    """A compiled function with an all-reduce and an all-gather in its graph, at two ranks:
    bound to the group it computes the float64 reference; bound to LOCAL each rank runs it
    alone (the other rank never joins those calls, so a real collective there would hang)."""
    if not shm_comm.supported():
        pytest.skip("shared-memory collectives need x86 and /dev/shm")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_addr()
    procs = [ctx.Process(target=_compiled_rank_main, args=(r, addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    failed = [f"rank {rank}:\n{status}" for rank, status in sorted(results) if status != "ok"]
    assert not failed, "\n".join(failed)


def test_compiled_collectives_need_a_bound_communicator() -> None:
    x = torch.arange(6.0).view(2, 3)
    with pytest.raises(RuntimeError, match="no communicator bound"):
        torch.ops.minisgl.tp_all_reduce(x)
    with bind(LOCAL):
        y = torch.ops.minisgl.tp_all_reduce(x)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # a copy, never an alias
        assert torch.equal(torch.ops.minisgl.tp_all_gather(x, 3, 0), torch.cat([x] * 3))
    with bind(Communicator(0, 2)), pytest.raises(RuntimeError, match="graph built for 3 ranks"):
        torch.ops.minisgl.tp_all_gather(x, 3, -1)
    with pytest.raises(RuntimeError, match="no communicator bound"):  # unbound again on exit
        torch.ops.minisgl.tp_all_gather(x, 2, -1)
