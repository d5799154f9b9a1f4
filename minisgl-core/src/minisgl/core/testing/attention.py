"""Attention backend conformance: paged prefill/extend/decode against a float64 reference.

    from minisgl.core.testing.attention import run_case
    run_case("my-backend", page_size=16, num_heads=8, num_kv_heads=2, prefix_lens=[0, 5],
             new_lens=[7, 1], phase="prefill")
"""

from __future__ import annotations

import random

import torch

from minisgl.core.attention import AttentionBackend, BatchLayout
from minisgl.core.kvcache import KVPool, ReqToTokenTable
from minisgl.core.plugins import get_plugin_manager


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int = 0) -> torch.Tensor:
    """float64 causal attention of the last q.shape[0] positions of one request over k/v.

    q: [n, H, D]; k, v: [L, KVH, D] (the whole sequence, new tokens last). ``window`` > 0: the
    query at position p sees keys p - window + 1 .. p only. Returns [n, H * D].
    """
    n, heads, d = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)


def run_case(backend: str, *, page_size: int, num_heads: int, num_kv_heads: int,
             prefix_lens: list[int], new_lens: list[int], phase: str, head_dim: int = 16,
             dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
             atol: float = 2e-5, window: int = 0, kv_dtype: torch.dtype | None = None) -> None:
    """One batch: requests with ``prefix_lens`` tokens already cached and ``new_lens`` new ones.

    Checks the output against :func:`reference_attention` and that the new K/V landed in the
    request's slots; raises AssertionError otherwise. ``window`` > 0: the layer has a sliding
    window (for a backend with ``supports_sliding_window``). ``kv_dtype=torch.int8``: an int8
    pool; the reference then attends over the K/V as the pool holds them (each within half a
    quantization step of what was written, checked).
    """
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    dev = torch.device(device)
    totals = [p + n for p, n in zip(prefix_lens, new_lens)]
    pages_per_req = [-(-t // page_size) for t in totals]
    num_pages = sum(pages_per_req) + 3
    pool = KVPool(1, num_pages, page_size, num_kv_heads, head_dim, dtype, dev, kv_dtype)
    table = ReqToTokenTable(len(totals) + 2, max(pages_per_req) * page_size + page_size, dev)
    free_pages = list(range(1, num_pages))
    rnd.shuffle(free_pages)  # requests' pages are scattered, not contiguous

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(dev)

    seqs_k, seqs_v, rows, out_loc = [], [], [], []
    for i, (prefix, total) in enumerate(zip(prefix_lens, totals)):
        row = len(totals) - i  # rows in a non-trivial order
        pages = [free_pages.pop() for _ in range(pages_per_req[i])]
        table.write_pages(row, 0, pages, page_size)
        slots = table.table[row, :total]
        k, v = randn(total, num_kv_heads, head_dim), randn(total, num_kv_heads, head_dim)
        pool.write(0, slots[:prefix], k[:prefix], v[:prefix])  # the cached prefix
        seqs_k.append(k)
        seqs_v.append(v)
        rows.append(row)
        out_loc.append(slots[prefix:])
    scale = head_dim ** -0.5
    cls = get_plugin_manager().attention_backends.get(backend)
    impl: AttentionBackend = cls(pool, num_heads, num_kv_heads, head_dim, scale, dev)
    if window:
        assert impl.supports_sliding_window, f"backend {backend!r} has no sliding windows"
        impl.windows = [window]
    layout = BatchLayout(phase, list(new_lens), totals, rows, table.table, torch.cat(out_loc))
    meta = impl.prepare(layout)
    q = randn(sum(new_lens), num_heads, head_dim)
    new_k = torch.cat([k[p:] for k, p in zip(seqs_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(seqs_v, prefix_lens)])
    out = impl.forward(q, new_k, new_v, 0, meta)
    assert out.shape == (sum(new_lens), num_heads * head_dim), f"output shape {tuple(out.shape)}"
    if pool.quantized:  # what the pool holds, each value within half a step of what was written
        held = [pool.read(0, table.table[row, :total]) for row, total in zip(rows, totals)]
        for (hk, hv), k, v in zip(held, seqs_k, seqs_v):
            for got, want in ((hk.transpose(0, 1), k), (hv.transpose(0, 1), v)):
                step = want.float().abs().amax(-1, keepdim=True) / 127
                gap = (got.float() - want.float()).abs()  # bf16 rounds value x scale after
                assert (gap <= step / 2 + want.float().abs() / 256 + 1e-30).all(), \
                    "an int8 pool holds K/V further than half a step from what was written"
        seqs_k = [hk.transpose(0, 1) for hk, _ in held]
        seqs_v = [hv.transpose(0, 1) for _, hv in held]
        new_k = torch.cat([k[p:] for k, p in zip(seqs_k, prefix_lens)])
        new_v = torch.cat([v[p:] for v, p in zip(seqs_v, prefix_lens)])
    start = 0
    for i, n in enumerate(new_lens):
        ref = reference_attention(q[start:start + n].cpu(), seqs_k[i].cpu(), seqs_v[i].cpu(),
                                  scale, window)
        got = out[start:start + n].double().cpu()
        err = (got - ref).abs().max().item()
        assert err <= atol, f"request {i} (prefix {prefix_lens[i]}, new {n}): max abs err {err}"
        start += n
    slots = torch.cat(out_loc)
    got_k, got_v = pool.read(0, slots)  # [kv_heads, n, head_dim]
    assert torch.equal(got_k.transpose(0, 1), new_k), "new K not written to the request's slots"
    assert torch.equal(got_v.transpose(0, 1), new_v), "new V not written to the request's slots"
