"""The C++ CPU kernels (minisgl.backends.cpu_kernels) against float64 references.

Attention directly (prefill, extend, decode, split-K, GQA ratios, head dims, keys in scattered
slots) and through the torch backend on a paged pool (run_case), where the backend must pick the
kernel; the PyTorch path it falls back to is the one test_attention_conformance checks in float32.
The bf16 and int8 linear kernels directly (rows of x from the GEMV to many panels, weight shapes
with tail blocks) and through minisgl.core.layers.quant's layers, which must use them once the
kernels are loaded. The sampler's argmax and log-sum-exp against plain Python in float64.

Every kernel runs on any x86 CPU with AVX2 and FMA (its AVX2 build, or the AVX-512 one where the
CPU has AVX512-BF16), so every test here runs on both kinds of CPU; with MINISGL_CPU_ISA=avx2 an
AVX-512 CPU runs the AVX2 build (the nox session tests-avx2, which .ci/run runs).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import subprocess
import sys
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from minisgl.backends import cpu_kernels
from minisgl.core import sampling
from minisgl.core.kvcache import KVPool, quantize_kv_rows
from minisgl.core.layers import quant
from minisgl.core.request import Req
from minisgl.core.sampling_params import SamplingParams
from minisgl.core.testing.attention import run_case
from tests.core.test_sampling import ref_draw, ref_keep, softmax64
from tests.procs import busy_loops


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


HAS_AVX512_BF16 = {"avx512_bf16", "avx512_vnni", "avx512bw"} <= _cpu_flags() \
    and cpu_kernels.isa() == "native"
# AMX tiles: the AVX-512 build's linears use them where Linux grants them (5.16 on)
HAS_AMX = HAS_AVX512_BF16 and {"amx_tile", "amx_bf16", "amx_int8"} <= _cpu_flags() \
    and os.environ.get("MINISGL_AMX", "on").lower() not in ("0", "off", "false", "no")
pytestmark = pytest.mark.skipif(
    not cpu_kernels.enabled() or not {"avx2", "fma"} <= _cpu_flags(),
    reason="MINISGL_CPU_KERNELS=off or no AVX2 with FMA on this CPU")
# whether this build reads int8 KV pools (both do)
INT8_KV = cpu_kernels.load() and torch.ops.minisgl_cpu.int8_kv()


def test_kernel_builds_and_loads() -> None:
    """With a compiler (this project's CI) the kernels must be there, all of them: the AVX2
    build on a CPU with AVX2 and FMA, the AVX-512 one on a CPU with AVX512-BF16, with AMX
    tiles where the CPU has them."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    assert ops.linear_isa() == ("avx512+amx" if HAS_AMX else "avx512" if HAS_AVX512_BF16
                                else "avx2")
    assert ops.available()
    assert cpu_kernels.supports(torch.bfloat16, 9, 3, 64)


def test_cpu_isa_picks_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_CPU_ISA=avx2 compiles for x86-64-v3 (a library of its own in the cache); a value
    it does not know is an error naming the variable."""
    monkeypatch.setenv("MINISGL_CPU_ISA", "native")
    native, native_dir = cpu_kernels.cflags(), cpu_kernels._cache_dir()
    assert "-march=native" in native
    monkeypatch.setenv("MINISGL_CPU_ISA", "AVX2")
    assert "-march=x86-64-v3" in cpu_kernels.cflags()
    assert "-march=native" not in cpu_kernels.cflags()
    assert cpu_kernels._cache_dir() != native_dir
    monkeypatch.setenv("MINISGL_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="MINISGL_CPU_ISA"):
        cpu_kernels.cflags()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              kv_lens: list[int], q_lens: list[int], scale: float, window: int = 0
              ) -> torch.Tensor:
    """float64, one query and one head at a time: query i of request b sees its first
    seen = kv_len - q_len + i + 1 keys, or with a window only the last ``window`` of those."""
    heads, group = q.shape[1], q.shape[1] // k.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for b, (kv_len, n) in enumerate(zip(kv_lens, q_lens)):
        s = slots[b, :kv_len]
        kk, vv = k[:, s].double(), v[:, s].double()
        for i in range(n):
            seen = kv_len - n + i + 1
            first = max(0, seen - window) if window else 0
            for h in range(heads):
                scores = kk[h // group, first:seen] @ q[row + i, h].double() * scale
                out[row + i, h] = scores.softmax(0) @ vv[h // group, first:seen]
        row += n
    return out


CASES = {
    "decode-1": [(1, 1)],
    "decode-long": [(1, 700)],  # split over threads (split-K) and merged
    "decode-batch": [(1, 17), (1, 5), (1, 77), (1, 16), (1, 32), (1, 33)],
    # enough requests that none is split: each runs its 1,300 / 1,030 keys in chunks (AVX2)
    "decode-chunks": [(1, 1300), (1, 1030), (1, 600), (1, 513), (1, 1300), (1, 3), (1, 1024),
                      (1, 2)],
    "prefill": [(5, 5), (40, 40), (17, 17)],
    "prefill-short": [(5, 5), (3, 9)],  # with 1-3 heads per kv head, none of 16 rows or more
    "extend": [(64, 300), (3, 70), (1, 33)],  # queries after a cached prefix
    "mixed": [(33, 100), (1, 64), (16, 16)],
}


def _random_batch(case: str, kv_heads: int, group: int, head_dim: int, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CASES[case] as kernel inputs: q, the pool's k and v (random bf16) and each request's
    slots, random and a few longer than its kv_len (entries past it must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    lens = CASES[case]
    pool = 4096
    k = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    v = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    q = (2 * torch.randn(sum(a for a, _ in lens), kv_heads * group, head_dim,
                         generator=gen)).bfloat16()
    lk = max(b for _, b in lens) + 5
    slots = torch.stack([torch.randperm(pool - 1, generator=gen)[:lk] + 1 for _ in lens])
    return q, k, v, slots


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
            kv_lens: list[int], q_lens: list[int], scale: float, window: int = 0) -> torch.Tensor:
    """The kernel on requests whose queries lie back to back in q."""
    ql = torch.tensor(q_lens)
    return cpu_kernels.paged_attention(q, k, v, slots, torch.tensor(kv_lens),
                                       torch.cumsum(ql, 0) - ql, ql, scale, window)


def _assert_matches_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            slots: torch.Tensor, kv_lens: list[int], q_lens: list[int]
                            ) -> torch.Tensor:
    """The kernel at scale 1 / sqrt(head_dim) against reference(), within 2e-2 (bf16 output and
    P roundings); returns the kernel's output."""
    scale = 1 / math.sqrt(q.shape[-1])
    out = _attend(q, k, v, slots, kv_lens, q_lens, scale)
    ref = reference(q, k, v, slots, kv_lens, q_lens, scale)
    assert (out.double() - ref).abs().max().item() < 2e-2
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"),
                         [(3, 3, 64), (2, 2, 128), (1, 8, 32), (4, 1, 64), (2, 4, 256),
                          (2, 4, 128)])
