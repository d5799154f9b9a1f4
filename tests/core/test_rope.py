"""RotaryEmbedding.lookup: the tables cast once per dtype give what casting each lookup gave."""

from __future__ import annotations

import torch

from minisgl.core.layers import RotaryEmbedding


def test_lookup_in_bf16_is_the_float32_tables_cast() -> None:
    rope = RotaryEmbedding(64, 512, 1e5, {"rope_type": "llama3", "factor": 8.0,
                                            "original_max_position_embeddings": 256})
    pos = torch.tensor([0, 1, 7, 300, 511, 7])
    for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
        cos, sin = rope.lookup(pos, dtype)
        assert cos.shape == sin.shape == (6, 1, 64) and cos.dtype == sin.dtype == dtype
        assert torch.equal(cos, rope.cos[pos].unsqueeze(1).to(dtype))
        assert torch.equal(sin, rope.sin[pos].unsqueeze(1).to(dtype))
    # a rotation through the looked-up angles: the same bf16 values as HF's formula on them
    q, k = torch.randn(6, 9, 64).bfloat16(), torch.randn(6, 3, 64).bfloat16()
    cos, sin = rope.lookup(pos, torch.bfloat16)
    half = lambda x: torch.cat((-x[..., 32:], x[..., :32]), dim=-1)  # noqa: E731
    rq, rk = rope.rotate(q, k, (cos, sin))
    assert torch.equal(rq, q * cos + half(q) * sin) and torch.equal(rk, k * cos + half(k) * sin)
    # new buffers (the module moved: here to float64) are cast again, not the old copy read
    before = rope._cast[torch.bfloat16, rope.cos.data_ptr()][0]
    rope.to(torch.float64)
    with torch.no_grad():
        rope.cos.mul_(0.5)
    cos, _ = rope.lookup(pos, torch.bfloat16)
    assert torch.equal(cos, rope.cos[pos].unsqueeze(1).to(torch.bfloat16))
    assert not torch.equal(cos, before[pos].unsqueeze(1))
