"""ZMQ endpoints of one deployment and what every child process does first."""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from minisgl.core.child import die_with_parent
from minisgl.server.messages import Fatal, Msg, decode, encode

POLL_MS = 200  # idle poll interval; also how often a child checks that its parent is alive


@dataclass(frozen=True)
class Endpoints:
    """One PULL socket per process, bound by its owner; the others PUSH to it."""

    tokenizer: str
    scheduler: str
    detokenizer: str
    api: str

    @classmethod
    def in_dir(cls, path: str) -> Endpoints:
        return cls(*(f"ipc://{os.path.join(path, n)}" for n in
                     ("tokenizer", "scheduler", "detokenizer", "api")))


class Sockets:
    """A PULL socket bound at ``own`` and PUSH sockets connected to ``peers``."""

    def __init__(self, own: str, **peers: str) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(own)
        self._timeout = -1  # the pull socket's RCVTIMEO (ms); -1: block
        self.push: dict[str, zmq.Socket[bytes]] = {}
        for name, addr in peers.items():
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            self.push[name] = sock

    def send(self, peer: str, msg: Msg) -> None:
        self.push[peer].send(encode(msg))

    def recv(self, timeout_ms: int) -> Any | None:
        """The next message, or None after ``timeout_ms`` without one. Called once per message
        (and by the scheduler once per step): no Poller, a receive timeout instead."""
        if timeout_ms == 0:
            if not self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return None
        elif timeout_ms != self._timeout:
            self.pull.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout = timeout_ms
        try:
            return decode(self.pull.recv())
        except zmq.Again:
            return None


def child_main(name: str, report_to: str | None, body: Callable[[], None],
               plugins: bool = True) -> None:
    """Run a child process's ``body``: Ctrl-C is the launcher's to handle, SIGTERM exits cleanly
    (``finally`` blocks run), ``plugins`` are loaded here (every engine process loads them
    itself; the tokenizer processes need none), and a crash is reported to the API
    (``report_to``) before exiting."""
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    os.environ["MINISGL_PARENT_PID"] = str(parent)
    try:
        if plugins:
            from minisgl.core.plugins import get_plugin_manager

            get_plugin_manager()
        body()
    except Exception:
        text = traceback.format_exc()
        print(f"minisgl {name} process failed:\n{text}", file=sys.stderr, flush=True)
        if report_to is None:
            sys.exit(1)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(report_to)
        sock.send(encode(Fatal(process=name, message=text.strip().splitlines()[-1])))
        sock.close()
        ctx.term()
        sys.exit(1)


@functools.cache
def _parent_pid() -> int:
    """MINISGL_PARENT_PID, read once (parent_alive runs once per message)."""
    return int(os.environ.get("MINISGL_PARENT_PID", os.getppid()))


def parent_alive() -> bool:
    return os.getppid() == _parent_pid()