def test_matches_float64(case: str, kv_heads: int, group: int, head_dim: int) -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    q_lens, kv_lens = [a for a, _ in CASES[case]], [b for _, b in CASES[case]]
    q, k, v, slots = _random_batch(case, kv_heads, group, head_dim, seed=0)
    scale = 1 / math.sqrt(head_dim)
    out = _attend(q, k, v, slots, kv_lens, q_lens, scale)
    ref = reference(q, k, v, slots, kv_lens, q_lens, scale)
    # bf16 output rounding alone is up to ~4e-3 for these magnitudes; P goes through bf16 too
    assert (out.double() - ref).abs().max().item() < 2e-2
    # and as close as PyTorch's own bf16 attention is for the same inputs (one request)
    n, kv_len = q_lens[0], kv_lens[0]
    kk, vv = k[:, slots[0, :kv_len]], v[:, slots[0, :kv_len]]
    mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - n, kv_len)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:n].transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask, scale=scale,
        enable_gqa=True)[0].transpose(0, 1)
    err_sdpa = (sdpa.double() - ref[:n]).abs().max().item()
    assert (out[:n].double() - ref[:n]).abs().max().item() <= 2 * err_sdpa + 2e-3


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 7, 16, 50])
def test_sliding_window_matches_float64(case: str, window: int) -> None:
    """A sliding window: each query sees its last ``window`` keys only (windows shorter than,
    equal to and not a multiple of the kernel's 16-key blocks; split-K decode over a window)."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    q_lens, kv_lens = [a for a, _ in CASES[case]], [b for _, b in CASES[case]]
    q, k, v, slots = _random_batch(case, 3, 3, 64, seed=2)
    scale = 1 / math.sqrt(64)
    out = _attend(q, k, v, slots, kv_lens, q_lens, scale, window)
    ref = reference(q, k, v, slots, kv_lens, q_lens, scale, window)
    assert (out.double() - ref).abs().max().item() < 2e-2
    if max(kv_lens) > window:  # the window changed the answer
        full = reference(q, k, v, slots, kv_lens, q_lens, scale)
        assert (full - ref).abs().max().item() > 0.1


def test_sliding_window_does_not_read_keys_before_it() -> None:
    """Keys before every query's window are NaN: a kernel that read (or multiplied by zero)
    any of them would return NaN."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    gen = torch.Generator().manual_seed(3)
    window, kv_lens, q_lens = 20, [300, 300, 64], [1, 1, 30]
    k = torch.randn(2, 1024, 64, generator=gen).bfloat16()
    v = torch.randn(2, 1024, 64, generator=gen).bfloat16()
    slots = torch.arange(1, 1 + 3 * 320).view(3, 320)
    for b, (kv_len, n) in enumerate(zip(kv_lens, q_lens)):
        stale = slots[b, :kv_len - n + 1 - window]  # before the first query's window
        k[:, stale] = float("nan")
        v[:, stale] = float("nan")
    q = torch.randn(sum(q_lens), 4, 64, generator=gen).bfloat16()
    out = _attend(q, k, v, slots, kv_lens, q_lens, 0.125, window)
    assert not out.isnan().any()
    ref = reference(q, k, v, slots, kv_lens, q_lens, 0.125, window)
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 8, 32), (2, 1, 128)])
def test_decode_over_shared_prefixes_matches_float64(kv_heads: int, group: int,
                                                     head_dim: int) -> None:
    """Decode requests whose slot rows start alike (a radix-cached prefix): the kernel runs a
    group's shared keys once for all its queries, then merges with each request's own keys."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    gen = torch.Generator().manual_seed(1)
    pool, lk = 16384, 420
    # (members, shared slots, each member's kv_len): groups of 3 (200 shared), 18 (100, more
    # members than one item takes), 2 (45), 2 sharing too little (20), 3 of which one has no
    # keys past the 128 shared (an empty item of its own keys), and a lone request
    groups = [(3, 200, [260, 201, 333]), (18, 100, [101 + 7 * i for i in range(18)]),
              (2, 45, [46, 400]), (2, 20, [64, 30]), (3, 128, [200, 128, 150]), (1, 0, [150])]
    perm = torch.randperm(pool - 1, generator=gen) + 1
    used, rows, kv_lens = 0, [], []
    for members, shared, lens in groups:
        assert len(lens) == members
        common = perm[used: used + shared]
        used += shared
        for n in lens:
            own = perm[used: used + lk - shared]
            used += lk - shared
            rows.append(torch.cat([common, own]))
            kv_lens.append(n)
    order = torch.randperm(len(rows), generator=gen)  # group members not next to each other
    slots = torch.stack(rows)[order].contiguous()
    kv_lens = [kv_lens[i] for i in order.tolist()]
    k = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    v = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    q = (2 * torch.randn(len(rows), kv_heads * group, head_dim, generator=gen)).bfloat16()
    _assert_matches_float64(q, k, v, slots, kv_lens, [1] * len(rows))


@pytest.mark.parametrize("case", ["decode-long", "decode-batch"])
def test_split_follows_the_threads_it_is_given(case: str) -> None:
    """threads=N: few decode requests' keys are split (split-K, and the parts merged) as for N
    threads whatever the call runs on, so the output is the same to the bit on 1 thread as on
    2 (the engine's thread tuner runs some steps on fewer threads than it has)."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    q, k, v, slots = _random_batch(case, 3, 3, 64, seed=4)
    kv_lens = [n for _, n in CASES[case]]
    ql = torch.ones(len(kv_lens), dtype=torch.int64)
    args = (q, k, v, slots, torch.tensor(kv_lens), torch.cumsum(ql, 0) - ql, ql, 0.125, 0)
    before = torch.get_num_threads()
    outs = {}
    try:
        for n in (2, 1, 3):
            torch.set_num_threads(n)
            outs[n] = cpu_kernels.paged_attention(*args, threads=2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[3], outs[2])
    ref = reference(q, k, v, slots, kv_lens, [1] * len(kv_lens), 0.125)
    assert (outs[2].double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("phase", ["decode", "extend"])
def test_requests_without_queries_are_skipped(phase: str) -> None:
    """q_lens[b] = 0 (what a step's last layer asks for a request it samples nothing from):
    the other requests' queries, not back to back in q, attend as they would alone (float64
    reference), also beside requests of no queries that share their cached prefix (a decode
    step's groups) and whose q_start names another request's row."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    gen = torch.Generator().manual_seed(3)
    kv_heads, group, d, pool = 3, 3, 64, 4096
    k = torch.randn(kv_heads, pool, d, generator=gen).bfloat16()
    v = torch.randn(kv_heads, pool, d, generator=gen).bfloat16()
    perm = torch.randperm(pool - 1, generator=gen) + 1
    shared = perm[:96]  # requests 0, 1 and 3 start with the same 96 slots
    slots = torch.stack([torch.cat([shared, perm[100 + 300 * i: 100 + 300 * i + 204]])
                         if i != 2 else perm[1300:1600] for i in range(4)])
    kv_lens = [150, 290, 77, 120]
    q_lens = [1, 0, 1, 0] if phase == "decode" else [5, 0, 1, 17]
    # rows 0, 6, 7, ... of q belong to nobody; a request of no queries names request 0's row
    # (were it run, it would write its own result there)
    q_start = [1, 1, 8, 30]
    q = (2 * torch.randn(60, kv_heads * group, d, generator=gen)).bfloat16()
    scale = d ** -0.5
    out = cpu_kernels.paged_attention(q, k, v, slots, torch.tensor(kv_lens),
                                      torch.tensor(q_start), torch.tensor(q_lens), scale)
    for b, (s, n) in enumerate(zip(q_start, q_lens)):
        if n > 0:
            ref = reference(q[s:s + n], k, v, slots[b:b + 1], [kv_lens[b]], [n], scale)
            assert (out[s:s + n].double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"),
                         [(3, 3, 64), (1, 8, 32), (2, 2, 128), (1, 2, 256)])
def test_extend_over_shared_prefixes_matches_float64(kv_heads: int, group: int,
                                                     head_dim: int) -> None:
    """Prefill and extend requests whose slot rows start alike (a radix-cached prefix) in one
    batch: on AMX tiles the kernel loads each distinct key block once for the batch. Shared
    prefixes of 48 keys (3 blocks: the pair of blocks 2-3 is one shared and one own block), 64
    (a pair boundary), 40 (a block half shared: not the same block), a request that is
    another's prefix exactly, and odd and even block counts at the end."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    gen = torch.Generator().manual_seed(2)
    pool, lk = 8192, 260
    # (shared slots, [(queries, kv_len) of each member])
    groups = [(48, [(20, 68), (60, 108), (1, 49), (16, 250)]),
              (64, [(64, 128), (5, 69), (33, 97)]),
              (40, [(24, 64), (40, 80)]),
              (100, [(100, 100), (36, 136), (4, 104)]),
              (0, [(70, 70)])]
    perm = torch.randperm(pool - 1, generator=gen) + 1
    used, rows, lens = 0, [], []
    for shared, members in groups:
        common = perm[used: used + shared]
        used += shared
        for n, kv_len in members:
            own = perm[used: used + lk - shared]
            used += lk - shared
            rows.append(torch.cat([common, own]))
            lens.append((n, kv_len))
    order = torch.randperm(len(rows), generator=gen)
    slots = torch.stack(rows)[order].contiguous()
    q_lens = [lens[i][0] for i in order.tolist()]
    kv_lens = [lens[i][1] for i in order.tolist()]
    k = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    v = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    q = (2 * torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen)).bfloat16()
    _assert_matches_float64(q, k, v, slots, kv_lens, q_lens)


@pytest.mark.parametrize("phase", ["prefill", "extend", "decode"])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 8, 32), (2, 2, 128)])
def test_slots_in_page_runs_match_float64(phase: str, kv_heads: int, group: int,
                                          head_dim: int) -> None:
    """Slots as the engine's pool hands them out: pages of 16 consecutive slots, scattered. On
    AMX tiles a block of 16 keys that is such a run is read from the pool as it lies (the
    other blocks are copied first): runs that begin on a page and ones that do not (a request
    whose row starts mid-page), blocks that are half a run, and, in decode, groups sharing a
    cached prefix of whole pages and one of 40 slots (a block of a run shared, the next
    not)."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    gen = torch.Generator().manual_seed(5)
    pool_pages = 512
    pages = (torch.randperm(pool_pages - 1, generator=gen) + 1).tolist()

    def run_of(n: int, offset: int = 0) -> torch.Tensor:  # n slots on fresh pages
        count = (n + offset + 15) // 16
        taken = [pages.pop() for _ in range(count)]
        return torch.cat([torch.arange(16 * p, 16 * p + 16) for p in taken])[offset:offset + n]

    if phase == "decode":
        shared = [run_of(128), run_of(40)]
        rows, kv_lens = [], []
        for g, prefix in enumerate(shared):
            for own in (1, 17, 50, 64):
                rows.append(torch.cat([prefix, run_of(own + 3, offset=g * 5)]))
                kv_lens.append(len(prefix) + own)
        q_lens = [1] * len(rows)
    elif phase == "prefill":
        q_lens = kv_lens = [100, 64, 33]
        rows = [run_of(n + 5, offset=o) for n, o in zip(kv_lens, (0, 3, 0))]
    else:  # a shared 64-slot prefix and one of 24 (half a page run shared), then new tokens
        prefixes = [run_of(64), run_of(24)]
        lens = [(0, 64, 40), (0, 64, 16), (1, 24, 30), (1, 24, 70)]
        rows = [torch.cat([prefixes[p], run_of(n + 2)]) for p, _, n in lens]
        q_lens = [n for *_, n in lens]
        kv_lens = [c + n for _, c, n in lens]
    lk = max(len(r) for r in rows)
    slots = torch.stack([torch.cat([r, torch.zeros(lk - len(r), dtype=torch.int64)])
                         for r in rows])
    k = torch.randn(kv_heads, 16 * pool_pages, head_dim, generator=gen).bfloat16()
    v = torch.randn(kv_heads, 16 * pool_pages, head_dim, generator=gen).bfloat16()
    q = (2 * torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen)).bfloat16()
    _assert_matches_float64(q, k, v, slots, kv_lens, q_lens)


@pytest.mark.parametrize("phase", ["prefill", "extend", "decode"])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 8, 32), (2, 2, 128)])
@pytest.mark.parametrize("growth", [1 / 16, 1 / 2])
def test_scores_growing_along_the_keys_match_float64(phase: str, kv_heads: int, group: int,
                                                     head_dim: int, growth: float) -> None:
    """Keys that grow along each request (x0.2 at its first position to x20, or x160, at the
    320th), so that a row's running max passes the one before by many times e again and again,
    step after step. On AMX tiles a row's p are taken against a reference max, which moves (and
    its sum and O are rescaled) only when a step's p would overflow or sum past 2^64: the
    faster growth passes the reference by far more than float32's range (2^128) within a step,
    which the kernel must see and redo; rows past a request's prefix start from nothing."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    gen = torch.Generator().manual_seed(11)
    if phase == "decode":  # two groups of 8 sharing 320 and 96 keys, then a few of their own
        kv_lens = [320 + 5 + i for i in range(8)] + [96 + 40 + 3 * i for i in range(8)]
        q_lens = [1] * 16
    elif phase == "prefill":
        q_lens = kv_lens = [320, 70, 16]
    else:  # 64 and 33 new tokens after a shared 256-key prefix, 40 after a private 200
        q_lens, kv_lens = [64, 33, 40], [320, 289, 240]
    pool = 4096
    lk = max(kv_lens)
    slots = torch.zeros(len(kv_lens), lk, dtype=torch.int64)
    pos_of = torch.zeros(pool, dtype=torch.float64)  # a slot's position in its request
    free = (torch.randperm(pool // 16 - 1, generator=gen) + 1).tolist()
    shared = {"decode": {i: (0, 320) for i in range(8)} | {i: (1, 96) for i in range(8, 16)},
              "extend": {0: (0, 256), 1: (0, 256)}}.get(phase, {})
    prefixes: dict[int, torch.Tensor] = {}
    for b, n in enumerate(kv_lens):
        pages = [free.pop() for _ in range((n + 15) // 16)]
        row = torch.cat([torch.arange(16 * p, 16 * p + 16) for p in pages])[:n]
        if b in shared:
            g, c = shared[b]
            row[:c] = prefixes.setdefault(g, row[:c].clone())
        slots[b, :n] = row
        pos_of[row] = torch.arange(n, dtype=torch.float64)
    k = torch.randn(kv_heads, pool, head_dim, generator=gen)
    k = (k * (0.2 + pos_of * growth)[None, :, None]).bfloat16()
    v = torch.randn(kv_heads, pool, head_dim, generator=gen).bfloat16()
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).bfloat16()
    out = _assert_matches_float64(q, k, v, slots, kv_lens, q_lens)
    assert torch.isfinite(out).all()


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """cpu_kernels.paged_attention, counted: a list that grows by one per call."""
    calls: list[int] = []
    real = cpu_kernels.paged_attention

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "paged_attention", counting)
    return calls


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("phase", "prefix_lens", "new_lens"), [
    ("prefill", [0, 0, 0], [1, 17, 40]),
    ("prefill", [16, 3, 70, 0], [5, 30, 1, 9]),
    ("decode", [0, 1, 15, 16, 100, 63], [1] * 6),
])
def test_backend_uses_kernel_on_paged_pool(monkeypatch: pytest.MonkeyPatch, page_size: int,
                                           phase: str, prefix_lens: list[int],
                                           new_lens: list[int]) -> None:
    calls = _count_kernel_calls(monkeypatch)
    run_case("torch", page_size=page_size, num_heads=9, num_kv_heads=3, head_dim=64,
             prefix_lens=prefix_lens, new_lens=new_lens, phase=phase, dtype=torch.bfloat16,
             atol=2e-2)
    assert calls, "the torch backend did not use the CPU kernel for a bf16 pool"


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize(("phase", "prefix_lens", "new_lens"), [
    ("prefill", [16, 3, 70, 0], [5, 30, 1, 9]),
    ("decode", [0, 1, 15, 16, 100, 63], [1] * 6),
])
def test_backend_on_int8_pool(monkeypatch: pytest.MonkeyPatch, kernel: bool, phase: str,
                              prefix_lens: list[int], new_lens: list[int]) -> None:
    """The torch backend over an int8 pool: the kernel, or PyTorch's path where the kernels are
    unavailable (forced here); both attend over what the pool holds."""
    if kernel and not INT8_KV:
        pytest.skip("this build reads no int8 pool")
    calls = _count_kernel_calls(monkeypatch)
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "supports", lambda *a, **k: False)
    run_case("torch", page_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
             prefix_lens=prefix_lens, new_lens=new_lens, phase=phase, dtype=torch.bfloat16,
             atol=2e-2, kv_dtype=torch.int8)
    assert bool(calls) == kernel


