"""Qwen3 (dense): the Llama layout plus RMSNorm on each head of q and k."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
