"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama and Qwen) with scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, out)


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    assert scaling is not None
    if kind == "llama3":
        return _llama3_inv_freq(inv, scaling)
    if kind == "linear":
        return inv / float(scaling["factor"])
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        # float32 tables, kept out of state_dict; typed attributes for mypy
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.head_dim = head_dim
        # the tables in the activations' dtype, made on first use: a lookup then indexes them
        # with no cast op after (values the same: the cast commutes with the indexing)
        self._cast: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, HF's formula, as its two halves: [x1 cos - x2 sin,
        x2 cos + x1 sin] (the tables' halves are equal). The same products and sums, so the
        same bf16 roundings in eager mode (negating is exact); compiled, no negated copy of
        x's halves is materialized for the concatenation (it was 3.9% of a 4,096-token
        prefill step in 7 intermediate buffers)."""
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[..., : x1.shape[-1]], sin[..., : x1.shape[-1]]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) as [T, 1, d] for ``positions`` [T]; compute once per forward, use per layer."""
        if torch.compiler.is_compiling() or dtype == self.cos.dtype:
            return (self.cos[positions].unsqueeze(1).to(dtype),
                    self.sin[positions].unsqueeze(1).to(dtype))
        key = (dtype, self.cos.data_ptr())  # (new buffers after a .to(): cast again)
        if key not in self._cast:
            self._cast = {key: (self.cos.to(dtype), self.sin.to(dtype))}  # (the last one only)
        cos, sin = self._cast[key]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @classmethod
    def rotate(cls, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, heads, d] and k [T, kv_heads, d] by the looked-up angles."""
        cos, sin = cos_sin
        return cls._rotate(q, cos, sin), cls._rotate(k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, k, self.lookup(positions, q.dtype))
