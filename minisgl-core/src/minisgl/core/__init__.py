"""minisgl core: plugin system, KV cache, scheduler, engine and the offline LLM API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.core.hookspecs import hookimpl
from minisgl.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl.core.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "hookimpl"]


def __getattr__(name: str) -> Any:  # LLM pulls in the engine; import it only when asked for
    if name in ("LLM", "RequestOutput"):
        from minisgl.core.gc_pause import paused

        with paused():  # torch and the engine's modules (gc_pause)
            from minisgl.core import llm
        return getattr(llm, name)
    raise AttributeError(name)
