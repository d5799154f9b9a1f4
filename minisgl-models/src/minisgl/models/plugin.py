"""Entry point ``models``: registers this package's architectures (lazily, by import path)."""

from __future__ import annotations

from minisgl.core import hookimpl
from minisgl.core.registry import Registry


@hookimpl
def minisgl_register_models(registry: Registry) -> None:
    registry.register("LlamaForCausalLM", "minisgl.models.llama:LlamaForCausalLM")
    registry.register("Qwen3ForCausalLM", "minisgl.models.qwen3:Qwen3ForCausalLM")
