"""Core's own plugin: the default sampler and the fcfs policy, registered like any third party."""

from __future__ import annotations

from minisgl.core.hookspecs import hookimpl
from minisgl.core.registry import Registry


@hookimpl
def minisgl_register_samplers(registry: Registry) -> None:
    registry.register("default", "minisgl.core.sampling:TorchSampler")


@hookimpl
def minisgl_register_schedulers(registry: Registry) -> None:
    registry.register("fcfs", "minisgl.core.policy:FCFSPolicy")
    registry.register("lpm", "minisgl.core.policy:LongestPrefixMatchPolicy")
