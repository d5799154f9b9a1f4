"""Real ``minisgl serve`` processes for the HTTP tests.

``start_server`` launches ``python -m minisgl.server.cli serve ...`` on a free port with the
environment of tests/conftest.py (MINISGL_STRICT_PLUGINS=1, HF_HUB_OFFLINE=1), captures its
stdout/stderr in files and waits for ``GET /health`` to answer 200. ``Server.stop`` sends SIGTERM,
kills after a timeout (and says so), and checks that the launcher's children are gone too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

STARTUP_TIMEOUT = 120.0  # seconds until /health must answer 200
STOP_TIMEOUT = 30.0  # seconds after SIGTERM before the launcher is killed (and the test fails)
BASE_ARGS = ("--dtype", "float32", "--max-model-len", "512")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False  # vanished between the two checks
    return state not in ("Z", "X")


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds (empty when all of them are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """Decoded ``data:`` payloads of a server-sent event stream ("[DONE]" stays a string)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_dir: str
    args: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)  # sent with /stats (the API key)
    child_pids: list[int] = field(default_factory=list)  # from /stats once healthy

    def output(self) -> str:
        parts = []
        for name in ("stdout", "stderr"):
            with open(os.path.join(self.log_dir, name), errors="replace") as f:
                parts.append(f"--- {name} ---\n{f.read()[-20000:]}")
        return "\n".join(parts)

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"minisgl serve {' '.join(self.args)} exited with code "
                            f"{self.proc.returncode} while starting:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.child_pids = list(self.stats()["pids"].values())
                    return
            time.sleep(0.1)
        self.stop(check=False)
        pytest.fail(f"minisgl serve did not become healthy within {timeout} s:\n{self.output()}")

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/stats", headers=self.headers, timeout=15)
        assert r.status_code == 200, r.text
        stats: dict[str, Any] = r.json()
        return stats

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Poll /stats until no request runs or waits and every KV page is free or cached."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["running"] == 0 and s["waiting"] == 0 and s["held_pages"] == 0
                    and s["free_pages"] + s["cached_pages"] == s["num_pages"]
                    and s["integrity"] == "ok"):
                return s
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not go idle within {timeout} s: {s}")
            time.sleep(0.1)

    def stop(self, check: bool = True, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM the launcher (if still running), kill it after ``timeout``; with ``check``,
        fail unless it exited by itself with status 0 and left no child process behind."""
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                self.proc.kill()
                self.proc.wait(10)
        rc = self.proc.returncode
        left = wait_dead(self.child_pids)
        for pid in left:  # never leave model processes behind on a 2-core machine
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if check:
            assert not killed, f"the launcher ignored SIGTERM for {timeout} s:\n{self.output()}"
            assert rc == 0, f"the launcher exited with {rc} after SIGTERM:\n{self.output()}"
            assert not left, f"children {left} outlived the launcher:\n{self.output()}"
        return rc


def start_server(*args: str, wait: bool = True, headers: dict[str, str] | None = None) -> Server:
    """Launch ``minisgl serve`` with ``args`` on a free port; ``wait``: until /health is 200."""
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="minisgl-test-server-")
    cmd = [sys.executable, "-m", "minisgl.server.cli", "serve", "--port", str(port), *args]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(os.path.join(log_dir, "stdout"), "wb") as out, \
            open(os.path.join(log_dir, "stderr"), "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL)
    server = Server(f"http://127.0.0.1:{port}", proc, log_dir, tuple(args), dict(headers or {}))
    if wait:
        server.wait_healthy()
    return server


@contextlib.contextmanager
def running_server(*args: str, headers: dict[str, str] | None = None) -> Iterator[Server]:
    server = start_server(*args, headers=headers)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One float32 server with a 512-token context per test module."""
    with running_server(*BASE_ARGS) as s:
        yield s
