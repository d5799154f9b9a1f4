"""Entry point ``models``: registers this package's architectures (lazily, by import path)."""

from __future__ import annotations

from minisgl.core import hookimpl
from minisgl.core.registry import Registry


@hookimpl
def minisgl_register_models(registry: Registry) -> None:
    registry.register("LlamaForCausalLM", "minisgl.models.llama:LlamaForCausalLM")
    registry.register("Qwen2ForCausalLM", "minisgl.models.qwen2:Qwen2ForCausalLM")
    registry.register("Qwen3ForCausalLM", "minisgl.models.qwen3:Qwen3ForCausalLM")
    registry.register("MistralForCausalLM", "minisgl.models.mistral:MistralForCausalLM")
