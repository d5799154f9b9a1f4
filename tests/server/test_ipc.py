"""The processes' ZMQ plumbing on real ipc:// sockets: the children's Sockets.recv and the API's
Pipeline reader (every message of a burst delivered, a bad one dropped without the rest)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from minisgl.server.api import Pipeline
from minisgl.server.ipc import Endpoints, Sockets
from minisgl.server.messages import Abort, Heartbeat, TextBatch, TextOut, encode


def test_sockets_recv_waits_at_most_the_timeout(tmp_path: Path) -> None:
    ep = Endpoints.in_dir(str(tmp_path))
    own = Sockets(ep.scheduler)
    peer = Sockets(ep.tokenizer, scheduler=ep.scheduler)
    try:
        t = time.monotonic()
        assert own.recv(0) is None
        assert own.recv(150) is None
        waited = time.monotonic() - t
        assert 0.12 < waited < 2.0
        for i in range(3):
            peer.send("scheduler", Abort(rid=f"r{i}"))
        got = [own.recv(1000), own.recv(0), own.recv(150)]  # timeouts switch back and forth
        assert [m.rid for m in got] == ["r0", "r1", "r2"]
        assert own.recv(0) is None
        t = time.monotonic()
        assert own.recv(0) is None and time.monotonic() - t < 0.1
    finally:
        for s in (own, peer):
            s.pull.close(linger=0)
            for sock in s.push.values():
                sock.close(linger=0)
            s.ctx.term()


def test_pipeline_delivers_a_burst_and_survives_a_bad_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ep = Endpoints.in_dir(str(tmp_path))

    async def main() -> list[str]:
        pipe = Pipeline(ep, "m", {})
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(ep.api)
        queue: asyncio.Queue[TextOut] = asyncio.Queue()
        pipe.queues["a"] = queue
        texts = [f"t{i}" for i in range(200)]
        # the whole burst is queued before the reader exists: one FD edge for all of it
        for i, text in enumerate(texts):
            push.send(encode(TextBatch(items=[TextOut(rid="a", text=text, token_ids=[i])])))
            if i == 100:
                push.send(msgspec.msgpack.encode({"type": "Abort", "v": 999, "rid": "a"}))
        time.sleep(0.2)
        task = asyncio.ensure_future(pipe.receive_forever())
        got = [(await asyncio.wait_for(queue.get(), 10)).text for _ in texts]
        push.send(encode(Heartbeat()))  # and later messages still arrive
        for _ in range(100):
            if pipe.last_heartbeat:
                break
            await asyncio.sleep(0.02)
        assert pipe.last_heartbeat > 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pipe.close()
        push.close(linger=0)
        ctx.term()
        return got

    got = asyncio.run(main())
    assert got == [f"t{i}" for i in range(200)]
    assert "dropped a message" in capsys.readouterr().out
