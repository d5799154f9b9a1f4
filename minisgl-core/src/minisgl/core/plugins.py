"""The per-process plugin manager: loads the ``minisgl`` entry points once.

Every process (offline engine, API server, tokenizer, each rank) calls :func:`get_plugin_manager`
itself, so registrations never have to cross a process boundary.

Environment:
  MINISGL_STRICT_PLUGINS=1   a plugin that fails to import raises instead of being skipped.
  MINISGL_PLUGINS_ALLOW=a,b  load only these entry points (by entry point name).
  MINISGL_PLUGINS_DENY=a,b   never load these entry points.
"""

from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Any

import pluggy

from minisgl.core import hookspecs
from minisgl.core.registry import PluginError, Registry

ENTRY_POINT_GROUP = "minisgl"
KINDS = {
    "models": ("model", "minisgl_register_models"),
    "attention_backends": ("attention backend", "minisgl_register_attention_backends"),
    "schedulers": ("schedule policy", "minisgl_register_schedulers"),
    "samplers": ("sampler", "minisgl_register_samplers"),
}


@dataclass
class PluginInfo:
    name: str  # entry point name
    package: str
    version: str
    value: str  # "module" or "module:attr" of the entry point
    registers: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class FailedPlugin:
    name: str
    package: str
    value: str
    error: str


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var, "").strip()
    return {x.strip() for x in raw.split(",") if x.strip()} if raw else None


def strict_plugins() -> bool:
    return os.environ.get("MINISGL_STRICT_PLUGINS", "") not in ("", "0", "false", "False")


class PluginManager:
    """A small typed wrapper around pluggy: the rest of minisgl never calls ``pm.hook``."""

    def __init__(self, entry_points: list[metadata.EntryPoint] | None = None, *,
                 strict: bool | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.strict = strict_plugins() if strict is None else strict
        self.plugins: dict[str, PluginInfo] = {}
        self.failed: list[FailedPlugin] = []
        if entry_points is None:
            entry_points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        self._load(entry_points)
        self.registries = {kind: self._collect(kind) for kind in KINDS}

    # -- loading -----------------------------------------------------------------------------
    def _load(self, eps: list[metadata.EntryPoint]) -> None:
        allow, deny = _env_list("MINISGL_PLUGINS_ALLOW"), _env_list("MINISGL_PLUGINS_DENY")
        seen: set[tuple[str, str]] = set()
        for ep in sorted(eps, key=lambda e: e.name):
            dist = ep.dist
            package = dist.metadata["Name"] if dist is not None else "<unknown>"
            version = dist.version if dist is not None else "?"
            if (ep.name, ep.value) in seen:  # the same dist visible twice on sys.path
                continue
            seen.add((ep.name, ep.value))
            if (allow is not None and ep.name not in allow) or (deny and ep.name in deny):
                continue
            if ep.name in self.plugins:
                old = self.plugins[ep.name]
                raise PluginError(
                    f"two plugins use the entry point name {ep.name!r}: package {old.package} "
                    f"({old.value}) and package {package} ({ep.value})"
                )
            try:
                obj = ep.load()
                self.pm.register(obj, name=ep.name)
            except Exception as e:  # noqa: BLE001 - any import failure is the plugin's fault
                err = f"{type(e).__name__}: {e}"
                if self.strict:
                    raise PluginError(
                        f"plugin {ep.name!r} from package {package} ({ep.value}) failed to load: "
                        f"{err}"
                    ) from e
                self.failed.append(FailedPlugin(ep.name, package, ep.value, err))
                warnings.warn(
                    f"minisgl: skipping plugin {ep.name!r} from package {package} ({ep.value}): "
                    f"{err}\n{traceback.format_exc(limit=3)}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            self.plugins[ep.name] = PluginInfo(ep.name, package, version, ep.value)
        self.pm.check_pending()  # misspelled hook names in a plugin fail loudly

    def _collect(self, kind: str) -> Registry:
        label, hook_name = KINDS[kind]
        registry = Registry(label)
        caller = getattr(self.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):  # pluggy keeps them LIFO
            info = self.plugins.get(impl.plugin_name)
            package = info.package if info else impl.plugin_name
            registry.set_owner(impl.plugin_name, package)
            before = set(registry.names())
            impl.function(registry=registry)
            if info is not None:
                added = sorted(set(registry.names()) - before)
                if added:
                    info.registers.setdefault(kind, []).extend(added)
        registry.set_owner("<direct>", "<direct>")
        return registry

    # -- lookups -----------------------------------------------------------------------------
    @property
    def models(self) -> Registry:
        return self.registries["models"]

    @property
    def attention_backends(self) -> Registry:
        return self.registries["attention_backends"]

    @property
    def schedulers(self) -> Registry:
        return self.registries["schedulers"]

    @property
    def samplers(self) -> Registry:
        return self.registries["samplers"]

    def describe(self) -> str:
        """Human-readable listing for ``minisgl plugins``."""
        lines = []
        for info in sorted(self.plugins.values(), key=lambda i: (i.package, i.name)):
            lines.append(f"{info.name}  ({info.package} {info.version}, {info.value})")
            for kind, names in sorted(info.registers.items()):
                lines.append(f"    {kind}: {', '.join(names)}")
            if not info.registers:
                lines.append("    (registers nothing)")
        for f in self.failed:
            lines.append(f"{f.name}  ({f.package}, {f.value})  FAILED: {f.error}")
        return "\n".join(lines) if lines else "no minisgl plugins installed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "plugins": [vars(i) for i in self.plugins.values()],
            "failed": [vars(f) for f in self.failed],
        }


@lru_cache(maxsize=1)
def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created (and entry points loaded) on first call."""
    return PluginManager()
