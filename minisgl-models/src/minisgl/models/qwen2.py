"""Qwen2 / Qwen2.5: the Llama layout with biases on q, k and v (none on o_proj)."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM, Variant


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = Variant(qkv_bias=True, o_bias=False)
