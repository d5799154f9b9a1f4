"""The live processes of this machine, from /proc (for tests that check nothing is left behind)."""

from __future__ import annotations

import os


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies waiting to be reaped count as dead)."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if fields[0] not in ("Z", "X"):
            out[int(entry)] = int(fields[1])
    return out


def children(pid: int) -> set[int]:
    return {c for c, p in parents().items() if p == pid}


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid``, children first."""
    parent_of = parents()
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        out += kids
        frontier = kids
    return out
