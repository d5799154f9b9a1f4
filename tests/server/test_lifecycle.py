"""The life of a ``minisgl serve`` deployment: loading, SIGTERM with a stream in flight, and a
child process that dies. Every test starts its own server (it ends it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import (
    BASE_ARGS,
    STARTUP_TIMEOUT,
    Server,
    alive,
    sse_events,
    start_server,
    wait_dead,
)

pytestmark = pytest.mark.slow

LONG_STREAM = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400,
               "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture
def fresh() -> Iterator[Server]:
    """A server of this test alone, not yet healthy; whatever the test did, it is gone after."""
    server = start_server(*BASE_ARGS, wait=False)
    try:
        yield server
    finally:
        server.stop(check=False)


def wait_exit(server: Server, timeout: float) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not exit within {timeout} s:\n{server.output()}")


def open_stream(client: httpx.Client, server: Server) -> tuple[Any, Iterator[Any]]:
    """A long completion stream, after its first two events."""
    cm = client.stream("POST", server.url + "/v1/completions", json=LONG_STREAM)
    response = cm.__enter__()
    assert response.status_code == 200
    events = sse_events(response.iter_lines())
    for _ in range(2):
        event = next(events)
        assert event["choices"][0]["finish_reason"] is None, event
    return cm, events


def test_loading_ready_then_sigterm_aborts_the_stream(fresh: Server) -> None:
    # /health answers 503 while the scheduler loads the model, then 200 for good
    seen: list[int] = []
    refused_during_load = None
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not seen or seen[-1] != 200:
        assert fresh.proc.poll() is None, f"the server exited:\n{fresh.output()}"
        assert time.monotonic() < deadline, f"never healthy; /health said {seen}"
        try:
            r = httpx.get(fresh.url + "/health", timeout=5)
        except httpx.TransportError:  # not listening yet
            assert not seen, "the server stopped listening while loading"
            time.sleep(0.02)
            continue
        seen.append(r.status_code)
        if r.status_code == 503:
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and "loading" in err["message"], err
            if refused_during_load is None:  # requests are refused as long as /health is 503
                g = httpx.post(fresh.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
                if httpx.get(fresh.url + "/health", timeout=5).status_code == 503:
                    refused_during_load = g.status_code == 503 and "error" in g.json()
        time.sleep(0.02)
    assert seen[0] == 503, seen
    assert set(seen) == {503, 200} and seen.index(200) == len(seen) - 1, seen
    assert refused_during_load in (True, None), "a request was served before /health was 200"
    for _ in range(5):  # ready for good
        assert httpx.get(fresh.url + "/health", timeout=5).status_code == 200
    stats = fresh.stats()
    pids = list(stats["pids"].values())
    assert set(stats["pids"]) >= {"scheduler", "tokenizer", "detokenizer"}
    assert all(alive(p) for p in pids)

    # SIGTERM with a stream in flight: it ends with finish_reason "abort", then [DONE]
    with httpx.Client(timeout=60) as client:
        cm, events = open_stream(client, fresh)
        try:
            fresh.proc.send_signal(signal.SIGTERM)
            rest = list(events)
        finally:
            cm.__exit__(None, None, None)
    assert rest[-1] == "[DONE]", rest[-3:]
    assert len(rest) >= 2, rest
    last = rest[-2]
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert all(e["choices"][0]["finish_reason"] is None for e in rest[:-2]), rest
    assert wait_exit(fresh, 20) == 0, fresh.output()
    assert wait_dead(pids, 10) == [], f"children outlived the launcher: {pids}"
    with pytest.raises(httpx.TransportError):
        httpx.get(fresh.url + "/health", timeout=2)


def test_killed_scheduler_fails_the_deployment(fresh: Server) -> None:
    fresh.wait_healthy()
    pids = fresh.stats()["pids"]
    with httpx.Client(timeout=60) as client:
        cm, events = open_stream(client, fresh)
        try:
            os.kill(pids["scheduler"], signal.SIGKILL)
            killed = time.monotonic()
            # /health turns 503 (before the launcher stops listening)
            health = []
            while time.monotonic() - killed < 2:
                try:
                    status = httpx.get(fresh.url + "/health", timeout=2).status_code
                except httpx.TransportError:
                    status = 0  # no longer listening
                health.append(status)
                if status != 200:
                    break
                time.sleep(0.01)
            rest = list(events)
        finally:
            cm.__exit__(None, None, None)
    assert health and health[-1] == 503, f"/health after the kill: {health}\n{fresh.output()}"
    # the stream in flight ends with an error event (OpenAI's error object), not a normal end
    errors = [i for i, e in enumerate(rest) if isinstance(e, dict) and "error" in e]
    assert errors, rest[-3:]
    err = rest[errors[0]]["error"]
    assert err["type"] == "service_unavailable" and "scheduler" in err["message"], err
    assert all(e == "[DONE]" for e in rest[errors[0] + 1:]), rest[errors[0]:]
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
                   for e in rest), "the stream ended normally"
    # the launcher gives up: non-zero exit, no child left
    rc = wait_exit(fresh, 10)
    assert rc != 0, fresh.output()
    assert time.monotonic() - killed < 12
    assert wait_dead(list(pids.values()), 10) == [], f"children outlived the launcher: {pids}"
    assert "scheduler" in fresh.output()


def test_hung_scheduler_fails_the_deployment() -> None:
    """A scheduler that stops (SIGSTOP: alive but silent) is caught by the heartbeat timeout."""
    server = start_server(*BASE_ARGS, "--engine-timeout", "3")
    pids = server.stats()["pids"]
    try:
        with httpx.Client(timeout=60) as client:
            cm, events = open_stream(client, server)
            try:
                os.kill(pids["scheduler"], signal.SIGSTOP)
                stopped = time.monotonic()
                rest = list(events)  # ends (with an error) once the timeout fires
            finally:
                cm.__exit__(None, None, None)
        waited = time.monotonic() - stopped
        assert 0.5 < waited < 15, waited  # 3 s after the last heartbeat (sent every ~1 s)
        err = next(e["error"] for e in rest if isinstance(e, dict) and "error" in e)
        assert "heartbeat" in err["message"], err
        assert wait_exit(server, 15) == 1, server.output()
        assert wait_dead(list(pids.values()), 10) == [], f"children outlived the launcher: {pids}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids["scheduler"], signal.SIGKILL)
        server.stop(check=False)
