"""Collectives of the TP communicators (gloo and shared memory) across real processes.

Each rank computes what every collective must return from its own knowledge of all ranks' inputs
(they are drawn from seeds, so each rank can redraw the others') in float64, and checks the
result, plus that the all-reduced bits are identical on every rank (hashes compared through the
control channel's JSON).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import traceback
from typing import Any

import pytest
import torch

from minisgl.core import shm_comm
from minisgl.core.distributed import connect
from minisgl.core.tp import free_addr

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
