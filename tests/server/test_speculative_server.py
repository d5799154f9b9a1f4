"""A real ``minisgl serve --speculative-tokens 4`` (float32) through the openai client, against
the offline engine without drafts in this process: the same greedy texts and seeded samples,
streamed in pieces of several tokens, drafts really kept, and every page back after."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import openai
import pytest

from minisgl.core import LLM, SamplingParams

from .conftest import BASE_ARGS, Server, running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
# Texts the model answers by quoting them: prompt-lookup drafts are right there.
SOURCE = ("The scheduler keeps a radix tree of every cached prefix. A request that shares a "
          "prefix with an earlier one reuses its pages, and only the new tokens are computed.")
CHATS = [
    [{"role": "user", "content": "Repeat this text exactly:\n\n" + SOURCE}],
    [{"role": "user", "content": "Summarize this text:\n\n" + SOURCE}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(model=MODEL, dtype="float32")  # no drafts: the reference
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(*BASE_ARGS, "--speculative-tokens", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def stream_chat(client: openai.OpenAI, messages: list[dict[str, str]], **kw: object
                ) -> tuple[str, str | None, int]:
    """Text, finish reason and number of content chunks of a streamed chat completion."""
    text, finish, pieces = "", None, 0
    for ch in client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                             stream=True, **kw):
        for c in ch.choices:
            if c.delta.content:
                text += c.delta.content
                pieces += 1
            finish = c.finish_reason or finish
    return text, finish, pieces


def test_greedy_answers_are_the_offline_engines(client: openai.OpenAI, llm: LLM,
                                                server: Server) -> None:
    before = server.stats()
    want = llm.chat(CHATS, SamplingParams(max_tokens=48, temperature=0))
    for messages, w in zip(CHATS, want):
        text, finish, _ = stream_chat(client, messages, max_tokens=48, temperature=0)
        assert (text, finish) == (w.text, w.finish_reason)
    idle = server.wait_idle()
    assert idle["accepted_tokens"] - before["accepted_tokens"] >= 10, "no draft was kept"
    assert idle["integrity"] == "ok"


def test_seeded_samples_and_stop_strings_are_the_offline_engines(client: openai.OpenAI,
                                                                 llm: LLM, server: Server) -> None:
    p = SamplingParams(max_tokens=40, temperature=0.7, seed=11)
    want = llm.chat([CHATS[0]], p)[0]
    text, finish, _ = stream_chat(client, CHATS[0], max_tokens=40, temperature=0.7, seed=11)
    assert (text, finish) == (want.text, want.finish_reason)
    # a stop string inside the answer: the text ends before it, even when the step that
    # produced it kept several tokens past it
    full = llm.chat([CHATS[0]], SamplingParams(max_tokens=48, temperature=0))[0].text
    stop = full[20:26]
    text, finish, _ = stream_chat(client, CHATS[0], max_tokens=48, temperature=0, stop=[stop])
    assert (text, finish) == (full[: full.index(stop)], "stop")
    assert server.wait_idle()["integrity"] == "ok"


def test_concurrent_streams_match_their_sequential_answers(client: openai.OpenAI,
                                                           server: Server) -> None:
    jobs = [(CHATS[i % 3], 16 + 4 * i) for i in range(8)]
    alone = [stream_chat(client, m, max_tokens=n, temperature=0)[0] for m, n in jobs]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda j: stream_chat(client, j[0], max_tokens=j[1],
                                                       temperature=0)[0], jobs))
    assert together == alone
    idle = server.wait_idle()
    assert idle["held_pages"] == 0 and idle["integrity"] == "ok"
