"""Llama (and SmolLM2): GQA, RoPE with llama3 scaling, tied or untied LM head.

Qwen2, Qwen3 and Mistral are this layout with another ``Variant`` (their own modules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minisgl.core.attention import AttentionBackend, ForwardContext
from minisgl.core.config import ModelConfig
from minisgl.core.distributed import Communicator
from minisgl.core.layers import (
    AttentionLayer,
    DecoderLayerParts,
    FusedLayers,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    bind_fused_decoder_layers,
)
from minisgl.core.model import CausalLM

CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """What the architectures of the Llama family change in its layers."""

    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    qkv_bias: bool | None = None  # biases on q/k/v; None: the config's attention_bias
    o_bias: bool | None = None  # a bias on o_proj; None: the config's attention_bias


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, comm: Communicator, variant: Variant) -> None:
        super().__init__()
        d = cfg.head_dim
        qkv_bias, o_bias = (cfg.attention_bias if b is None else b
                            for b in (variant.qkv_bias, variant.o_bias))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          qkv_bias, comm)
        self.heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, o_bias, comm, "o_proj")
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if variant.qk_norm else None
        self.attn = AttentionLayer(layer_id, self.heads, self.kv_heads, d)
        self.head_dim = d

    def forward(self, rope: CosSin, x: torch.Tensor, ctx: ForwardContext,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """O of the attention of every row of x (its K/V stored), or of ``rows`` only."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, k = q.view(t, self.heads, d), k.view(t, self.kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = RotaryEmbedding.rotate(q, k, rope)
        a = self.attn(q, k, v, ctx)
        return self.o_proj(a if rows is None else a[rows])


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator) -> None:
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [n, n], False, comm,
                                                       "intermediate_size")
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, False, comm, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, comm: Communicator, variant: Variant) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, comm, variant)
        self.mlp = LlamaMLP(cfg, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn, mlp = self.self_attn, self.mlp
        self.parts = DecoderLayerParts(layer_id, self.input_layernorm, attn.qkv_proj, attn.o_proj,
                                       self.post_attention_layernorm, mlp.gate_up_proj,
                                       mlp.down_proj, attn.q_norm, attn.k_norm)

    def forward(self, rope: CosSin, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) of every row, or of ``rows`` only (every row's K/V stored)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, ctx, rows)
        if rows is not None:
            residual = residual[rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, variant: Variant) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, comm, variant) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # one cos/sin table for all layers, looked up once per forward
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling)
        self.parts = [layer.parts for layer in self.layers]
        self.fused: FusedLayers | None = None  # the layers in one call, where a backend has it

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.lookup(positions, x.dtype)
        fused = None if self.fused is None else self.fused(x, residual, rope, ctx)
        if fused is not None:
            x, residual = fused
        else:  # the last layer for ctx.out_rows only (ForwardContext)
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x, residual = layer(rope, x, residual, ctx, ctx.out_rows if i == last else None)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    variant = Variant()
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config: ModelConfig, comm: Communicator) -> None:
        super().__init__(config, comm)
        self.model = LlamaModel(config, comm, self.variant)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, comm)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def bind(self, backend: AttentionBackend) -> None:
        self.model.fused = bind_fused_decoder_layers(self.model.parts, backend)

    @property
    def layers_in_one_call(self) -> bool:
        return self.model.fused is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
