"""Qwen3 (dense): the Llama layout plus RMSNorm on each head of q and k."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM, Variant


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = Variant(qk_norm=True)
