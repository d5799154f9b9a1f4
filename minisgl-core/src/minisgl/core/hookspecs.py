"""Every minisgl hook. Plugins implement these with ``@minisgl.core.hookimpl``.

All hooks are registration hooks: they receive a typed :class:`~minisgl.core.registry.Registry`
and call ``registry.register(name, target)``. They are *not* firstresult: every plugin's
implementation is called, and the return value is ignored. Registration must be cheap: pass a
``"module:attr"`` string (imported on first use) or an already-imported object; never touch a
device or the network here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from minisgl.core.registry import Registry

PROJECT = "minisgl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def minisgl_register_models(registry: Registry) -> None:
    """Register model classes by HF architecture name (``config.json`` ``architectures[0]``).

    Target: a class following :class:`minisgl.core.model.CausalLM` (constructed with
    ``(model_config, comm)``). Called for every plugin; return value ignored.
    """


@hookspec
def minisgl_register_attention_backends(registry: Registry) -> None:
    """Register attention backends by name (``LLM(attention_backend=NAME)``).

    Target: a subclass of :class:`minisgl.core.attention.AttentionBackend`.
    Called for every plugin; return value ignored.
    """


@hookspec
def minisgl_register_schedulers(registry: Registry) -> None:
    """Register batching policies by name (``LLM(schedule_policy=NAME)``).

    Target: a subclass of :class:`minisgl.core.policy.SchedulePolicy`.
    Called for every plugin; return value ignored.
    """


@hookspec
def minisgl_register_samplers(registry: Registry) -> None:
    """Register samplers by name (``LLM(sampler=NAME)``).

    Target: a subclass of :class:`minisgl.core.sampling.Sampler`.
    Called for every plugin; return value ignored.
    """
