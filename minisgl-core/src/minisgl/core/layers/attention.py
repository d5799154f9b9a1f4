from __future__ import annotations

import torch
from torch import nn

from minisgl.core.attention import ForwardContext


class AttentionLayer(nn.Module):
    """Paged attention of one decoder layer: delegates to the selected backend via the context."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return ctx.backend.forward(q, k, v, self.layer_id, ctx.meta)
