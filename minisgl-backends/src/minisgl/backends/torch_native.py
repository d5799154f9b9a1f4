"""Paged attention in plain PyTorch, for CPU and CUDA.

Each request's queries and cached keys are gathered into a padded [B, Lq, ...] / [B, Lk, ...]
layout with index tensors built once per step, then one scaled_dot_product_attention call with a
boolean mask handles prefill, extend (cached prefix + new tokens) and decode alike. All metadata are
tensors and Lq/Lk are rounded up to buckets, so the per-layer code has no data-dependent Python
branches (compilable, graph-capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.core.attention import AttentionBackend, BatchLayout

KV_BUCKET = 64  # Lk is padded to a multiple of this


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class TorchNativeMeta:
    out_loc: torch.Tensor  # [T] slots the new K/V go to
    q_index: torch.Tensor  # [B, Lq] flat token index of each padded query (padding -> 0)
    kv_slots: torch.Tensor  # [B, Lk] pool slot of each key (padding -> scratch slot 0)
    mask: torch.Tensor  # [B, 1, Lq, Lk] True where attention is allowed
    out_index: torch.Tensor  # [T] row of the padded [B * Lq] output holding each token


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [N, heads, D] picked by index [B, L] -> contiguous [B, heads, L, D].

    index_select on the flattened rows is ~4x faster than advanced indexing on CPU, and matmul
    on a contiguous result is ~9x faster than on the transposed view (measured on 2 cores).
    """
    n, heads, d = rows.shape
    picked = rows.reshape(n, heads * d).index_select(0, index.flatten())
    return picked.view(*index.shape, heads, d).transpose(1, 2).contiguous()


class TorchNativeBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout) -> TorchNativeMeta:
        dev = self.device
        q_lens = torch.tensor(layout.q_lens, dtype=torch.int64)
        kv_lens = torch.tensor(layout.kv_lens, dtype=torch.int64)
        b = len(layout.q_lens)
        lq = max(layout.q_lens) if layout.phase == "prefill" else 1
        lk = _round_up(max(layout.kv_lens), KV_BUCKET)
        lk = min(lk, layout.req_to_token.shape[1])
        starts = torch.cumsum(q_lens, 0) - q_lens
        i = torch.arange(lq)
        q_valid = i[None, :] < q_lens[:, None]  # [B, Lq]
        q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
        q_pos = (kv_lens - q_lens)[:, None] + i[None, :]  # absolute position of each query
        k_pos = torch.arange(lk)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
        rows = torch.tensor(layout.rows, dtype=torch.int64, device=layout.req_to_token.device)
        kv_slots = layout.req_to_token[rows, :lk]
        kv_slots = torch.where(k_pos.to(kv_slots.device)[None, :] < kv_lens.to(kv_slots.device)[:, None], kv_slots, 0)
        out_index = (torch.arange(b)[:, None] * lq + i[None, :])[q_valid]
        return TorchNativeMeta(
            out_loc=layout.out_loc.to(dev),
            q_index=q_index.to(dev),
            kv_slots=kv_slots.to(dev),
            mask=mask[:, None].to(dev),
            out_index=out_index.to(dev),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: TorchNativeMeta) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache.index_copy_(0, meta.out_loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.out_loc, v.to(v_cache.dtype))
        kp, vp = _gather(k_cache, meta.kv_slots), _gather(v_cache, meta.kv_slots)
        if meta.q_index.shape[1] == 1:  # decode: one query per request, already in order
            return self._decode(q, kp, vp, meta.mask)
        b, lq = meta.q_index.shape
        qp = _gather(q, meta.q_index)  # [B, H, Lq, D]
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(b * lq, self.num_heads * self.head_dim)
        return out.index_select(0, meta.out_index)

    def _decode(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        # Two batched matmuls with the query heads of each KV head grouped together: on CPU this
        # is ~20x faster than bf16 scaled_dot_product_attention for a single query (measured:
        # 0.37 vs 7 ms for 16 requests x 576 keys), and KV heads are never repeated in memory.
        b, kvh = q.shape[0], self.num_kv_heads
        qg = q.view(b, kvh, self.num_heads // kvh, self.head_dim)
        scores = torch.matmul(qg, kp.transpose(-1, -2)).float() * self.scale  # [B, KVH, G, Lk]
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
        out = torch.matmul(scores.softmax(-1).to(vp.dtype), vp)  # [B, KVH, G, D]
        return out.reshape(b, self.num_heads * self.head_dim)
