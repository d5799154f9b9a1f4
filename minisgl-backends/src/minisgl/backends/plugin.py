"""Entry point ``backends``: registers the attention backends of this package (lazily)."""

from __future__ import annotations

from minisgl.core import hookimpl
from minisgl.core.registry import Registry


@hookimpl
def minisgl_register_attention_backends(registry: Registry) -> None:
    registry.register("torch", "minisgl.backends.torch_native:TorchNativeBackend")
