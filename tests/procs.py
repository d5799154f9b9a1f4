"""The live processes of this machine, from /proc (for tests that check nothing is left behind),
and busy loops to run beside the engine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True: pass"  # what `minisgl bench --busy` runs too


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


@contextlib.contextmanager
def busy_loops(n: int = 1) -> Iterator[None]:
    """``n`` processes each spinning on a core while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def busy_loop_pids() -> list[int]:
    """Live processes running ``python -c BUSY_LOOP`` (one left behind is a leak)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue  # exited while we looked
        if argv[-3:-1] == [b"-c", BUSY_LOOP.encode()]:
            found.append(int(entry))
    return found
