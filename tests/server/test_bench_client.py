"""The online benchmark's HTTP client (minisgl.server.bench_serve): against a real server, and
against a scripted one that splits its stream at awkward places."""

from __future__ import annotations

import asyncio
import json

import pytest

from minisgl.server.bench import Workload
from minisgl.server.bench_serve import _run_clients, summarize

from .conftest import Server


def test_counts_every_streamed_token_of_a_real_server(server: Server) -> None:
    lens = [1, 3, 6, 9, 4]
    prompts = [[1000 + 7 * i + j for j in range(5 + 3 * i)] for i in range(len(lens))]
    traces, wall = asyncio.run(_run_clients(server.url, Workload("t", prompts, lens), 2))
    assert [len(t.token_times) for t in traces] == lens  # ignore_eos: exactly max_tokens each
    for t in traces:
        assert 0 < t.ttft <= t.e2e <= wall
        assert len(t.gaps) <= len(t.token_times) - 1
        assert t.token_times == sorted(t.token_times)
    m = summarize(traces, wall)
    assert m["output_tokens"] == sum(lens) and m["requests"] == len(lens)
    server.wait_idle()  # every page back


def test_sampled_requests_of_a_real_server(server: Server) -> None:
    """--sampling's parameters travel in the requests: the server takes them (a bad one would be
    a 400) and streams every token."""
    prompts = [[1000 + 11 * i + j for j in range(6)] for i in range(3)]
    wl = Workload("t", prompts, [5, 5, 5])
    traces, _ = asyncio.run(_run_clients(server.url, wl, 3, {"temperature": 0.8, "top_p": 0.9,
                                                             "top_k": 20, "min_p": 0.01}))
    assert [len(t.token_times) for t in traces] == [5, 5, 5]
    with pytest.raises(RuntimeError, match="400.*top_p"):
        asyncio.run(_run_clients(server.url, Workload("t", prompts[:1], [2]), 1, {"top_p": 1.5}))
    server.wait_idle()


def test_a_rejected_request_raises_with_the_servers_message(server: Server) -> None:
    too_long = Workload("t", [[1000] * 600], [4])  # the server's context is 512 tokens
    with pytest.raises(RuntimeError, match="400.*input_ids"):
        asyncio.run(_run_clients(server.url, too_long, 1))


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="--url"):
        asyncio.run(_run_clients("https://127.0.0.1:1", Workload("t", [[1]], [1]), 1))


def _chunked(pieces: list[bytes]) -> bytes:
    out = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return out + b"0\r\n\r\n"


def test_events_split_across_and_packed_into_chunks() -> None:
    """Events cut mid-line, two events in one chunk, a chunk extension, a comment line and an
    event without tokens: every token still counted once. The URL's path prefix is kept."""
    events = [b"data: " + json.dumps({"output_ids": ids}).encode() + b"\n\n"
              for ids in ([5], [], [6, 7], [8])]
    stream = b": keep-alive\n\n" + b"".join(events) + b"data: [DONE]\n\n"
    cuts = [3, 20, 21, 60, len(stream)]
    pieces = [stream[a:b] for a, b in zip([0, *cuts], cuts) if b > a]

    async def main() -> list[int]:
        seen: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head.split(b"\r\n")[0])
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for p in pieces:
                writer.write(_chunked([p])[:-5])  # one chunk, not yet the last
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            traces, _ = await _run_clients(f"http://127.0.0.1:{port}/v0/",
                                           Workload("t", [[1, 2, 3]], [4]), 1)
        assert seen[0] == b"POST /v0/generate HTTP/1.1"  # the URL's path prefix is kept
        body = json.loads(seen[1])
        assert body["input_ids"] == [1, 2, 3] and body["stream"] is True
        assert body["sampling_params"] == {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
        return [len(t.token_times) for t in traces] + [len(traces[0].gaps)]

    assert asyncio.run(main()) == [4, 2]  # 4 tokens in 3 token-bearing events
