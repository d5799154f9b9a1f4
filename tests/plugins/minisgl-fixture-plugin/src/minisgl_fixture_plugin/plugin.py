"""Entry point ``fixture``: registers by import path only, so nothing heavy loads with the plugin."""

from __future__ import annotations

from minisgl.core import hookimpl
from minisgl.core.registry import Registry


@hookimpl
def minisgl_register_models(registry: Registry) -> None:
    registry.register("FixtureLlamaForCausalLM", "minisgl_fixture_plugin.model:FixtureLlamaForCausalLM")


@hookimpl
def minisgl_register_samplers(registry: Registry) -> None:
    registry.register("fixture-lowest", "minisgl_fixture_plugin.sampler:LowestOfTopTwoSampler")
