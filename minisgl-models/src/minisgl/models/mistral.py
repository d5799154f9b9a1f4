"""Mistral: the Llama layout. Mistral v0.1's sliding attention window (every layer,
``ModelConfig.sliding_window``) is the attention backend's to apply (``AttentionBackend.windows``)."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
