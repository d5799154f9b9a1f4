"""A model plugin: Llama registered under its own architecture name."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class FixtureLlamaForCausalLM(LlamaForCausalLM):
    """Same weights and maths as Llama; a checkpoint selects it with
    ``"architectures": ["FixtureLlamaForCausalLM"]`` in its config.json."""
