"""A name -> target registry for one kind of plugin object (models, backends, ...)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


class PluginError(Exception):
    """A plugin could not be loaded, or two plugins disagree."""


class UnknownNameError(PluginError, LookupError):
    """A name that no plugin registered; the message lists the registered ones."""


@dataclass(frozen=True)
class Entry:
    name: str
    target: Any  # "module:attr" string or the object itself
    plugin: str  # entry point name of the registering plugin
    package: str  # distribution that ships it


def import_target(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


class Registry:
    """Registrations of one kind. ``register`` is what plugins call from their hooks."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._current: tuple[str, str] = ("<direct>", "<direct>")

    def register(self, name: str, target: Any) -> None:
        plugin, package = self._current
        old = self._entries.get(name)
        if old is not None:
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by plugin {old.plugin!r} "
                f"(package {old.package}) and by plugin {plugin!r} (package {package})"
            )
        self._entries[name] = Entry(name, target, plugin, package)

    def set_owner(self, plugin: str, package: str) -> None:
        self._current = (plugin, package)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Any:
        """The registered object, imported on first use. Unknown names list the known ones."""
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(self.names()) or "none"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {known}")
        return import_target(entry.target)
