"""``minisgl shell``: an interactive chat that streams the reply as it is generated.

It talks to a server over HTTP: the one at --url, or one it starts in the background with the
given engine flags (stopped when the shell exits). Commands: /reset (forget the conversation),
/exit. Ctrl-C stops a reply (the server aborts the request and frees its pages); Ctrl-D exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

from minisgl.core.child import free_addr

HELP = "Type a message. /reset forgets the conversation, /exit (or Ctrl-D) quits, " \
       "Ctrl-C stops a reply."


def start_server(serve_argv: list[str], timeout: float = 600.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``minisgl serve`` in a process group of its own, so that Ctrl-C at the terminal
    (sent to the foreground group) does not reach it.

    It stays in the caller's session: Linux's autogroup scheduling shares the CPU between
    sessions first, so a server in a session of its own would leave its caller (the shell, the
    online benchmark's clients) half the machine whenever that runs. Measured with the benchmark's
    32 clients on 2 cores, alternating pairs: server throughput x1.054 (median of 6, all above 1)
    and x1.012 (median of 8, 6 above 1) in the same session."""
    port = int(free_addr().rpartition(":")[2])
    cmd = [sys.executable, "-m", "minisgl.server.cli", "serve", *serve_argv, "--port", str(port)]
    group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                             else {"preexec_fn": os.setpgrp})
    proc = subprocess.Popen(cmd, **group)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.terminate()
    raise RuntimeError(f"the server did not become ready within {timeout:.0f} s")


def stream_reply(client: httpx.Client, url: str, messages: list[dict[str, str]],
                 params: dict[str, Any]) -> Iterator[str]:
    """Yield the reply's text pieces as the server streams them."""
    body = {"messages": messages, "stream": True, **params}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(r.json().get("error", {}).get("message", r.text))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    yield piece


def repl(url: str, params: dict[str, Any], api_key: str | None = None,
         stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    history: list[dict[str, str]] = []
    print(HELP, file=out, flush=True)
    with httpx.Client(headers=headers) as client:
        while True:
            print("> ", end="", file=out, flush=True)
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                print("\n(use /exit or Ctrl-D to quit)", file=out, flush=True)
                continue
            if not line:  # Ctrl-D
                print(file=out)
                return
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return
            if text == "/reset":
                history.clear()
                print("(conversation cleared)", file=out, flush=True)
                continue
            if text.startswith("/"):
                print(f"unknown command {text}. {HELP}", file=out, flush=True)
                continue
            history.append({"role": "user", "content": text})
            pieces: list[str] = []
            try:
                for piece in stream_reply(client, url, history, params):
                    pieces.append(piece)
                    print(piece, end="", file=out, flush=True)
                print(file=out, flush=True)
            except KeyboardInterrupt:  # closing the stream makes the server abort the request
                print(" [stopped]", file=out, flush=True)
            except (RuntimeError, httpx.HTTPError) as e:
                print(f"\n[error: {e}]", file=out, flush=True)
                history.pop()
                continue
            history.append({"role": "assistant", "content": "".join(pieces)})


def run(url: str | None, serve_argv: list[str], params: dict[str, Any],
        api_key: str | None = None) -> int:
    proc = None
    if url is None:
        print("starting a server in the background ...", flush=True)
        proc, url = start_server(serve_argv)
    try:
        repl(url.rstrip("/"), params, api_key)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0
