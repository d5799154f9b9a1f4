"""Mistral: the Llama layout. A sliding attention window caps the context at the window
(``ModelConfig.sliding_window``), where windowed and full attention are the same."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
