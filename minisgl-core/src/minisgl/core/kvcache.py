"""The paged KV pool, its page allocator and the request -> token-slot table.

Slots are token positions in the pool: slot = page * page_size + offset. Page 0 is reserved as a
scratch page that padded (bucketed) tokens may write to, so it is never handed out.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from minisgl.core.config import ModelConfig


class KVPool:
    """K and V for every layer: ``k[layer]`` is ``[kv_heads, num_pages * page_size, head_dim]``.

    Head-major, so gathering a batch's slots yields each head's keys contiguously: attention
    reads them without another copy (the copy was ~a quarter of a CPU decode step).

    ``kv_dtype=torch.int8`` (``kv_cache_dtype="int8"``) stores each (head, slot) row as
    ``head_dim`` int8 values and its float32 scale in the 4 bytes after them: ``k[layer]`` is
    int8 ``[kv_heads, slots, head_dim + 4]``, a row x is ``round(x * 127 / max|x|)`` times
    ``max|x| / 127`` (``quantize_kv_rows``), half the bytes of bf16 for attention to read, and the
    kernels find a row's scale beside its values. ``read`` returns ``dtype`` either way.

    On CPU each layer's K and V is an anonymous memory map of its own, which the kernel hands out
    zeroed page by page as K/V are first written: memory is resident where requests have been,
    not the whole budget from startup (``torch.zeros`` wrote every page up front)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype | None = None) -> None:
        if kv_dtype not in (None, dtype, torch.int8):
            raise ValueError(f"kv_dtype: {kv_dtype} is neither the model's dtype nor torch.int8")
        self.num_pages, self.page_size, self.head_dim = num_pages, page_size, head_dim
        self.dtype = dtype  # what read() returns
        self.quantized = kv_dtype == torch.int8
        store = torch.int8 if self.quantized else dtype
        shape = (kv_heads, num_pages * page_size, head_dim + 4 if self.quantized else head_dim)
        if torch.device(device).type == "cpu":
            tensors = _lazy_zeros(2 * num_layers, shape, store)
        else:
            tensors = [torch.zeros(shape, dtype=store, device=device)
                       for _ in range(2 * num_layers)]
        self.k, self.v = tensors[:num_layers], tensors[num_layers:]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (any shape S) as [kv_heads, *S, head_dim], in ``dtype``."""
        flat = slots.reshape(-1)
        k, v = self.k[layer].index_select(1, flat), self.v[layer].index_select(1, flat)
        if self.quantized:
            k, v = self._dequantize(k), self._dequantize(v)
        shape = (k.shape[0], *slots.shape, k.shape[-1])
        return k.view(shape), v.view(shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([n, kv_heads, head_dim]) at ``slots`` ([n])."""
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            rows = x.transpose(0, 1)
            if self.quantized:
                values, scales = quantize_kv_rows(rows.to(self.dtype))
                rows = torch.cat([values, scales.unsqueeze(-1).view(torch.int8)], dim=-1)
            pool.index_copy_(1, slots, rows.to(pool.dtype))

    def _dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """int8 records [..., head_dim + 4] as [..., head_dim] in ``dtype``."""
        d = self.head_dim
        scales = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return (rows[..., :d].float() * scales).to(self.dtype)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, kv_heads: int, dtype: torch.dtype,
                       kv_dtype: torch.dtype | None = None) -> int:
        row = cfg.head_dim + 4 if kv_dtype == torch.int8 else cfg.head_dim * dtype.itemsize
        return cfg.num_layers * 2 * page_size * kv_heads * row

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as int8 values [..., D] and float32 scales [...]: per row, ``inv = 127 /
    max|x|`` (0 for a row of zeros), values ``round(x * inv)`` (half to even), scale ``max|x| *
    (1 / 127)``, all in float32: the CPU kernels' store (cpu_layer.cpp) computes the same
    bytes. (Not ``layers.quant.quantize_rows``, the weights' quantizer: it divides by the scale,
    which a ``-ffast-math`` store would not reproduce to the bit, and keeps a zero row's scale
    above 0.)"""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    c = torch.full_like(amax, 127.0)  # (a Python number over a tensor is a reciprocal times it)
    inv = torch.where(amax > 0, c / amax, torch.zeros_like(amax))
    values = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    # times 1/127 rounded to float32, not over 127: a C++ compiler with -ffast-math makes a
    # division by a constant that product, and the two must write the same scale
    return values, amax * torch.full_like(amax, 1 / 127)


def _lazy_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """``count`` zero tensors of ``shape``, each in a private anonymous map of its own (separate
    storages: compiled graphs take them as unaliased inputs). The kernel maps a zeroed page on
    its first touch, ~1.6 us per 4 KiB here: ~9 us per token of SmolLM2's K/V, about 1% of a
    prefill or decode step, once per page (torch.zeros paid it for the whole pool at startup)."""
    size = math.prod(shape) * dtype.itemsize
    maps = (mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for _ in range(count))
    return [torch.frombuffer(m, dtype=dtype).view(shape) for m in maps]  # keeps its map alive


def memory_info() -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return (int(fields["MemTotal"].split()[0]) * 1024,
                int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None


def check_pool_fits(num_bytes: int, field: str) -> None:
    """A CPU pool is resident only where written, so one larger than the machine's memory would
    start and then be killed by the kernel as requests fill it: refuse it up front (``field``
    names the setting), and warn where it is more than the memory available now."""
    info = memory_info()
    if info is None:
        return
    total, available = info
    gib = num_bytes / (1 << 30)
    if num_bytes > total:
        raise ValueError(f"{field}: the KV pool would take {gib:.1f} GiB, more than this "
                         f"machine's {total / (1 << 30):.1f} GiB of memory")
    if num_bytes > available:
        logging.getLogger("minisgl.engine").warning(
            "the KV pool may take %.1f GiB (%s) and %.1f GiB of memory is available now: "
            "the kernel may kill the process as requests fill it", gib, field,
            available / (1 << 30))


class PageAllocator:
    """The free pages of the pool (page 0 excluded). Double frees are caught.

    Where pages go matters on CPUs: decode attention streams every request's K/V page by page,
    and pages that follow each other in memory stream ~1.6x faster than scattered ones (hardware
    prefetch, fewer TLB misses; docs/benchmarks.md). A plain free list hands out whatever was
    freed last, so after the prefix cache has evicted for a while every request's pages lie all
    over the pool. So ``alloc`` places pages in runs:

    * ``after``: a request growing by a page takes the one right after its last (``after``) when
      that is free;
    * otherwise the first free run of ``n + room`` pages at or past a cursor (next fit, wrapping
      once), of which the request takes the first ``n``; the cursor moves past the ``room`` it
      leaves free behind them, where the same request's next pages will fit (``after``);
    * otherwise the first free run of ``n``, else the lowest ``n`` free pages.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 pages (1 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._free = bytearray(b"\x01") * num_pages  # 1 where free
        self._free[0] = 0
        self._num_free = num_pages - 1
        self._cursor = 1

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def is_free(self, page: int) -> bool:
        return bool(self._free[page])

    def free_pages(self) -> list[int]:
        """The free page ids, ascending."""
        return [p for p, f in enumerate(self._free) if f]

    def alloc(self, n: int, after: int | None = None, room: int = 0) -> list[int] | None:
        """``n`` pages, or None (and nothing taken) when fewer are free. ``after``: the page the
        new ones should follow (the request's last); ``room``: pages the request may still
        grow by, to be left free after them where possible."""
        if n > self._num_free:
            return None
        if n <= 0:
            return []
        free, run = self._free, b"\x01" * n
        if after is not None and 0 < after < self.num_pages and free[after + 1: after + 1 + n] == run:
            start = after + 1
        else:
            start = self._find(b"\x01" * (n + room)) if room > 0 else -1
            if start < 0:
                start = self._find(run)
            if start >= 0:
                self._cursor = min(start + n + room, self.num_pages - 1)
        if start >= 0:
            pages = list(range(start, start + n))
            free[start: start + n] = bytes(n)
        else:  # no run of n: the lowest free pages
            pages, pos = [], 0
            while len(pages) < n:
                pos = free.index(1, pos)
                pages.append(pos)
                free[pos] = 0
        self._num_free -= n
        return pages

    def _find(self, run: bytes) -> int:
        start = self._free.find(run, self._cursor)
        return start if start >= 0 else self._free.find(run, 1, self._cursor + len(run) - 1)

    def free(self, pages: list[int]) -> None:
        seen: set[int] = set()  # checked before any is freed: a bad call changes nothing
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._free[p] or p in seen:
                raise RuntimeError(f"freeing page {p} that is not allocated")
            seen.add(p)
        for p in pages:
            self._free[p] = 1
        self._num_free += len(pages)


class ReqToTokenTable:
    """Row per running request; ``table[row, i]`` is the slot holding K/V of its token ``i``."""

    def __init__(self, max_reqs: int, max_len: int, device: torch.device) -> None:
        self.table = torch.zeros((max_reqs, max_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self.max_len = max_len

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert row not in self._free_rows, f"row {row} freed twice"
        self._free_rows.append(row)

    def write_pages(self, row: int, start_page_idx: int, pages: list[int], page_size: int) -> None:
        """Record the slots of ``pages`` as the request's pages number start_page_idx...."""
        if not pages:
            return
        p = torch.tensor(pages, dtype=torch.int64)
        slots = (p[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
        start = start_page_idx * page_size
        end = min(start + slots.numel(), self.max_len)
        self.table[row, start:end] = slots[: end - start].to(self.table.device)