def test_bad_inputs_are_refused() -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    slots = torch.zeros(2, 8, dtype=torch.int64)
    one, lens = torch.ones(2, dtype=torch.int64), torch.full((2,), 4)
    starts = torch.arange(2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.paged_attention(q.float(), k.float(), v.float(), slots, lens, starts, one, 1.0)
    with pytest.raises(RuntimeError, match="bad lengths"):
        cpu_kernels.paged_attention(q, k, v, slots, torch.full((2,), 9), starts, one, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.paged_attention(q, k, v, slots.int(), lens, starts, one, 1.0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        cpu_kernels.paged_attention(q, k, v, slots, lens, starts, one, 1.0, -1)
    for scale in (0.0, -0.125):
        with pytest.raises(RuntimeError, match="scale must be > 0"):
            cpu_kernels.paged_attention(q, k, v, slots, lens, starts, one, scale)


def _records(x: torch.Tensor) -> torch.Tensor:
    """bf16 rows [..., D] as an int8 KV pool's records [..., D + 4] (KVPool's layout: the
    values, then the float32 scale's bytes)."""
    values, scales = quantize_kv_rows(x)
    return torch.cat([values, scales.unsqueeze(-1).view(torch.int8)], dim=-1)


def _dequantized(records: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values int8 records stand for, value x scale (float64: exactly; bf16: rounded, as
    KVPool.read returns them)."""
    d = records.shape[-1] - 4
    scales = records[..., d:].contiguous().view(torch.float32)
    if dtype == torch.float64:
        return records[..., :d].double() * scales.double()
    return (records[..., :d].float() * scales).to(dtype)


def test_quantize_kv_rows_against_float64() -> None:
    """KVPool's int8 rows: values within half a step of x / scale (the largest at +-127),
    scale max|x| / 127 (to an ulp), a row of zeros all zeros; a pool writes those records and reads back
    value x scale."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 3, 64, generator=gen) * torch.rand(64, 3, 1, generator=gen) * 8).bfloat16()
    x[5, 1] = 0
    values, scales = quantize_kv_rows(x)
    amax = x.double().abs().amax(-1)
    assert ((scales.double() - amax / 127).abs() <= amax / 127 * 2 ** -23).all()  # an ulp
    exact = x.double() / (amax / 127).clamp_min(1e-300)[..., None]
    assert ((values.double() - exact).abs() <= 0.5 + 1e-4).all()
    assert torch.equal(values.abs().amax(-1)[amax > 0], torch.full_like(amax[amax > 0], 127,
                                                                        dtype=torch.int8))
    assert not values[5, 1].any() and scales[5, 1] == 0
    pool = KVPool(1, 8, 16, 3, 64, torch.bfloat16, torch.device("cpu"), torch.int8)
    slots = torch.randperm(127, generator=gen)[:64] + 1
    pool.write(0, slots, x, -x)
    assert torch.equal(pool.k[0][:, slots], _records(x).transpose(0, 1))
    k, v = pool.read(0, slots)
    assert torch.equal(k, _dequantized(_records(x)).transpose(0, 1)) and torch.equal(v, -k)
    assert pool.num_bytes == 2 * 3 * 128 * 68


@pytest.mark.skipif(not INT8_KV, reason="this build reads no int8 pool")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"),
                         [(3, 3, 64), (2, 2, 128), (1, 8, 32), (2, 4, 256)])
def test_int8_pool_matches_float64(case: str, kv_heads: int, group: int,
                                   head_dim: int) -> None:
    """The kernel over an int8 pool (int16 dot products for a decode item's scores, V's
    scales folded into P, lane groups on K widened to bf16) against the float64 attention over
    what the pool holds (value x scale, exactly): within the bf16 bound, and as close as the
    bf16 kernel over the pool rounded to bf16 (KVPool.read's values) gets (split-K decode,
    prefill, extend, chunks, scattered slots)."""
    q_lens, kv_lens = [a for a, _ in CASES[case]], [b for _, b in CASES[case]]
    q, k, v, slots = _random_batch(case, kv_heads, group, head_dim, seed=6)
    k8, v8 = _records(k), _records(v)
    scale = 1 / math.sqrt(head_dim)
    out = _attend(q, k8, v8, slots, kv_lens, q_lens, scale)
    ref = reference(q, _dequantized(k8, torch.float64), _dequantized(v8, torch.float64), slots,
                    kv_lens, q_lens, scale)
    err = (out.double() - ref).abs().max().item()
    bf16 = _attend(q, _dequantized(k8), _dequantized(v8), slots, kv_lens, q_lens, scale)
    assert err < 2e-2
    assert err <= 1.5 * (bf16.double() - ref).abs().max().item() + 4e-3
    # the quantization is visible against the unquantized K/V, and small
    exact = reference(q, k, v, slots, kv_lens, q_lens, scale)
    assert 0 < (ref - exact).abs().max().item() < 0.1


@pytest.mark.skipif(not INT8_KV, reason="this build reads no int8 pool")
@pytest.mark.parametrize("phase", ["extend", "decode"])
def test_int8_pool_shared_prefixes_and_page_runs(phase: str) -> None:
    """Decode groups sharing a cached prefix (lane groups and per-row rows in one item) and
    extends after one, on pages of 16 consecutive slots (prefetched as runs), against the
    float64 attention over what the pool holds."""
    gen = torch.Generator().manual_seed(8)
    pages = (torch.randperm(255, generator=gen) + 1).tolist()

    def run_of(n: int) -> torch.Tensor:
        taken = [pages.pop() for _ in range((n + 15) // 16)]
        return torch.cat([torch.arange(16 * p, 16 * p + 16) for p in taken])[:n]

    prefix = run_of(100)
    own = [17, 1, 64, 40, 3, 30, 9] if phase == "decode" else [30, 5, 64]  # 21 rows: 16 + 5
    rows = [torch.cat([prefix, run_of(n)]) for n in own]
    kv_lens = [100 + n for n in own]
    q_lens = [1] * len(own) if phase == "decode" else own
    lk = max(len(r) for r in rows)
    slots = torch.stack([torch.cat([r, torch.zeros(lk - len(r), dtype=torch.int64)])
                         for r in rows])
    k8 = _records(torch.randn(3, 4096, 64, generator=gen).bfloat16())
    v8 = _records(torch.randn(3, 4096, 64, generator=gen).bfloat16())
    q = (2 * torch.randn(sum(q_lens), 9, 64, generator=gen)).bfloat16()
    out = _attend(q, k8, v8, slots, kv_lens, q_lens, 0.125)
    ref = reference(q, _dequantized(k8, torch.float64), _dequantized(v8, torch.float64), slots,
                    kv_lens, q_lens, 0.125)
    assert (out.double() - ref).abs().max().item() < 2e-2


def test_int8_pool_bad_inputs_are_refused() -> None:
    """An int8 pool whose rows are not head_dim + 4 bytes, or K and V of different types:
    clear errors."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    k8 = torch.zeros(2, 64, 68, dtype=torch.int8)
    slots = torch.zeros(2, 8, dtype=torch.int64)
    one, lens, starts = torch.ones(2, dtype=torch.int64), torch.full((2,), 4), torch.arange(2)
    with pytest.raises(RuntimeError, match="pool shapes differ"):
        narrow = k8[..., :64].contiguous()
        cpu_kernels.paged_attention(q, narrow, narrow, slots, lens, starts, one, 1.0)
    with pytest.raises(RuntimeError, match="of one shape"):
        cpu_kernels.paged_attention(q, k8, torch.zeros(2, 64, 68, dtype=torch.bfloat16), slots,
                                    lens, starts, one, 1.0)


def _int8_x_reference(x: torch.Tensor) -> torch.Tensor:
    """x as int8_linear multiplies it, in float64: each row scaled to integers of at most qmax
    (8191, fewer for K > 2,064 so that K products of 127 * qmax fit an int32), rounded to
    nearest, scaled back."""
    k = x.shape[1]
    qmax = min(8191, (2 ** 31 - 1) // (127 * k))
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    # float32 division, as the kernel (int / tensor would be a reciprocal times qmax)
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros(()))
    return torch.round(xf * inv).double() * torch.where(amax > 0, amax / qmax, 0.0).double()


# rows and weight shapes as for bf16 below, plus K = 4,200 (qmax below 8191) and an all-zero row
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 21, 300])
@pytest.mark.parametrize(("n", "k"), [(1, 2), (3, 34), (40, 64), (4, 64), (960, 576),
                                      (577, 1536), (200, 96), (50, 4200)])
def test_int8_linear_matches_float64(rows: int, n: int, k: int) -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    g = torch.Generator().manual_seed(n * 7 + rows)
    q, s = quant.quantize_rows(torch.randn(n, k, generator=g) / math.sqrt(k))
    x = torch.randn(rows, k, generator=g).bfloat16()
    if rows > 2:
        x[rows // 2] = 0.0  # scale 0: zeros out
    packed = ops.int8_pack(q)
    assert packed.shape == (-(-n // 16), k // 2, 16, 2) and packed.dtype == torch.int8
    got = ops.int8_linear(x, packed, s, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    w = q.double() * s.double()[:, None]
    # integer products are exact, the scales float32: what is left is one rounding to bf16
    torch.testing.assert_close(got.double(), _int8_x_reference(x) @ w.T, rtol=2.0 ** -8,
                               atol=1e-5)
    # against x itself: the rounding of x adds at most half a step of its row per input
    plain = x.double() @ w.T
    step = x.double().abs().amax(dim=1, keepdim=True) / min(8191, (2 ** 31 - 1) // (127 * k))
    bound = 2.0 ** -8 * plain.abs() + step / 2 * w.abs().sum(dim=1) + 1e-5
    assert bool(((got.double() - plain).abs() <= bound).all())
    wide = torch.zeros(rows, 2 * k, dtype=torch.bfloat16)
    wide[:, :k] = x
    assert torch.equal(ops.int8_linear(wide[:, :k], packed, s, n), got)  # a strided x
    if rows > 8:  # the same integer sums row by row (from 12 rows on AMX tiles where they run)
        assert torch.equal(torch.cat([ops.int8_linear(r, packed, s, n) for r in x.split(1)]), got)


@pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles here (or MINISGL_AMX=off)")
def test_kernels_without_amx_match_float64_too() -> None:
    """Where AMX runs (the linears; the attention's items of 16 rows or more), the float64
    tests again with MINISGL_AMX=off (a fresh process: the choice is made once), so that the
    vector kernels that CPUs without tiles run stay tested here."""
    env = {**os.environ, "MINISGL_AMX": "off"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "matches_float64 or builds_and_loads or misaligned"], env=env,
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_int8_linear_in_quant_uses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the kernels registers int8_pack/int8_linear; a bf16 layer quantized afterwards
    holds the kernel's layout and float32 scales and its matmul calls the kernel for any rows
    (eager and compiled); float32 layers, and any layer once the registration is removed, use
    ATen's int8 matmul on plain int8 rows."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    assert quant._int8_kernel == (ops.int8_pack.default, ops.int8_linear.default,
                                  ops.int8_linear_silu.default)
    with pytest.raises(ValueError, match="needs its linear"):
        quant.register_int8_linear(ops.int8_pack.default)
    g = torch.Generator().manual_seed(3)
    ref_w = torch.randn(72, 80, generator=g)

    def layer(dtype: torch.dtype) -> quant.QuantizableLinear:
        m = quant.QuantizableLinear()
        m.weight = torch.nn.Parameter(ref_w.to(dtype), requires_grad=False)
        m.quantize_int8()
        assert m.weight.numel() == 0 and m.qweight is not None
        return m

    kernel_layer = layer(torch.bfloat16)
    q, s = quant.quantize_rows(ref_w.bfloat16())
    assert kernel_layer.qlinear is ops.int8_linear.default
    assert torch.equal(kernel_layer.qweight, ops.int8_pack(q))
    assert kernel_layer.qscale is not None and torch.equal(kernel_layer.qscale, s)
    for rows in (1, 40):  # GEMV and panels
        x = torch.randn(3, rows, 80, generator=g).bfloat16()
        got = kernel_layer.matmul(x)
        assert got.shape == (3, rows, 72)
        assert torch.equal(got, ops.int8_linear(x.reshape(-1, 80), ops.int8_pack(q), s, 72)
                           .reshape(3, rows, 72))
        compiled = torch.compile(kernel_layer.matmul, dynamic=True, fullgraph=True)
        assert torch.equal(compiled(x), got)
    assert quant.int8_rows_limit(torch.nn.Sequential(kernel_layer)) is None

    float_layer = layer(torch.float32)  # the kernel is bf16 only
    assert float_layer.qlinear is None and float_layer.qweight is not None
    assert float_layer.qweight.shape == (72, 80)
    assert quant.int8_rows_limit(torch.nn.Sequential(kernel_layer, float_layer)) == \
        quant.INT8_MM_MAX_ROWS
    monkeypatch.setattr(quant, "_int8_kernel", None)
    aten_layer = layer(torch.bfloat16)
    assert aten_layer.qlinear is None and aten_layer.qweight is not None
    x = torch.randn(2, 80, generator=g).bfloat16()
    assert torch.equal(aten_layer.matmul(x),
                       torch.ops.aten._weight_int8pack_mm(x, q, s.bfloat16()))


def test_int8_linear_bad_inputs_are_refused() -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    with pytest.raises(RuntimeError, match="even"):
        ops.int8_pack(torch.zeros(8, 5, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_pack(torch.zeros(8, 4, dtype=torch.bfloat16))
    packed = ops.int8_pack(torch.zeros(20, 8, dtype=torch.int8))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    s = torch.ones(20)
    with pytest.raises(RuntimeError, match="columns"):
        ops.int8_linear(torch.zeros(3, 10, dtype=torch.bfloat16), packed, s, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.int8_linear(x, packed, s, 33)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.int8_linear(x.float(), packed, s, 20)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int8_linear(x, packed, s.bfloat16(), 20)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.int8_linear(x, packed, s[:4], 20)


# rows: the GEMV (<= 4 rows in the AVX-512 build, <= 2 in the AVX2 one), one microkernel pass
# (<= 6), passes split evenly (7, 13, 21), many passes (from 64 rows the AVX2 build widens the
# weights to float32 before its microkernel, below converting each line as it loads it: 64, 67,
# 300); the weights: fewer outputs than a block (16), a
# tail block, a thread's share not a multiple of the 4-block panel, SmolLM2 shapes, and (4, 64)
# with 300 rows: too few blocks to split, so the rows are split instead; 520 rows: on AMX tiles
# 256 rows or more per thread, where the rows are split whatever the blocks (a last group of 8)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 21, 64, 67, 300, 520])
@pytest.mark.parametrize(("n", "k"), [(1, 2), (3, 34), (40, 64), (4, 64), (960, 576),
                                      (577, 1536), (200, 96)])
def test_bf16_linear_matches_float64(rows: int, n: int, k: int) -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    g = torch.Generator().manual_seed(n * 7 + rows)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = torch.ops.minisgl_cpu.bf16_pack(w)
    assert packed.shape == (-(-n // 16), k // 2, 16, 2)
    got = torch.ops.minisgl_cpu.bf16_linear(x, packed, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = x.double() @ w.double().T  # bf16 products are exact in float64
    # float32 sums, then one rounding to bf16 (relative 2^-9) of each output
    torch.testing.assert_close(got.double(), want, rtol=2.0 ** -8, atol=1e-5)
    # a strided x (a view, as the sampled rows of a batch) gives the same
    wide = torch.zeros(rows, 2 * k, dtype=torch.bfloat16)
    wide[:, :k] = x
    assert torch.equal(torch.ops.minisgl_cpu.bf16_linear(wide[:, :k], packed, n), got)
    if rows >= 64:  # the same sums 13-14 rows at a time (AVX2: widened panel vs converting loads)
        parts = [torch.ops.minisgl_cpu.bf16_linear(part, packed, n)
                 for part in torch.tensor_split(x, rows // 13)]
        assert torch.equal(torch.cat(parts), got)


def _silu_mul64(y: torch.Tensor) -> torch.Tensor:
    g, u = y.chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


# rows: one and several groups of tile rows (16 for int8, 32 for bf16), padded tails, below
# int8's 12 rows for tiles; halves: whole blocks of 16 outputs (the tiles' gated form) and not
# (the linear, then the product), SmolLM2's 1,536
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 13, 16, 33, 300, 520])
@pytest.mark.parametrize(("half", "k"), [(16, 64), (24, 64), (48, 96), (1536, 576)])
def test_gated_linear_matches_float64(int8: bool, rows: int, half: int, k: int) -> None:
    """bf16_linear_silu / int8_linear_silu: silu(x @ gate.T) * (x @ up.T) of a [gate; up]
    weight, against float64 and against the plain linear's output put through F.silu * up."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    gen = torch.Generator().manual_seed(rows * 31 + half)
    w = torch.randn(2 * half, k, generator=gen) / math.sqrt(k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    if int8:
        q, s = quant.quantize_rows(w.bfloat16())
        packed = ops.int8_pack(q)
        got = ops.int8_linear_silu(x, packed, s, 2 * half)
        linear = ops.int8_linear(x, packed, s, 2 * half)
        y64 = _int8_x_reference(x) @ (q.double() * s.double()[:, None]).T
    else:
        wb = w.bfloat16()
        packed = ops.bf16_pack(wb)
        got = ops.bf16_linear_silu(x, packed, 2 * half)
        linear = ops.bf16_linear(x, packed, 2 * half)
        y64 = x.double() @ wb.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, half)
    # four roundings to bf16 (g, u, silu(g), the product: 2^-8 relative each), silu's
    # condition number amplifying g's by up to 1 + |g|
    want = _silu_mul64(y64)
    bound = 2.0 ** -8 * (4 + y64[:, :half].abs()) * want.abs() + 1e-6
    assert bool(((got.double() - want).abs() <= bound).all())
    # the same bf16 arithmetic as the module path (F.silu on bf16 rounds silu(g) too): equal
    # but where the kernel's exp and torch's land on either side of a rounding boundary
    composed = F.silu(linear[:, :half]) * linear[:, half:]
    differ = got != composed
    assert differ.float().mean().item() < 1e-3
    torch.testing.assert_close(got[differ].double(), composed[differ].double(), rtol=2.0 ** -7,
                               atol=0)
    wide = torch.zeros(rows, 2 * k, dtype=torch.bfloat16)
    wide[:, :k] = x
    again = (ops.int8_linear_silu(wide[:, :k], packed, s, 2 * half) if int8
             else ops.bf16_linear_silu(wide[:, :k], packed, 2 * half))
    assert torch.equal(again, got)  # a strided x


@pytest.mark.parametrize("fmt", ["bf16", "int8", "float"])
def test_merged_gate_up_uses_the_gated_kernel(fmt: str) -> None:
    """MergedColumnParallelLinear.silu_mul: one call of the registered gated kernel for layers
    the kernels hold (eager and compiled), SiluAndMul of the matmul for the others."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    from minisgl.core.distributed import Communicator
    from minisgl.core.layers import MergedColumnParallelLinear

    ops = torch.ops.minisgl_cpu
    g = torch.Generator().manual_seed(5)
    layer = MergedColumnParallelLinear(64, [48, 48], False, Communicator())
    layer.weight.data = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    ref = layer.weight.detach().clone()
    if fmt == "bf16":
        layer.prepack()
        assert layer.gated_linear is ops.bf16_linear_silu.default
    elif fmt == "int8":
        layer.quantize_int8()
        assert layer.gated_qlinear is ops.int8_linear_silu.default
    x = torch.randn(2, 21, 64, generator=g).bfloat16()
    got = layer.silu_mul(x)
    assert got.shape == (2, 21, 48)
    flat = x.reshape(-1, 64)
    if fmt == "bf16":
        want = ops.bf16_linear_silu(flat, ops.bf16_pack(ref), 96)
    elif fmt == "int8":
        q, sc = quant.quantize_rows(ref)
        want = ops.int8_linear_silu(flat, ops.int8_pack(q), sc, 96)
    else:
        assert layer.gated_matmul(x) is None
        y = F.linear(flat, ref)
        want = F.silu(y[:, :48]) * y[:, 48:]
    assert torch.equal(got, want.reshape(2, 21, 48))
    compiled = torch.compile(layer.silu_mul, dynamic=True, fullgraph=True)
    if fmt != "float":  # (Inductor's own SiLU need not round as eager does)
        assert torch.equal(compiled(x), got)


def test_gated_linear_bad_inputs_are_refused() -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    packed = ops.bf16_pack(torch.zeros(32, 8, dtype=torch.bfloat16))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="columns"):
        ops.bf16_linear_silu(torch.zeros(3, 10, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.bf16_linear_silu(x, packed, 40)
    with pytest.raises(RuntimeError, match="even"):
        ops.bf16_linear_silu(x, packed, 31)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.bf16_linear_silu(x.float(), packed, 32)
    with pytest.raises(RuntimeError, match="int8_pack"):  # a bf16 weight as int8's
        ops.int8_linear_silu(x, packed, torch.ones(32), 32)
    qpacked = ops.int8_pack(torch.zeros(32, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.int8_linear_silu(x, qpacked, torch.ones(30), 32)


def _shifted(packed: torch.Tensor) -> torch.Tensor:
    """A copy of ``packed`` whose data starts 32 bytes past a 64-byte boundary."""
    step = 32 // packed.element_size()
    buf = torch.empty(packed.numel() + 64 // packed.element_size() + step, dtype=packed.dtype)
    start = (-buf.data_ptr() % 64) // packed.element_size() + step
    out = buf[start: start + packed.numel()].view(packed.shape)
    out.copy_(packed)
    assert out.data_ptr() % 64 == 32
    return out


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (40, 64)])
def test_linear_misaligned_weight_matches_aligned(rows: int, n: int, k: int) -> None:
    """The GEMV streams an aligned weight with non-temporal loads and falls back to plain loads
    on a weight that is not 64-byte aligned: both give the same result."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    g = torch.Generator().manual_seed(k + rows)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = ops.bf16_pack(w.bfloat16())
    assert packed.data_ptr() % 64 == 0
    want = ops.bf16_linear(x, packed, n)
    torch.testing.assert_close(want.double(), x.double() @ w.bfloat16().double().T,
                               rtol=2.0 ** -8, atol=1e-5)
    assert torch.equal(ops.bf16_linear(x, _shifted(packed), n), want)
    q, s = quant.quantize_rows(w)
    packed8 = ops.int8_pack(q)
    assert packed8.data_ptr() % 64 == 0
    assert torch.equal(ops.int8_linear(x, _shifted(packed8), s, n), ops.int8_linear(x, packed8, s, n))


def _mapping(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping that holds ``address``, None when none does."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if not first.endswith(":"):  # a mapping's header: start-end perms offset ...
                if fields is not None:
                    return fields
                start, end = (int(a, 16) for a in first.split("-"))
                fields = {} if start <= address < end else None
            elif fields is not None:
                fields[first[:-1]] = line.split(":", 1)[1].strip()
    return fields


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(_thp_mode() == "never" or not os.path.exists("/proc/self/smaps"),
                    reason="no transparent huge pages (Linux, THP not 'never')")
def test_packed_weights_live_in_huge_page_arenas() -> None:
    """Packs come from 2 MiB-aligned arenas the kernel may back with huge pages; an arena no
    tensor uses any more is unmapped, except the current one, whose front is handed out again,
    zero-filled; a weight larger than an arena gets one of its own."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    g = torch.Generator().manual_seed(0)
    w = torch.randn(960, 576, generator=g).bfloat16()
    packed = ops.bf16_pack(w)
    region = _mapping(packed.data_ptr())
    assert region is not None and region["THPeligible"] == "1"
    x = torch.randn(2, 576, generator=g).bfloat16()
    torch.testing.assert_close(ops.bf16_linear(x, packed, 960).double(),
                               x.double() @ w.double().T, rtol=2.0 ** -8, atol=1e-5)

    mib = 1 << 20
    a, b, c = (ops.weight_zeros([40 * mib], torch.uint8) for _ in range(3))
    # 40 MiB does not fit after 40 MiB of a 64 MiB arena: b and c each start a new one
    assert b.data_ptr() % (2 * mib) == 0 and c.data_ptr() % (2 * mib) == 0
    assert _mapping(b.data_ptr()) is not None and _mapping(c.data_ptr()) is not None
    where_b, where_c = b.data_ptr(), c.data_ptr()
    c.fill_(7)
    del a, b, c
    assert _mapping(where_b) is None  # b's arena: empty and not current, unmapped
    d = ops.weight_zeros([mib], torch.uint8)
    assert d.data_ptr() == where_c and not d.any()  # c's arena, reused from its front, zeroed
    big = ops.weight_zeros([70 * mib], torch.uint8)
    assert big.numel() == 70 * mib and not big.any()
    assert _mapping(big.data_ptr() + 70 * mib - 1) is not None


def test_bf16_linear_zero_rows_and_threads() -> None:
    """No rows gives an empty result; one thread gives what two give (same per-output sums)."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 128, generator=g).bfloat16()
    packed = torch.ops.minisgl_cpu.bf16_pack(w)
    assert torch.ops.minisgl_cpu.bf16_linear(torch.zeros(0, 128).bfloat16(), packed, 300).shape \
        == (0, 300)
    x = torch.randn(20, 128, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.minisgl_cpu.bf16_linear(x, packed, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, torch.ops.minisgl_cpu.bf16_linear(x, packed, 300))


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_bf16_linear_rounds_to_nearest_even(rows: int) -> None:
    """Each output is the float32 sum rounded once to bf16, to nearest even (ties included): a
    weight that adds two inputs of x per output (one pair, so the float32 sum is exact) gives
    torch's float32 sum rounded to bf16, bit for bit. A NaN or inf in a row of x makes that row
    NaN (0 * inf in the other outputs' sums) but for the output that adds it, the other rows
    unchanged."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    n, k = 40, 80
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    for j in range(n):  # output j = x[2j] + x[2j + 1]
        w[j, 2 * j] = w[j, 2 * j + 1] = 1.0
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, n, generator=g).bfloat16()
    # b: half a bf16 step of a (a + b a tie, rounded to the even neighbour), or random values
    exponent = torch.frexp(a.float()).exponent
    half_step = torch.ldexp(torch.ones(exponent.shape), exponent - 9) * a.float().sign()
    b = torch.where(torch.rand(rows, n, generator=g) < 0.5, half_step,
                    torch.randn(rows, n, generator=g)).bfloat16()
    assert float((a.float() + half_step).bfloat16().float().sub(a.float()).abs().max()) > 0
    x = torch.stack([a, b], dim=2).reshape(rows, k)
    packed = ops.bf16_pack(w)
    got = ops.bf16_linear(x, packed, n)
    assert torch.equal(got.view(torch.int16), (a.float() + b.float()).bfloat16().view(torch.int16))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[0, 5] = bad
        out = ops.bf16_linear(y, packed, n)
        # output 2 sums x[4] and x[5]: bad itself (inf + finite is inf); the others 0 * bad
        assert out[0, 2].float().item() == bad or math.isnan(bad)
        assert bool(out[0, :2].isnan().all() and out[0, 3:].isnan().all())
        assert torch.equal(out[1:], got[1:])


def test_bf16_linear_in_quant_uses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the kernels registers bf16_pack/bf16_linear; a layer prepacked afterwards holds
    the kernel's layout and its matmul calls the kernel (eager and in a compiled graph); with
    the registration removed, prepacking falls back to oneDNN."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    assert quant._bf16_linear == (ops.bf16_pack.default, ops.bf16_linear.default,
                                  ops.bf16_linear_silu.default)
    assert quant._bf16_rows is cpu_kernels.packed_rows and quant._bf16_widens
    with pytest.raises(ValueError, match="needs its linear"):
        quant.register_bf16_linear(ops.bf16_pack.default)
    g = torch.Generator().manual_seed(2)
    ref_w = torch.randn(72, 80, generator=g).bfloat16()

    def layer() -> quant.QuantizableLinear:
        m = quant.QuantizableLinear()
        m.weight = torch.nn.Parameter(ref_w.clone(), requires_grad=False)
        m.prepack()
        assert m.weight.numel() == 0 and m.packed is not None
        return m

    kernel_layer = layer()
    assert kernel_layer.packed_linear is ops.bf16_linear.default
    assert kernel_layer.packed.shape == (5, 40, 16, 2)
    x = torch.randn(3, 7, 80, generator=g).bfloat16()
    want = F.linear(x, ref_w)
    got = kernel_layer.matmul(x)
    assert got.shape == (3, 7, 72)
    torch.testing.assert_close(got, want, atol=0.0625, rtol=2 ** -7)
    compiled = torch.compile(kernel_layer.matmul, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x), got)

    monkeypatch.setattr(quant, "_bf16_linear", None)
    if not quant.can_prepack(ref_w):
        pytest.skip("oneDNN has no bf16 support on this CPU")
    onednn_layer = layer()
    assert onednn_layer.packed_linear is None and onednn_layer.pack_token is not None
    torch.testing.assert_close(onednn_layer.matmul(x), want, atol=0.0625, rtol=2 ** -7)


@pytest.mark.parametrize("n", [16, 72, 49152])
def test_packed_rows_are_the_weight_rows(n: int) -> None:
    """bf16_rows (cpu_kernels.packed_rows) gives back rows of the weight bf16_pack packed,
    bit for bit, for ids of any shape (every id of the last block, padding rows after it, a
    repeated id), eagerly and in a compiled graph; an id past the packed rows is an error."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, 96, generator=g).bfloat16()
    packed = torch.ops.minisgl_cpu.bf16_pack(w)
    ids = torch.randint(0, n, (3, 41), generator=g)
    ids[0, :16] = torch.arange(n - 16, n)
    ids[1, :5] = ids[1, 5]
    assert torch.equal(cpu_kernels.packed_rows(packed, ids), w[ids])
    one = torch.tensor([n - 1])
    compiled = torch.compile(cpu_kernels.packed_rows, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(packed, ids[2]), w[ids[2]])
    assert torch.equal(compiled(packed, one), w[one])
    with pytest.raises(RuntimeError, match="outside"):
        cpu_kernels.packed_rows(packed, torch.tensor([packed.shape[0] * 16]))
    with pytest.raises(RuntimeError, match="outside"):
        cpu_kernels.packed_rows(packed, torch.tensor([-1]))


def test_tied_embedding_reads_the_packed_lm_head() -> None:
    """An embedding tied to an LM head (one Parameter) keeps no float copy once the head is
    prepacked for the kernel: both drop the weight, the embedding's rows come from the packed
    copy and equal the weight's, and the head's logits are the kernel's. int8 keeps the float
    embedding (its rows stay unquantized)."""
    from minisgl.core.distributed import Communicator
    from minisgl.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    assert cpu_kernels.load(), cpu_kernels.load_error
    g = torch.Generator().manual_seed(5)
    w = torch.randn(100, 64, generator=g).bfloat16()

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            comm = Communicator(0, 1)
            self.embed = VocabParallelEmbedding(100, 64, comm)
            self.head = ParallelLMHead(100, 64, comm)
            self.embed.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            self.head.weight = self.embed.weight

    ids = torch.tensor([[0, 99, 17], [17, 3, 64]])
    model = Tied()
    assert quant.prepack_model(model) == 1
    assert model.embed.weight.numel() == 0 and model.head.weight.numel() == 0
    assert model.embed.rows_packed is model.head.packed
    assert torch.equal(model.embed(ids), w[ids])
    x = torch.randn(4, 64, generator=g).bfloat16()
    torch.testing.assert_close(model.head.compute_logits(x), F.linear(x, w).float(), atol=0.0625,
                               rtol=2 ** -7)
    int8 = Tied()
    assert quant.quantize_model_int8(int8) == 1
    assert torch.equal(int8.embed.weight, w) and int8.embed.rows_packed is None
    assert torch.equal(int8.embed(ids), w[ids])


def test_bf16_linear_bad_inputs_are_refused() -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    with pytest.raises(RuntimeError, match="even"):
        ops.bf16_pack(torch.zeros(8, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        ops.bf16_pack(torch.zeros(8, 4))
    packed = ops.bf16_pack(torch.zeros(20, 8, dtype=torch.bfloat16))
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="columns"):
        ops.bf16_linear(torch.zeros(3, 10, dtype=torch.bfloat16), packed, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.bf16_linear(x, packed, 33)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.bf16_linear(x.float(), packed, 20)
    with pytest.raises(RuntimeError, match="out_dtype"):
        ops.bf16_linear(x, packed, 20, torch.float16)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_linears_widen_to_float32_in_the_call(int8: bool, rows: int) -> None:
    """``out_dtype=float32``: the bf16 result's values, exactly (what ``.float()`` of it gives);
    a layer's ``matmul(x, torch.float32)`` asks the registered kernel for them (the LM head's
    logits), and without a widening kernel gets the same values through ``.to``."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1000, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    if int8:
        q, sc = quant.quantize_rows(w)
        packed = ops.int8_pack(q)
        y, f = ops.int8_linear(x, packed, sc, 1000), ops.int8_linear(x, packed, sc, 1000,
                                                                    torch.float32)
    else:
        packed = ops.bf16_pack(w)
        y, f = ops.bf16_linear(x, packed, 1000), ops.bf16_linear(x, packed, 1000, torch.float32)
    assert y.dtype == torch.bfloat16 and f.dtype == torch.float32
    assert torch.equal(f, y.float())
    m = quant.QuantizableLinear()
    m.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    m.quantize_int8() if int8 else m.prepack()
    assert m.widens
    got = m.matmul(x.reshape(1, rows, 96), torch.float32)
    assert got.dtype == torch.float32 and got.shape == (1, rows, 1000)
    assert torch.equal(got[0], m.matmul(x).float())
    m.widens = False  # a registered kernel that does not widen: .to after it
    assert torch.equal(m.matmul(x, torch.float32), got[0])


@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (40, 1024), (5, 100), (2, 3, 128)])
def test_rms_norm_kernel_matches_the_module(shape: tuple[int, ...]) -> None:
    """``rms_norm``, registered for the model's eager norms: RMSNorm.forward's pair, the
    residual sum bit for bit and the normalized rows as its ops round them (float32 sums in
    another order: at most one bf16 rounding apart, here none), with and without a residual,
    on rows of any width and on [.., heads, d] (Qwen3's per-head norms)."""
    from minisgl.core.layers import norm

    assert cpu_kernels.load(), cpu_kernels.load_error
    assert norm._kernel is torch.ops.minisgl_cpu.rms_norm.default
    g = torch.Generator().manual_seed(sum(shape))
    m = norm.RMSNorm(shape[-1], 1e-5).to(torch.bfloat16)
    m.weight.data = torch.randn(shape[-1], generator=g).bfloat16()
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    res = torch.randn(shape, generator=g).bfloat16()
    for residual in (None, res):
        y, r = m(x, residual)
        want_r = x if residual is None else x + residual
        want_y = m._norm(want_r)  # the PyTorch ops
        assert torch.equal(r, want_r) and (residual is not None or r is x)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        torch.testing.assert_close(y, want_y, atol=0, rtol=2 ** -7)
        assert (y != want_y).sum() <= y.numel() // 1000
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.minisgl_cpu.rms_norm(x.float(), None, m.weight, 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.minisgl_cpu.rms_norm(x, res[..., :1], m.weight, 1e-5)
    m32 = norm.RMSNorm(shape[-1], 1e-5)  # float32 rows: the PyTorch ops
    x32 = x.float()
    assert torch.equal(m32(x32)[0], m32._norm(x32))


@pytest.mark.parametrize("cols", [1, 7, 16, 100, 49152])
def test_argmax_logsumexp_matches_float64(cols: int) -> None:
    """Every row's first maximum (a NaN counts as the maximum, as torch.argmax) and log-sum-exp
    against plain Python in float64: random rows, ties across the row, a row of one value, NaN,
    +inf, a row of -inf, very negative entries (exp underflows), a strided view."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(10, cols, generator=g) * 4
    x[1, cols // 3] = x[1, cols - 1] = 50.0
    x[2] = 1.5
    x[3, cols // 2] = float("nan")
    x[4, cols - 1] = float("inf")
    x[5] = float("-inf")
    x[6, : cols // 2] = -1e30
    x[7, 0] = -200.0

    def first_max(row: list[float]) -> int:
        nan = [i for i, v in enumerate(row) if math.isnan(v)]
        return nan[0] if nan else row.index(max(row))

    def lse(row: list[float]) -> float:
        m = max(row)
        if any(math.isnan(v) for v in row):
            return math.nan
        if math.isinf(m):
            return m
        return m + math.log(math.fsum(math.exp(v - m) for v in row))

    for view in (x, torch.cat([x, x], dim=1)[:, :cols]):
        index, got = torch.ops.minisgl_cpu.argmax_logsumexp(view)
        assert index.dtype == torch.int64 and got.dtype == torch.float32
        rows = view.tolist()
        assert index.tolist() == [first_max(r) for r in rows]
        want = torch.tensor([lse(r) for r in rows], dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert sampling._argmax_lse == torch.ops.minisgl_cpu.argmax_logsumexp.default


def _draw_cases(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, list[tuple]]:
    """Logits and (temperature, top_k, top_p, min_p) per row: random scales, bf16-rounded rows
    (ties), every filter alone and together, a flat row, rows whose top-k or top-p set reaches
    far below the top token (the kernel's candidates widen: e down to 2^-40 and to 0)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 5 + 0.3)
    logits[::3] = logits[::3].bfloat16().float()
    params: list[tuple] = []
    for _ in range(rows):
        r = torch.rand(5, generator=g).tolist()
        params.append((0.2 + 1.5 * r[0], int(1 + r[1] * vocab * 1.1) if r[2] < 0.5 else -1,
                       0.01 + 0.99 * r[3] if r[4] < 0.5 else 1.0,
                       0.5 * r[2] if r[0] < 0.3 else 0.0))
    if rows >= 6 and vocab >= 16:
        logits[0] = 0.0  # flat
        params[0] = (1.0, -1, 0.5, 0.0)
        # one top token and a tail below e^-7.5 < 2^-10 holding a third of the mass and more:
        # the top-k or top-p set reaches into it, and its tokens win draws
        tail = torch.full((vocab,), -7.5)
        tail[vocab // 3] = 0.0
        for i in range(1, rows // 4):
            logits[i] = tail
            params[i] = (1.0, vocab // 2 + 3, 1.0, 0.0) if i % 2 else (1.0, -1, 0.9, 0.0)
        few = torch.full((vocab,), -60.0)  # the top-k set reaches below e^-25 > 2^-40
        few[: vocab // 2] = -25.0
        few[:8] = 0.0
        logits[rows // 4] = few
        params[rows // 4] = (1.0, vocab // 2 + 3, 1.0, 0.0)
        params[rows // 4 + 1] = (0.5, 1, 1.0, 0.0)  # top_k 1 with a temperature
        params[rows // 4 + 2] = (2.0, -1, 1e-9, 0.0)  # only the top token
    return logits, params


@pytest.mark.parametrize("vocab,rows", [(1, 3), (7, 8), (8, 8), (300, 64), (1000, 40),
                                        (49152, 12)])
def test_sample_rows_matches_plain_python(vocab: int, rows: int) -> None:
    """Each row's token as the float64 plain-Python draw (the filters' kept set, then the race
    with the documented hash), through a strided view too."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    logits, params = _draw_cases(vocab, rows, vocab)
    keys = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(7))
    t, k, p, mp = zip(*params)
    args = (torch.tensor(t, dtype=torch.float32), torch.tensor(k), torch.tensor(p, dtype=torch.float64),
            torch.tensor(mp, dtype=torch.float32), keys)
    want = [ref_draw(logits[i].tolist(), float(args[0][i]), k[i], p[i], float(args[3][i]),
                     int(keys[i])) for i in range(rows)]
    for view in (logits, torch.cat([logits, logits], dim=1)[:, :vocab]):
        got = torch.ops.minisgl_cpu.sample_rows(view, *args)
        assert got.dtype == torch.int64
        assert got.tolist() == want


def test_sample_rows_leaves_nan_and_inf_rows_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """-1 for a row with NaN or +-inf logits; the sampler answers it as the torch path does and
    the other rows as the kernel does."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    logits[1, 10] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    ones = torch.ones(5)
    got = torch.ops.minisgl_cpu.sample_rows(logits, ones, torch.full((5,), -1),
                                            torch.ones(5, dtype=torch.float64), torch.zeros(5),
                                            torch.arange(5))
    assert got[1:4].tolist() == [-1, -1, -1] and 0 <= int(got[0]) < 64 and 0 <= int(got[4]) < 64

    def reqs() -> list[Req]:
        return [Req(prompt_ids=[1], params=SamplingParams(temperature=0.9, top_p=0.9),
                    generator=torch.Generator().manual_seed(i)) for i in range(5)]

    sampler = sampling.TorchSampler(64, torch.device("cpu"))
    fast = sampler.sample(logits, reqs()).tokens
    monkeypatch.setattr(sampling, "_sample_rows_fn", None)
    assert torch.equal(fast, sampler.sample(logits, reqs()).tokens)


def test_sample_rows_frequencies() -> None:
    """20,000 draws of one row with top-k and top-p against its float64 probabilities."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    n, row = 20_000, [1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -0.5, 0.25, -3.0, 1.2]
    probs = softmax64(row, 0.8)
    kept = ref_keep(probs, 7, 0.9, 0.0)
    mass = sum(probs[i] for i in kept)
    expect = [probs[i] / mass if i in kept else 0.0 for i in range(len(row))]
    keys = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(12))
    got = torch.ops.minisgl_cpu.sample_rows(
        torch.tensor(row).expand(n, -1).contiguous(), torch.full((n,), 0.8), torch.full((n,), 7),
        torch.full((n,), 0.9, dtype=torch.float64), torch.zeros(n), keys).tolist()
    assert set(got) <= kept
    counts = Counter(got)
    for tok, want in enumerate(expect):
        freq = counts.get(tok, 0) / n
        assert abs(freq - want) <= 4 * math.sqrt(want * (1 - want) / n) + 2e-3, (tok, freq, want)


def test_sample_rows_top_k_below_the_first_candidates() -> None:
    """Top-k sets reaching far below 2^-10 of the top token on 49,152-token rows (k under and
    over the kernel's switch to the bands' count at 128; slopes putting the k-th token 2^-12 to
    2^-60 down; bf16 ties; with top_p too) against the plain-Python draw."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    vocab = 49152
    g = torch.Generator().manual_seed(21)
    rows, params = [], []
    for k, depth, top_p in ((40, 12, 1.0), (127, 20, 1.0), (128, 20, 1.0), (300, 14, 0.97),
                            (1000, 30, 1.0), (1000, 60, 0.999), (5000, 16, 1.0),
                            (200, 25, 1.0)):
        # token ranks spread so that rank k sits `depth` powers of two below the top
        ranks = torch.randperm(vocab, generator=g).float()
        row = -ranks * (depth * math.log(2) / k)
        if k in (300, 200):
            row = row.bfloat16().float()  # ties (200: many at the k-th value itself)
        rows.append(row)
        params.append((k, top_p))
    logits = torch.stack(rows)
    n = len(rows)
    keys = torch.randint(0, 2**62, (n,), generator=g)
    top_k = torch.tensor([k for k, _ in params])
    top_p = torch.tensor([p for _, p in params], dtype=torch.float64)
    got = torch.ops.minisgl_cpu.sample_rows(logits, torch.ones(n), top_k, top_p, torch.zeros(n),
                                            keys).tolist()
    want = [ref_draw(logits[i].tolist(), 1.0, params[i][0], params[i][1], 0.0, int(keys[i]))
            for i in range(n)]
    assert got == want


def test_sample_rows_top_p_exact_boundary() -> None:
    """Flat rows (every e exactly 1): top_p j/8 of 8 tokens keeps exactly the first j (the
    mass before token j reaches top_p; not the (j+1)-th), with top-k too; 300 keys each, so
    every kept token is drawn and a dropped one would be."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    n = 300
    keys = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(13))
    for top_k, top_p in ((-1, 0.25), (-1, 0.5), (-1, 0.75), (6, 0.5), (4, 0.75)):
        got = torch.ops.minisgl_cpu.sample_rows(
            torch.zeros(n, 8), torch.ones(n), torch.full((n,), top_k),
            torch.full((n,), top_p, dtype=torch.float64), torch.zeros(n), keys).tolist()
        want = ref_keep([1 / 8] * 8, top_k, top_p, 0.0)
        assert want == set(range(len(want)))
        assert set(got) == want, (top_k, top_p, Counter(got))


def test_sample_rows_bad_inputs_are_refused() -> None:
    assert cpu_kernels.load(), cpu_kernels.load_error
    ops = torch.ops.minisgl_cpu
    x, one = torch.zeros(2, 8), torch.ones(2)
    args = [one, torch.full((2,), -1), torch.ones(2, dtype=torch.float64), torch.zeros(2),
            torch.zeros(2, dtype=torch.int64)]
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        ops.sample_rows(x, torch.tensor([1.0, 0.0]), *args[1:])
    with pytest.raises(RuntimeError, match="top_p"):
        ops.sample_rows(x, args[0], args[1], torch.ones(2), *args[3:])
    with pytest.raises(RuntimeError, match="keys"):
        ops.sample_rows(x, *args[:4], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="float32"):
        ops.sample_rows(x.double(), *args)
    assert sampling._sample_rows_fn == ops.sample_rows.default


def test_sampler_with_kernel_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default sampler gives the same tokens and (to float32 rounding) log-probs with the
    kernels registered and without them, greedy, sampled (top-k, top-p, min-p), seeded and
    penalised rows mixed in one batch."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 1000, generator=g) * 3

    def reqs() -> list[Req]:
        out = []
        for i, params in enumerate([{"temperature": 0.0}, {"temperature": 0.8},
                                    {"temperature": 0.0, "repetition_penalty": 1.3},
                                    {"temperature": 0.0, "top_logprobs": 3},
                                    {"temperature": 0.7, "top_p": 0.9},
                                    {"temperature": 1.1, "top_k": 40, "min_p": 0.02},
                                    {"temperature": 0.9, "top_k": 5, "repetition_penalty": 1.2,
                                     "top_logprobs": 2}]):
            req = Req(prompt_ids=[1, 2, 3], params=SamplingParams(**params))
            req.generator = torch.Generator().manual_seed(11 + i)
            req.output_ids = [int(logits[i].argmax())]
            out.append(req)
        return out

    sampler = sampling.TorchSampler(1000, torch.device("cpu"))
    fast = sampler.sample(logits, reqs())
    monkeypatch.setattr(sampling, "_argmax_lse", None)
    monkeypatch.setattr(sampling, "_sample_rows_fn", None)
    slow = sampler.sample(logits, reqs())
    assert torch.equal(fast.tokens, slow.tokens)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=1e-6, atol=1e-6)
    assert fast.top_ids is not None and slow.top_ids is not None
    assert torch.equal(fast.top_ids, slow.top_ids)
    torch.testing.assert_close(fast.top_logprobs, slow.top_logprobs, rtol=1e-6, atol=1e-6)


def _pack(ws: list[torch.Tensor], int8: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Dense bf16 weights as the layer kernels take them: bf16_pack'd with no scales, or
    int8_pack'd per-row int8 with their scales."""
    if not int8:
        return [torch.ops.minisgl_cpu.bf16_pack(w) for w in ws], []
    qs = [quant.quantize_rows(w) for w in ws]
    return [torch.ops.minisgl_cpu.int8_pack(q) for q, _ in qs], [sc for _, sc in qs]


def _layer_reference(x, res, in_norm, post_norm, ws, scales, qkv_b, o_b, q_norm, k_norm, cos, sin,
                     k_pool, v_pool, out_loc, slots, kv_lens, q_start, q_lens, scale, eps, heads,
                     kv_heads, window):  # type: ignore[no-untyped-def]
    """decoder_layer's steps with PyTorch ops on bf16 tensors, rounding where minisgl's modules
    do (the Llama layer in minisgl-models); the linears and the attention are the kernels
    tested above."""
    def norm(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v32 = v.float()
        return w * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()

    kv8 = k_pool.dtype == torch.int8  # records of d values and a scale (_records)
    m, d = x.shape[0], k_pool.shape[2] - (4 if kv8 else 0)
    inter = ws[3].shape[1] * 2  # the down projection's inputs
    outs = [(heads + 2 * kv_heads) * d, x.shape[1], 2 * inter, x.shape[1]]

    def linear(v: torch.Tensor, i: int) -> torch.Tensor:
        n = outs[i]
        if scales:
            return torch.ops.minisgl_cpu.int8_linear(v, ws[i], scales[i], n)
        return torch.ops.minisgl_cpu.bf16_linear(v, ws[i], n)

    def rope(v: torch.Tensor) -> torch.Tensor:
        lo, hi = v.chunk(2, dim=-1)
        return v * cos[:, None] + torch.cat((-hi, lo), dim=-1) * sin[:, None]

    r = x if res is None else x + res
    qkv = linear(norm(r, in_norm), 0)
    if qkv_b is not None:
        qkv = qkv + qkv_b
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k = q.reshape(m, heads, d), k.reshape(m, kv_heads, d)
    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    q, k = rope(q), rope(k)
    store = _records if kv8 else (lambda t: t)
    k_pool[:, out_loc] = store(k.transpose(0, 1))
    v_pool[:, out_loc] = store(v.reshape(m, kv_heads, d).transpose(0, 1))
    a = cpu_kernels.paged_attention(q.contiguous(), k_pool, v_pool, slots, kv_lens, q_start,
                                    q_lens, scale, window)
    o = linear(a.reshape(m, -1), 1)
    r2 = (o if o_b is None else o + o_b) + r
    g, u = linear(norm(r2, post_norm), 2).chunk(2, dim=-1)
    return linear(F.silu(g) * u, 3), r2


@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("kv_lens", "q_lens", "window", "first", "extras", "sizes"), [
    ([37], [1], 0, False, False, (576, 1536)), ([1], [1], 0, True, False, (576, 1536)),
    ([5, 130, 64], [1, 1, 1], 0, False, False, (576, 1536)),
    ([90, 12], [1, 1], 24, False, False, (576, 1536)),
    ([40, 3], [1, 1], 0, False, True, (576, 1536)), ([7, 70], [1, 1], 0, False, True, (580, 1540)),
    # prefills and extends (a cached prefix before the new rows), alone and beside decode rows
    ([70], [70], 0, True, False, (576, 1536)), ([130, 20, 61], [40, 1, 61], 0, False, False,
                                                (576, 1536)),
    ([600], [600], 0, False, False, (576, 1536)),  # >= 512 rows: the linears split the rows
    ([90, 50], [90, 17], 24, False, False, (576, 1536)),
    ([33, 70], [33, 1], 0, False, True, (580, 1540))])
def test_decoder_layer_matches_its_steps(kv_lens: list[int], q_lens: list[int], window: int,
                                         first: bool, extras: bool, sizes: tuple[int, int],
                                         int8: bool, kv8: bool) -> None:
    """A step's layer in one call (cpu_layer.cpp) against the same steps op by op: SmolLM2's
    shapes (9 heads over 3 KV heads of 64, hidden 576, intermediate 1536), and a hidden size and
    intermediate size that are not multiples of 8 (the vector loops' tails); decode steps of
    requests of 1 to 130 keys, prefills (up to 600 rows) and extends after a cached prefix, mixed
    with decode rows; a sliding window, the first layer (no residual yet), q/k/v and o biases
    with per-head q and k norms (Qwen2's, Qwen3's); bf16 and int8 weights; bf16 and int8
    pools (kv8: the new K/V stored as the bytes KVPool.write stores for the same values)."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    if kv8 and not INT8_KV:
        pytest.skip("this build reads no int8 pool")
    g = torch.Generator().manual_seed(sum(kv_lens) + sum(q_lens) + window)
    (hidden, inter), heads, kv_heads, d, pages = sizes, 9, 3, 64, 1024
    m = sum(q_lens)
    x = torch.randn(m, hidden, generator=g).bfloat16()
    res = None if first else torch.randn(m, hidden, generator=g).bfloat16()
    in_norm, post_norm = (1 + 0.1 * torch.randn(2, hidden, generator=g)).bfloat16()
    qkv_b = o_b = q_norm = k_norm = None
    if extras:
        qkv_b, o_b = (torch.randn(n, generator=g).bfloat16()
                      for n in ((heads + 2 * kv_heads) * d, hidden))
        q_norm, k_norm = (1 + 0.1 * torch.randn(2, d, generator=g)).bfloat16()
    opt = (qkv_b, o_b, q_norm, k_norm)
    shapes = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden),
              (hidden, inter)]
    ws = [(torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16() for n, k in shapes]
    # each request's new rows at its last q_len positions
    pos = torch.cat([torch.arange(n - q, n) for n, q in zip(kv_lens, q_lens)])
    angle = pos[:, None].float() * (1e4 ** -(torch.arange(d // 2) / (d // 2)))[None]
    cos, sin = (torch.cat([f(angle)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))
    pool = torch.randn(2, kv_heads, pages, d, generator=g).bfloat16()
    if kv8:
        pool = _records(pool)
    perm = torch.randperm(pages - 1, generator=g) + 1  # slot 0 is never a request's
    lk = max(kv_lens)
    slots = torch.stack([perm[i * lk:(i + 1) * lk] for i in range(len(kv_lens))])
    out_loc = torch.cat([slots[i, n - q:n] for i, (n, q) in enumerate(zip(kv_lens, q_lens))])
    q_start = torch.tensor([0, *itertools.accumulate(q_lens)][:-1])
    index = (torch.tensor(kv_lens), q_start, torch.tensor(q_lens))
    packed, scales = _pack(ws, int8)
    got_pool, want_pool = pool.clone(), pool.clone()
    y, r2 = cpu_kernels.decoder_layer(x, res, in_norm, post_norm, packed, scales, *opt, cos,
                                      sin, got_pool[0], got_pool[1], out_loc, slots, *index,
                                      d ** -0.5, 1e-5, heads, kv_heads, window)
    want_y, want_r2 = _layer_reference(x, res, in_norm, post_norm, packed, scales, *opt, cos, sin,
                                       want_pool[0], want_pool[1], out_loc, slots, *index,
                                       d ** -0.5, 1e-5, heads, kv_heads, window)
    # The new K/V, at out_loc only. The norms' float32 sums run in another order than
    # PyTorch's, so now and then a bf16 rounding goes the other way and moves what follows by a
    # bf16 step of its inputs' size, also where a sum of such inputs comes out near 0: close,
    # not equal (measured: 2^-7 in 6 of 13,056 new K/V values of ~1-3, 2^-8 in 90 of 345,600
    # values of y at 600 rows, 2^-5 in 353 of 19,720 of r2 = o + bias + r with summands to ~8).
    new = torch.zeros(pages, dtype=torch.bool)
    new[out_loc] = True
    assert torch.equal(got_pool[:, :, ~new], want_pool[:, :, ~new])
    if m == len(kv_lens):  # decode steps: a row or three, no flip on these inputs
        assert torch.equal(got_pool, want_pool)
        torch.testing.assert_close(r2, want_r2)
        torch.testing.assert_close(y, want_y)
    kv = (_dequantized if kv8 else (lambda t: t))
    for got, want in ((kv(got_pool[:, :, new]), kv(want_pool[:, :, new])), (r2, want_r2),
                      (y, want_y)):
        torch.testing.assert_close(got, want, atol=2 ** -4, rtol=1.6e-2)


class _Layers:
    """Three SmolLM2-shaped layers with their own weights, norms, biases and q/k norms (where
    given), pools and windows (the middle one sliding), and one step's inputs for them."""

    def __init__(self, kv_lens: list[int], q_lens: list[int], extras: bool, int8: bool) -> None:
        g = torch.Generator().manual_seed(sum(kv_lens) * 7 + sum(q_lens))
        hidden, inter, heads, kv_heads, d, pages, n_layers = 576, 1536, 9, 3, 64, 512, 3
        self.windows, self.heads, self.kv_heads, self.d = [0, 24, 0], heads, kv_heads, d
        m = sum(q_lens)
        shapes = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden),
                  (hidden, inter)]
        self.weights: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.qkv_biases: list[torch.Tensor] = []
        self.o_biases: list[torch.Tensor] = []
        self.qk_norms: list[torch.Tensor] = []
        for _ in range(n_layers):
            ws = [(torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16() for n, k in shapes]
            layer_weights, layer_scales = _pack(ws, int8)
            self.weights += layer_weights
            self.scales += layer_scales
            self.norms += list((1 + 0.1 * torch.randn(2, hidden, generator=g)).bfloat16())
            if extras:
                self.qkv_biases.append(
                    torch.randn((heads + 2 * kv_heads) * d, generator=g).bfloat16())
                self.o_biases.append(torch.randn(hidden, generator=g).bfloat16())
                self.qk_norms += list((1 + 0.1 * torch.randn(2, d, generator=g)).bfloat16())
        pos = torch.cat([torch.arange(n - q, n) for n, q in zip(kv_lens, q_lens)])
        angle = pos[:, None].float() * (1e4 ** -(torch.arange(d // 2) / (d // 2)))[None]
        self.cos, self.sin = (torch.cat([f(angle)] * 2, dim=-1).bfloat16()
                              for f in (torch.cos, torch.sin))
        self.pools = torch.randn(n_layers, 2, kv_heads, pages, d, generator=g).bfloat16()
        perm = torch.randperm(pages - 1, generator=g) + 1
        lk = max(kv_lens)
        slots = torch.stack([perm[i * lk:(i + 1) * lk] for i in range(len(kv_lens))])
        out_loc = torch.cat([slots[i, n - q:n] for i, (n, q) in enumerate(zip(kv_lens, q_lens))])
        q_start = torch.tensor([0, *itertools.accumulate(q_lens)][:-1])
        self.index = (out_loc, slots, torch.tensor(kv_lens), q_start, torch.tensor(q_lens))
        self.x = torch.randn(m, hidden, generator=g).bfloat16()
        self.residual = torch.randn(m, hidden, generator=g).bfloat16()

    def run(self, pools: torch.Tensor) -> cpu_kernels.LayerRun:
        return cpu_kernels.LayerRun(self.norms, self.weights, self.scales, self.qkv_biases,
                                    self.o_biases, self.qk_norms, list(pools[:, 0]),
                                    list(pools[:, 1]), self.windows, self.d ** -0.5, 1e-5,
                                    self.heads, self.kv_heads)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("kv_lens", "q_lens", "extras"), [
    ([37], [1], False), ([5, 130, 64], [1, 1, 1], True), ([70, 20], [70, 1], False),
    ([33, 90], [33, 17], True)])
def test_decoder_layers_is_its_layers_one_after_another(kv_lens: list[int], q_lens: list[int],
                                                        extras: bool, int8: bool) -> None:
    """A run of layers bound once (LayerRun), then in one call (decoder_layers), against
    decoder_layer called for each in turn, the output and residual of one the input of the
    next: the same kernels in the same order, so equal to the bit, the pools too. Three layers
    (_Layers); decode, prefill and mixed steps, the first layers of a model (no residual) and
    later ones."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    t = _Layers(kv_lens, q_lens, extras, int8)
    for res in (None, t.residual):
        got_pools, want_pools = t.pools.clone(), t.pools.clone()
        y, r = cpu_kernels.decoder_layers(t.run(got_pools), t.x, res, t.cos, t.sin, *t.index)
        want_y, want_r = t.x, res
        for i in range(3):
            want_y, want_r = cpu_kernels.decoder_layer(
                want_y, want_r, t.norms[2 * i], t.norms[2 * i + 1], t.weights[4 * i:4 * i + 4],
                t.scales[4 * i:4 * i + 4],
                *((t.qkv_biases[i], t.o_biases[i], *t.qk_norms[2 * i:2 * i + 2])
                  if extras else (None,) * 4),
                t.cos, t.sin, want_pools[i, 0], want_pools[i, 1], *t.index, t.d ** -0.5, 1e-5,
                t.heads, t.kv_heads, t.windows[i])
        assert torch.equal(y, want_y) and torch.equal(r, want_r)
        assert torch.equal(got_pools, want_pools)
        assert not torch.equal(got_pools, t.pools)  # the new K/V were stored, in every layer
        assert all(not torch.equal(got_pools[i], t.pools[i]) for i in range(3))


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("kv_lens", "q_lens", "rows"), [
    ([70, 20], [70, 1], [69, 70]),  # a prefill's last row and a decode row: what a step samples
    ([33, 90], [33, 17], [32, 47, 48, 49]),  # a request's last 3 rows (a draft's)
    ([33, 90], [33, 17], [49]),  # nothing from the first request (a chunk that goes on)
    ([70, 20], [70, 1], [0, 40, 69]),  # not each request's last rows
    ([33, 90], [33, 17], [40, 3, 40]),  # out of order, one twice
    ([70, 20], [70, 1], []),  # none: the K/V only
    ([5, 130, 64], [1, 1, 1], [2, 0])])  # decode rows
def test_decoder_layers_last_layer_for_some_rows(kv_lens: list[int], q_lens: list[int],
                                                 rows: list[int], int8: bool) -> None:
    """decoder_layers(..., rows): the last layer's output and residual of those rows only, in
    their order, against the rows of the whole step's (the same up to the order of float32
    sums: the kept queries attend alone, the linears run on fewer rows), and every row's K/V
    stored in every layer as the whole step stores them (to the bit)."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    t = _Layers(kv_lens, q_lens, True, int8)
    whole_pools, some_pools = t.pools.clone(), t.pools.clone()
    y, r = cpu_kernels.decoder_layers(t.run(whole_pools), t.x, t.residual, t.cos, t.sin,
                                      *t.index)
    pick = torch.tensor(rows, dtype=torch.int64)
    got_y, got_r = cpu_kernels.decoder_layers(t.run(some_pools), t.x, t.residual, t.cos, t.sin,
                                              *t.index, pick)
    assert got_y.shape == got_r.shape == (len(rows), t.x.shape[1])
    assert torch.equal(some_pools, whole_pools)
    torch.testing.assert_close(got_r, r[pick], atol=2 ** -4, rtol=1.6e-2)
    torch.testing.assert_close(got_y, y[pick], atol=2 ** -4, rtol=1.6e-2)
    with pytest.raises(RuntimeError, match="rows"):
        cpu_kernels.decoder_layers(t.run(some_pools), t.x, t.residual, t.cos, t.sin, *t.index,
                                   torch.tensor([t.x.shape[0]]))


def _tiny_layer(rows: int) -> tuple[int, list[torch.Tensor], torch.Tensor, torch.Tensor,
                                    torch.Tensor]:
    """A small zero layer for the argument checks: (head_dim, packed qkv / o / gate_up / down
    weights of 2 heads over 1 KV head, x [rows, 64], a norm weight, cos = sin [rows, head_dim])."""
    hidden, d = 64, 32
    ws = [torch.ops.minisgl_cpu.bf16_pack(torch.zeros(n, k, dtype=torch.bfloat16))
          for n, k in [(4 * d, hidden), (hidden, 2 * d), (128, hidden), (hidden, 64)]]
    x, norm = torch.zeros(rows, hidden, dtype=torch.bfloat16), torch.ones(hidden, dtype=torch.bfloat16)
    return d, ws, x, norm, torch.zeros(rows, d, dtype=torch.bfloat16)


def test_bind_layers_refuses_lists_that_are_not_per_layer() -> None:
    """Every list holds its entries for each layer (or, for the optional ones, none at all): a
    list of another length is refused when the run is bound."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    d, ws, _, norm, _ = _tiny_layer(1)
    pools = [torch.zeros(1, 16, d, dtype=torch.bfloat16) for _ in range(4)]
    bias = torch.zeros(4 * d, dtype=torch.bfloat16)
    for norms, weights, qkv_biases, windows in (
            ([norm] * 4, ws * 2, [], [0]),  # 2 layers of norms and weights, 1 window
            ([norm] * 3, ws * 2, [], [0, 0]),  # 3 norms for 2 layers
            ([norm] * 4, ws, [], [0, 0]),  # 1 layer of weights
            ([norm] * 4, ws * 2, [bias], [0, 0])):  # a bias for one of 2 layers
        with pytest.raises(RuntimeError, match="per layer"):
            cpu_kernels.LayerRun(norms, weights, [], qkv_biases, [], [], pools[:2], pools[2:],
                                 windows, 0.1, 1e-5, 2, 1)


def test_decoder_layers_refuses_a_run_no_longer_bound() -> None:
    """A run's tensors stay with the kernels while its LayerRun lives and are dropped with it
    (an engine's weights and pools are freed with the engine), also where the collector runs
    while a graph is traced (under the fake-tensor mode, which refused an op call there and the
    run leaked: seen in tests/models); its id is refused after, before anything is written."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    d, ws, x, norm, cs = _tiny_layer(1)
    pools = [torch.zeros(1, 16, d, dtype=torch.bfloat16) for _ in range(2)]
    index = (torch.tensor([3]), torch.tensor([[1, 2, 3]]), torch.tensor([3]), torch.tensor([0]),
             torch.tensor([1]))
    run = cpu_kernels.LayerRun([norm] * 2, ws, [], [], [], [], pools[:1], pools[1:], [0], 0.1,
                               1e-5, 2, 1)
    cpu_kernels.decoder_layers(run, x, None, cs, cs, *index)  # bound: runs
    handle, pool = run.handle.clone(), weakref.ref(pools[0])
    with FakeTensorMode():
        del run, pools
        gc.collect()
    assert pool() is None  # the kernels let go of the pool
    with pytest.raises(RuntimeError, match="no bound run"):
        torch.ops.minisgl_cpu.decoder_layers(x, None, handle, cs, cs, *index)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_decoder_layers_few_rows_refuse_and_recover(threads: int) -> None:
    """A few-row step's layers run as one team of threads (cpu_layer.cpp): with 1 to 4
    threads (each taking grains of the linears and the attention, and the grains left in
    the others' shares when its own are done) the result is the per-layer op's to the bit,
    also with a busy process beside it (more runnable threads than cores: threads wait
    asleep and others take their grains), step after step; a refusal inside the team (the
    second layer's pools of two sizes) reaches the caller as the error it is, with no thread
    left waiting, and the next step runs."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        hidden, d = 64, 32
        ws = [torch.ops.minisgl_cpu.bf16_pack((torch.randn(n, k, generator=g) / 8).bfloat16())
              for n, k in [(4 * d, hidden), (hidden, 2 * d), (128, hidden), (hidden, 64)]] * 2
        norms = list((1 + 0.1 * torch.randn(4, hidden, generator=g)).bfloat16())
        x = torch.randn(2, hidden, generator=g).bfloat16()
        cs = torch.randn(2, d, generator=g).bfloat16()
        index = (torch.tensor([5, 9]), torch.tensor([[1, 2, 3, 5], [6, 7, 8, 9]]),
                 torch.tensor([4, 4]), torch.tensor([0, 1]), torch.tensor([1, 1]))
        pools = torch.randn(2, 2, 1, 16, d, generator=g).bfloat16()  # [layer, k/v, ...]
        bad = cpu_kernels.LayerRun(norms, ws, [], [], [], [], [pools[0, 0], pools[1, 0]],
                                   [pools[0, 1], pools[1, 1, :, :8]], [0, 0], 0.2, 1e-5, 2, 1)
        with pytest.raises(RuntimeError, match="k_pool, v_pool"):
            cpu_kernels.decoder_layers(bad, x, None, cs, cs, *index)
        got, want = pools.clone(), pools.clone()
        run = cpu_kernels.LayerRun(norms, ws, [], [], [], [], list(got[:, 0]), list(got[:, 1]),
                                   [0, 0], 0.2, 1e-5, 2, 1)
        y, r = cpu_kernels.decoder_layers(run, x, None, cs, cs, *index)
        wy, wr = x, None
        for i in range(2):
            wy, wr = cpu_kernels.decoder_layer(wy, wr, norms[2 * i], norms[2 * i + 1],
                                               ws[4 * i:4 * i + 4], [], None, None, None, None,
                                               cs, cs, want[i, 0], want[i, 1], *index, 0.2, 1e-5,
                                               2, 1)
        assert torch.equal(y, wy) and torch.equal(r, wr) and torch.equal(got, want)
        assert not torch.equal(got, pools) and y.abs().sum() > 0
        with busy_loops(1):
            for _ in range(20):
                again = pools.clone()
                run = cpu_kernels.LayerRun(norms, ws, [], [], [], [], list(again[:, 0]),
                                           list(again[:, 1]), [0, 0], 0.2, 1e-5, 2, 1)
                y, r = cpu_kernels.decoder_layers(run, x, None, cs, cs, *index)
                assert torch.equal(y, wy) and torch.equal(r, wr) and torch.equal(again, want)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("threads", "rows", "int8"), [
    (2, 1, False), (2, 6, False), (2, 13, False), (3, 5, False), (4, 2, False), (2, 3, True),
    (2, 9, True)])
def test_decoder_layers_tapered_grains(threads: int, rows: int, int8: bool) -> None:
    """Jobs of at least 16 items per thread go to the team in tapered grains (each thread's
    share cut at 8/16, 12/16, 14/16 and 15/16, the last cuts off the panel width where the
    linears take more rows than their GEMV): every output block is computed once, whoever takes
    it, so a few-row step's layers equal the per-layer op's (no team) to the bit, with weights
    wide enough to be tapered (gate-up's 256 blocks, down's and qkv's 36-64) and narrow ones
    (o: 4 blocks) side by side, bf16 and int8, with a busy process beside them."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(10 * threads + rows)
        hidden, d, inter, heads = 64, 64, 2048, 6
        shapes = [((heads + 2) * d, hidden), (hidden, heads * d), (2 * inter, hidden),
                  (hidden, inter)]
        dense = [(torch.randn(n, k, generator=g) / 8).bfloat16() for n, k in shapes] * 2
        ws, scales = _pack(dense, int8)
        norms = list((1 + 0.1 * torch.randn(4, hidden, generator=g)).bfloat16())
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        cs = torch.randn(rows, d, generator=g).bfloat16()
        keys = 5
        slots = torch.arange(rows * keys).reshape(rows, keys)
        index = (slots[:, -1].contiguous(), slots, torch.full((rows,), keys),
                 torch.arange(rows), torch.ones(rows, dtype=torch.long))
        pools = torch.randn(2, 2, 1, rows * keys, d, generator=g).bfloat16()
        want = pools.clone()
        wy, wr = x, None
        for i in range(2):
            wy, wr = cpu_kernels.decoder_layer(
                wy, wr, norms[2 * i], norms[2 * i + 1], ws[4 * i:4 * i + 4],
                scales[4 * i:4 * i + 4], None, None, None, None, cs, cs, want[i, 0], want[i, 1],
                *index, 0.125, 1e-5, heads, 1)
        assert wy.abs().sum() > 0 and not torch.equal(want, pools)
        with busy_loops(1):
            for _ in range(5):
                got = pools.clone()
                run = cpu_kernels.LayerRun(norms, ws, scales, [], [], [], list(got[:, 0]),
                                           list(got[:, 1]), [0, 0], 0.125, 1e-5, heads, 1)
                y, r = cpu_kernels.decoder_layers(run, x, None, cs, cs, *index)
                assert torch.equal(y, wy) and torch.equal(r, wr) and torch.equal(got, want)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("q_start", "q_lens", "match"), [
    ([0, 3], [2, 2], "follow each other"), ([1, 2], [1, 3], "follow each other"),
    ([0, 2], [2, 1], "add up to x's rows"), ([0, 4], [4, 0], "q_lens >= 1")])
def test_decoder_layer_refuses_rows_that_are_not_its_requests(q_start: list[int], q_lens: list[int],
                                                              match: str) -> None:
    """x's rows must be the requests' new rows back to back (the backend's layout): any other
    q_start / q_lens is refused before a row is read."""
    assert cpu_kernels.load(), cpu_kernels.load_error
    d, ws, x, norm, cs = _tiny_layer(4)
    pool = torch.zeros(1, 16, d, dtype=torch.bfloat16)
    slots = torch.arange(1, 9).reshape(2, 4)
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels.decoder_layer(x, None, norm, norm, ws, [], None, None, None, None, cs, cs, pool,
                                  pool.clone(), torch.arange(1, 5), slots, torch.tensor([4, 4]),
                                  torch.tensor(q_start), torch.tensor(q_lens), 0.1, 1e-5, 2, 1)
