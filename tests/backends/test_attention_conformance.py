"""Every attention backend against a float64 reference over a paged cache (prefill, extend, decode)."""

from __future__ import annotations

import pytest
import torch

from minisgl.core.testing.attention import run_case

HEADS = [(4, 4), (4, 2), (9, 3), (8, 1)]  # MHA, GQA, SmolLM2's 9/3, MQA
# (phase, prefix_lens, new_lens): prefills, extends beside prefills, decodes up to 300 keys
MIXED_BATCHES = [
    ("prefill", [0, 0, 0], [1, 17, 40]),
    ("prefill", [16, 3, 70, 0], [5, 30, 1, 9]),
    ("decode", [0, 1, 15, 16, 100, 63, 300], [1] * 7),
]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_prefill_without_prefix(attention_backend: str, page_size: int, heads: int,
                                kv_heads: int) -> None:
    run_case(attention_backend, page_size=page_size, num_heads=heads, num_kv_heads=kv_heads,
             prefix_lens=[0, 0, 0], new_lens=[1, 17, 40], phase="prefill")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_extend_over_cached_prefix(attention_backend: str, page_size: int, heads: int,
                                   kv_heads: int) -> None:
    run_case(attention_backend, page_size=page_size, num_heads=heads, num_kv_heads=kv_heads,
             prefix_lens=[16, 3, 70, 0], new_lens=[5, 30, 1, 9], phase="prefill")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_decode(attention_backend: str, page_size: int, heads: int, kv_heads: int) -> None:
    run_case(attention_backend, page_size=page_size, num_heads=heads, num_kv_heads=kv_heads,
             prefix_lens=[0, 1, 15, 16, 100, 63], new_lens=[1] * 6, phase="decode")


def test_long_context_crosses_buckets(attention_backend: str) -> None:
    run_case(attention_backend, page_size=16, num_heads=4, num_kv_heads=2,
             prefix_lens=[300, 0], new_lens=[1, 1], phase="decode")
    run_case(attention_backend, page_size=16, num_heads=4, num_kv_heads=2,
             prefix_lens=[129], new_lens=[70], phase="prefill")


def test_bfloat16(attention_backend: str) -> None:
    run_case(attention_backend, page_size=4, num_heads=4, num_kv_heads=2, prefix_lens=[10, 0],
             new_lens=[6, 12], phase="prefill", dtype=torch.bfloat16, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the CPU kernel
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("phase", "prefix_lens", "new_lens"), MIXED_BATCHES)
def test_sliding_window(attention_backend: str, dtype: torch.dtype, page_size: int, phase: str,
                        prefix_lens: list[int], new_lens: list[int]) -> None:
    """A layer with a sliding window of 12 keys, shorter than most of these requests."""
    from minisgl.core.plugins import get_plugin_manager

    if not get_plugin_manager().attention_backends.get(attention_backend).supports_sliding_window:
        pytest.skip(f"{attention_backend} has no sliding windows (the engine caps contexts)")
    run_case(attention_backend, page_size=page_size, num_heads=9, num_kv_heads=3, head_dim=64,
             prefix_lens=prefix_lens, new_lens=new_lens, phase=phase, dtype=dtype,
             atol=2e-5 if dtype == torch.float32 else 3e-2, window=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the CPU kernel
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("phase", "prefix_lens", "new_lens"), MIXED_BATCHES)
@pytest.mark.parametrize("window", [0, 12])
def test_int8_kv_pool(attention_backend: str, dtype: torch.dtype, page_size: int, phase: str,
                      prefix_lens: list[int], new_lens: list[int], window: int) -> None:
    """An int8 pool (kv_cache_dtype="int8"): attention over the K/V as the pool holds them,
    with and without a sliding window."""
    from minisgl.core.plugins import get_plugin_manager

    backend = get_plugin_manager().attention_backends.get(attention_backend)
    if not backend.supports_int8_kv or (window and not backend.supports_sliding_window):
        pytest.skip(f"{attention_backend} reads no int8 pool or has no sliding windows")
    run_case(attention_backend, page_size=page_size, num_heads=9, num_kv_heads=3, head_dim=64,
             prefix_lens=prefix_lens, new_lens=new_lens, phase=phase, dtype=dtype,
             atol=2e-5 if dtype == torch.float32 else 3e-2, kv_dtype=torch.int8, window=window)


def test_reference_is_not_trivial() -> None:
    """The reference itself: one query over one key returns that value; causality holds."""
    from minisgl.core.testing.attention import reference_attention

    q, k, v = torch.randn(3, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    out = reference_attention(q, k, v, 0.5).view(3, 2, 4)
    assert torch.allclose(out[0], v[0].double().expand(2, 4))  # first position sees only itself
    assert not torch.allclose(out[2], v[2].double().expand(2, 4))
    # a window of 1: every position sees only itself
    out = reference_attention(q, k, v, 0.5, window=1).view(3, 2, 4)
    assert torch.allclose(out, v.double().expand(3, 2, 4))
