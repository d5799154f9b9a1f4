"""``minisgl shell`` against a real server: streamed replies, history, /reset, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from minisgl.core import LLM, SamplingParams

from .conftest import BASE_ARGS, Server, wait_dead


class Shell:
    """``minisgl shell --url`` in a subprocess; stdout is collected by a reader thread."""

    def __init__(self, url: str, *args: str) -> None:
        cmd = [sys.executable, "-m", "minisgl.server.cli", "shell", "--url", url, *args]
        # SIGINT back to its default: a test run started in the background by a shell without
        # job control inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=dict(os.environ,
                                                                        PYTHONUNBUFFERED="1"),
                                     preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))
        self.out = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(4096):  # type: ignore[attr-defined]
            self.out += chunk.decode(errors="replace")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def wait_for(self, cond: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not cond(self.out):
            assert self.proc.poll() is None or cond(self.out), f"shell exited:\n{self.out}"
            assert time.monotonic() < deadline, f"timed out; shell output:\n{self.out}"
            time.sleep(0.05)
        return self.out

    def close(self) -> int:
        if self.proc.poll() is None:
            self.send("/exit")
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def offline_answers(convs: list[list[dict[str, str]]], max_tokens: int) -> list[str]:
    with LLM(model="smollm2", dtype="float32", max_model_len=512) as llm:
        outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [o.text for o in outs]


def test_conversation_history_reset_and_exit(server: Server) -> None:
    q1, q2 = "What is the capital of France?", "And of Germany?"
    sh = Shell(server.url, "--temperature", "0", "--max-tokens", "24")
    try:
        sh.wait_for(lambda o: o.count("> ") >= 1)
        sh.send(q1)
        sh.wait_for(lambda o: o.count("> ") >= 2)
        sh.send(q2)  # answered with the first exchange as history
        out = sh.wait_for(lambda o: o.count("> ") >= 3)
        sh.send("/reset")
        sh.wait_for(lambda o: "(conversation cleared)" in o and o.count("> ") >= 4)
        sh.send(q2)  # no history any more
        out = sh.wait_for(lambda o: o.count("> ") >= 5)
        assert sh.close() == 0
    finally:
        sh.close()
    replies = [part.split("\n")[0] for part in out.split("> ")[1:]]
    a1, a2_fresh = offline_answers([[{"role": "user", "content": q1}],
                                    [{"role": "user", "content": q2}]], 24)
    (a2,) = offline_answers([[{"role": "user", "content": q1},
                              {"role": "assistant", "content": a1},
                              {"role": "user", "content": q2}]], 24)
    assert replies[0] == a1.split("\n")[0]
    assert replies[1] == a2.split("\n")[0]
    assert replies[3] == a2_fresh.split("\n")[0]


def test_ctrl_c_stops_a_reply_and_frees_its_pages(server: Server) -> None:
    sh = Shell(server.url, "--temperature", "0", "--max-tokens", "400")
    try:
        sh.wait_for(lambda o: "> " in o)
        sh.send("Count from 1 to 300, separated by commas.")
        sh.wait_for(lambda o: len(o.split("> ", 1)[1]) >= 20)  # the reply is streaming
        assert server.stats()["running"] == 1
        sh.proc.send_signal(signal.SIGINT)
        sh.wait_for(lambda o: "[stopped]" in o)
        server.wait_idle()  # the server aborted the request and freed its pages
        sh.send("Tell me the capital of France.")  # the shell goes on
        out = sh.wait_for(lambda o: "Paris" in o.split("[stopped]")[1])
        assert "Traceback" not in out
        assert sh.close() == 0
    finally:
        sh.close()


def test_started_server_is_out_of_ctrl_c_reach_and_in_the_callers_session(tmp_path: Path) -> None:
    """What ``minisgl shell`` and ``minisgl bench online`` rely on when they start a server: Ctrl-C
    at the terminal (SIGINT to the foreground process group) does not reach it, and it shares
    their session (Linux schedules a session's processes as one autogroup)."""
    marker = tmp_path / "started"
    code = ("import sys, time; from minisgl.server.shell import start_server; "
            "p, url = start_server(sys.argv[2:]); "
            "open(sys.argv[1], 'w').write(f'{p.pid} {url}'); time.sleep(600)")

    def foreground_group() -> None:  # the caller stands for a terminal's foreground job
        os.setpgrp()
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    caller = subprocess.Popen([sys.executable, "-c", code, str(marker), *BASE_ARGS],
                              stdout=subprocess.DEVNULL, preexec_fn=foreground_group)
    pid, children = None, []
    try:
        deadline = time.monotonic() + 180
        while not marker.exists() or not marker.read_text():
            assert caller.poll() is None and time.monotonic() < deadline, "no server started"
            time.sleep(0.2)
        pid_text, url = marker.read_text().split()
        pid = int(pid_text)
        assert os.getsid(pid) == os.getsid(caller.pid)
        assert os.getpgid(pid) == pid != os.getpgid(caller.pid)
        children = list(httpx.get(url + "/stats", timeout=15).json()["pids"].values())
        os.killpg(caller.pid, signal.SIGINT)  # Ctrl-C
        assert caller.wait(30) != 0
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    finally:
        caller.kill()
        caller.wait(30)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            left = wait_dead([pid, *children], 30)
            for p in left:  # never leave model processes behind on a 2-core machine
                os.kill(p, signal.SIGKILL)
            assert left == [], f"{left} outlived SIGTERM"
