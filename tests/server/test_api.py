"""The HTTP API of a real ``minisgl serve`` (float32, 512-token context) through the official
openai client, and httpx where the client cannot say it.

Expectations come from the offline engine in this process (``LLM(dtype="float32")``): greedy
texts, finish reasons, token counts, log-probs and seeded samples must be the server's, exactly
(log-probs within 1e-3).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from minisgl.core import LLM, RequestOutput, SamplingParams

from .conftest import BASE_ARGS, Server, running_server, sse_events

pytestmark = pytest.mark.slow

MODEL = "smollm2"
CONTEXT = 512
TOL = 1e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],  # ends on <|im_end|>
    [{"role": "user", "content": "Write a haiku about the sea."}],  # runs into max_tokens
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "What is 2+2? Answer:",  # the model ends this one at once (<|im_end|>, empty text)
]
STORY = "Once upon a time"


# -- fixtures and helpers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(model=MODEL, dtype="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied by the offline tokenizer (what prompt_tokens must count)."""
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


_offline: dict[str, RequestOutput] = {}  # the offline engine is deterministic: ask once


def offline_chat(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> RequestOutput:
    key = repr(("chat", messages, params))
    if key not in _offline:
        _offline[key] = llm.chat([messages], params)[0]
    return _offline[key]


def offline_text(llm: LLM, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
    key = repr(("text", prompt, params))
    if key not in _offline:
        _offline[key] = llm.generate([prompt], params)[0]
    return _offline[key]


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None, etype: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    expected_type = etype or {404: "not_found_error", 401: "authentication_error"}.get(
        status, "invalid_request_error")
    assert err["type"] == expected_type, err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def collect_stream(stream: Any) -> tuple[dict[int, str], dict[int, str | None], list[Any]]:
    """Text and finish_reason per choice index of a chat or completion stream, and its chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    chunks = list(stream)
    for ch in chunks:
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                assert finish.get(c.index) is None, f"choice {c.index} finished twice"
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return texts, finish, chunks


# -- chat and completions, greedy, against the offline engine -------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_greedy_matches_offline(client: openai.OpenAI, llm: LLM, stream: bool) -> None:
    for messages in CHATS:
        want = offline_chat(llm, messages, greedy(24))
        prompt_tokens = len(chat_ids(llm, messages))
        assert prompt_tokens == len(want.prompt_token_ids)
        if not stream:
            r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=24)
            assert r.object == "chat.completion" and r.model == MODEL
            assert [c.index for c in r.choices] == [0]
            assert r.choices[0].message.role == "assistant"
            assert r.choices[0].message.content == want.text
            assert r.choices[0].finish_reason == want.finish_reason
            usage = r.usage
        else:
            s = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                               max_tokens=24, stream=True,
                                               stream_options={"include_usage": True})
            texts, finish, chunks = collect_stream(s)
            assert chunks[0].choices[0].delta.role == "assistant"
            assert all(ch.object == "chat.completion.chunk" for ch in chunks)
            assert len({ch.id for ch in chunks}) == 1
            assert texts == {0: want.text} and finish == {0: want.finish_reason}
            *body, last = chunks
            assert all(ch.usage is None for ch in body)
            assert last.choices == [] and last.usage is not None
            usage = last.usage
        assert usage is not None
        assert usage.prompt_tokens == prompt_tokens
        assert usage.completion_tokens == len(want.token_ids)
        assert usage.total_tokens == prompt_tokens + len(want.token_ids)
    assert {offline_chat(llm, m, greedy(24)).finish_reason for m in CHATS} == {"stop", "length"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_greedy_matches_offline(client: openai.OpenAI, llm: LLM, stream: bool) -> None:
    reasons = set()
    for text in TEXTS:
        want = offline_text(llm, text, greedy(24))
        reasons.add(want.finish_reason)
        prompt_tokens = len(llm.tokenizer.encode(text))
        if not stream:
            r = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=24)
            assert r.object == "text_completion"
            assert [c.index for c in r.choices] == [0]
            assert r.choices[0].text == want.text
            assert r.choices[0].finish_reason == want.finish_reason
            usage = r.usage
        else:
            s = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=24,
                                          stream=True, stream_options={"include_usage": True})
            texts, finish, chunks = collect_stream(s)
            assert texts == {0: want.text} and finish == {0: want.finish_reason}
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert all(ch.usage is None for ch in chunks[:-1])
            usage = chunks[-1].usage
        assert usage is not None
        assert usage.prompt_tokens == prompt_tokens
        assert usage.completion_tokens == len(want.token_ids)
        assert usage.total_tokens == prompt_tokens + len(want.token_ids)
    assert reasons == {"stop", "length"}


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    s = client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=0,
                                       max_tokens=4, stream=True)
    chunks = list(s)
    assert chunks and all(ch.usage is None for ch in chunks)
    assert all(len(ch.choices) == 1 for ch in chunks)


def test_chat_without_max_tokens_and_developer_role(client: openai.OpenAI, llm: LLM) -> None:
    """No max_tokens: the rest of the context; a developer message is a system message; content
    parts are joined."""
    messages = [{"role": "developer", "content": "You answer in one short sentence."},
                {"role": "user", "content": [{"type": "text", "text": "Why is the sky "},
                                             {"type": "text", "text": "blue?"}]}]
    want = offline_chat(llm, CHATS[2], greedy(CONTEXT - len(chat_ids(llm, CHATS[2]))))
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage is not None and r.usage.prompt_tokens == len(want.prompt_token_ids)


# -- n, prompt lists, token ids --------------------------------------------------------------------
def test_chat_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHATS[1], n=3, temperature=1.0,
                                       seed=5, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 3 * 6
    assert len({c.message.content for c in r.choices}) > 1  # seed + i: the samples differ

    s = client.chat.completions.create(model=MODEL, messages=CHATS[1], n=2, temperature=1.0,
                                       seed=5, max_tokens=6, stream=True,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    texts, finish, chunks = collect_stream(s)
    assert finish == {0: "length", 1: "length"}
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * 6


def test_completion_prompt_list_with_n(client: openai.OpenAI, llm: LLM) -> None:
    prompts = TEXTS[:2]
    wants = [offline_text(llm, p, greedy(5, ignore_eos=True)) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # index = prompt * n + i
        assert c.text == wants[c.index // 2].text
        assert c.finish_reason == "length"
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 20

    s = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    texts, finish, chunks = collect_stream(s)
    assert texts == {i: wants[i // 2].text for i in range(4)}
    assert finish == dict.fromkeys(range(4), "length")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 20


def test_token_id_prompts(client: openai.OpenAI, llm: LLM) -> None:
    ids = [llm.tokenizer.encode(t) for t in TEXTS[:2]]
    wants = [offline_text(llm, i, greedy(12)) for i in ids]
    r = client.completions.create(model=MODEL, prompt=ids[0], temperature=0, max_tokens=12)
    assert r.choices[0].text == wants[0].text
    assert r.usage is not None and r.usage.prompt_tokens == len(ids[0])
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12)
    assert [c.text for c in r.choices] == [w.text for w in wants]
    assert [c.finish_reason for c in r.choices] == [w.finish_reason for w in wants]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(map(len, ids))
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in wants)


# -- seeds ----------------------------------------------------------------------------------------
def test_seed_reproducible(client: openai.OpenAI, llm: LLM) -> None:
    def completion(seed: int, n: int = 1) -> list[str]:
        r = client.completions.create(model=MODEL, prompt=STORY, temperature=1.0, seed=seed,
                                      max_tokens=16, n=n)
        return [c.text for c in r.choices]

    first = completion(1234)
    assert completion(1234) == first
    # the same seed samples the same tokens offline; choice i of n uses seed + i
    want = [offline_text(llm, STORY, SamplingParams(max_tokens=16, temperature=1.0, seed=seed)).text
            for seed in (1234, 1235)]
    assert first == want[:1]
    assert completion(1234, n=2) == want
    assert want[0] != want[1]  # temperature 1 really samples

    def chat(seed: int) -> str | None:
        r = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=1.0,
                                           seed=seed, max_tokens=12)
        return r.choices[0].message.content

    got = chat(7)
    assert chat(7) == got
    assert got == offline_chat(llm, CHATS[1], SamplingParams(max_tokens=12, temperature=1.0,
                                                             seed=7)).text


# -- stop strings -----------------------------------------------------------------------------------
def spanning_stop(llm: LLM, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next, occurring first at
    that boundary; and the number of tokens generated until it is complete."""
    tok = llm.tokenizer
    full = tok.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids) - 2):
        b = len(tok.decode(ids[:k], skip_special_tokens=True))
        if not full[b - 2:b].strip() or not full[b:b + 2].strip():
            continue
        stop = full[b - 2:b + 2]
        if len(stop) == 4 and full.find(stop) == b - 2:
            n = next(j for j in range(1, len(ids) + 1)
                     if stop in tok.decode(ids[:j], skip_special_tokens=True))
            return stop, n
    raise AssertionError(f"no token boundary to put a stop string on in {full!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_strings(client: openai.OpenAI, llm: LLM, stream: bool) -> None:
    prompt = TEXTS[1]
    free = offline_text(llm, prompt, greedy(24, ignore_eos=True))
    full = free.text
    stop, used = spanning_stop(llm, free.token_ids)
    after = full.find(stop) + len(stop)
    later = next(full[i:i + 3] for i in range(after, len(full) - 3)  # a second, later stop
                 if full[i:i + 3].strip() and full.find(full[i:i + 3]) >= after)

    def run(stops: list[str]) -> tuple[str, str | None, int | None]:
        if not stream:
            r = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                          max_tokens=24, stop=stops,
                                          extra_body={"ignore_eos": True})
            assert r.usage is not None
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        s = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                      stop=stops, stream=True,
                                      stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True})
        texts, finish, chunks = collect_stream(s)
        return texts[0], finish[0], chunks[-1].usage.completion_tokens

    assert run([stop]) == (full[:full.find(stop)], "stop", used)
    text, reason, _ = run([later, stop])  # the earliest occurrence wins, in either order
    assert (text, reason) == (full[:full.find(stop)], "stop")
    text, reason, n = run(["\u2603never"])  # a stop string that never occurs
    assert (text, reason, n) == (full, "length", 24)


def test_chat_stop_string_streaming(client: openai.OpenAI, llm: LLM) -> None:
    free = offline_chat(llm, CHATS[1], greedy(24))
    stop, _ = spanning_stop(llm, free.token_ids)
    s = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=0,
                                       max_tokens=24, stop=stop, stream=True)
    texts, finish, _ = collect_stream(s)
    assert texts == {0: free.text[:free.text.find(stop)]} and finish == {0: "stop"}
    r = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=0,
                                       max_tokens=24, stop=stop)
    assert r.choices[0].message.content == texts[0] and r.choices[0].finish_reason == "stop"


def test_stop_token_ids_stop(client: openai.OpenAI, llm: LLM) -> None:
    free = offline_text(llm, TEXTS[1], greedy(12, ignore_eos=True))
    stop_id = free.token_ids[5]
    want = offline_text(llm, TEXTS[1], greedy(12, ignore_eos=True, stop_token_ids=[stop_id]))
    assert want.finish_reason == "stop" and want.token_ids == free.token_ids[:6]
    r = client.completions.create(model=MODEL, prompt=TEXTS[1], temperature=0, max_tokens=12,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == len(want.token_ids)
    assert want.text.startswith(r.choices[0].text)


def test_stop_token_ids_text_matches_offline(client: openai.OpenAI, llm: LLM) -> None:
    free = offline_text(llm, TEXTS[1], greedy(12, ignore_eos=True))
    stop_id = free.token_ids[5]
    want = offline_text(llm, TEXTS[1], greedy(12, ignore_eos=True, stop_token_ids=[stop_id]))
    r = client.completions.create(model=MODEL, prompt=TEXTS[1], temperature=0, max_tokens=12,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].text == want.text


# -- logprobs -----------------------------------------------------------------------------------------
def check_chat_logprobs(llm: LLM, content: list[Any], want: RequestOutput, top: int) -> None:
    tok = llm.tokenizer
    assert len(content) == len(want.token_ids)
    for i, e in enumerate(content):
        assert e.token == tok.decode([want.token_ids[i]])
        assert abs(e.logprob - want.logprobs[i]) < TOL
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the most likely
        assert abs(e.top_logprobs[0].logprob - e.logprob) < TOL
        for got, (tid, lp) in zip(e.top_logprobs, want.top_logprobs[i]):
            assert got.token == tok.decode([tid]) and abs(got.logprob - lp) < TOL


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_logprobs_match_offline(client: openai.OpenAI, llm: LLM, stream: bool) -> None:
    messages = CHATS[1]  # ends by length: every token is part of the content
    want = offline_chat(llm, messages, greedy(16, top_logprobs=3))
    assert want.finish_reason == "length"
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=16, logprobs=True, top_logprobs=3)
        choice = r.choices[0]
        content, text = choice.logprobs.content, choice.message.content
    else:
        s = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=16, logprobs=True, top_logprobs=3,
                                           stream=True)
        texts, _, chunks = collect_stream(s)
        content = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
        text = texts[0]
    assert text == want.text
    assert "".join(e.token for e in content) == text
    check_chat_logprobs(llm, content, want, 3)


def test_chat_logprobs_without_top(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=0,
                                       max_tokens=4, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 4
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=0, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_chat_logprobs_of_answer_ending_on_eos(client: openai.OpenAI, llm: LLM) -> None:
    want = offline_chat(llm, CHATS[0], greedy(24))
    assert want.finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=0,
                                       max_tokens=24, logprobs=True)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text
    assert "".join(e.token for e in content) == want.text


def test_chat_logprob_bytes_of_split_characters(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Translate to Chinese: I love my cat."}]
    want = offline_chat(llm, messages, greedy(12))
    assert "\ufffd" in "".join(llm.tokenizer.decode([t]) for t in want.token_ids)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=12, logprobs=True)
    text = r.choices[0].message.content
    assert text == want.text
    raw = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content)
    assert raw.decode("utf-8", errors="replace") == text


def test_completion_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    tok = llm.tokenizer
    want = offline_text(llm, TEXTS[1], greedy(10, top_logprobs=2, ignore_eos=True))
    r = client.completions.create(model=MODEL, prompt=TEXTS[1], temperature=0, max_tokens=10,
                                  logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == want.text
    assert lp.tokens == [tok.decode([t]) for t in want.token_ids]
    assert "".join(lp.tokens) == c.text
    assert all(abs(a - b) < TOL for a, b in zip(lp.token_logprobs, want.logprobs, strict=True))
    assert len(lp.top_logprobs) == 10
    for i, top in enumerate(lp.top_logprobs):
        assert 1 <= len(top) <= 2
        wanted = {tok.decode([t]): v for t, v in want.top_logprobs[i]}
        assert set(top) == set(wanted)
        assert all(abs(top[k] - wanted[k]) < TOL for k in top)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    assert all(c.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))

    s = client.completions.create(model=MODEL, prompt=TEXTS[1], temperature=0, max_tokens=10,
                                  logprobs=2, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for ch in s for c in ch.choices]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    r0 = client.completions.create(model=MODEL, prompt=TEXTS[1], temperature=0, max_tokens=3,
                                   logprobs=0)  # only the chosen tokens' log-probs
    assert len(r0.choices[0].logprobs.token_logprobs) == 3


def test_completion_echo(client: openai.OpenAI, llm: LLM) -> None:
    want = offline_text(llm, TEXTS[0], greedy(4, top_logprobs=1, ignore_eos=True))
    r = client.completions.create(model=MODEL, prompt=TEXTS[0], temperature=0, max_tokens=4,
                                  echo=True, logprobs=1, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == TEXTS[0] + want.text
    assert all(c.text[o:o + len(t)] == t for o, t in zip(c.logprobs.text_offset, c.logprobs.tokens))
    s = client.completions.create(model=MODEL, prompt=TEXTS[0], temperature=0, max_tokens=4,
                                  echo=True, stream=True, extra_body={"ignore_eos": True})
    texts, _, _ = collect_stream(s)
    assert texts == {0: c.text}


def test_completion_echo_of_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    """Token-id prompts echo as the tokenizer decodes them (independently here: HF's decode),
    in a batch beside a string prompt, with n, streamed or not; the offsets index the echo."""
    ids = llm.tokenizer.encode(TEXTS[2])[:9]
    decoded = llm.tokenizer.decode(ids, skip_special_tokens=True)
    want = offline_text(llm, ids, greedy(4, ignore_eos=True)).text
    want0 = offline_text(llm, TEXTS[0], greedy(4, ignore_eos=True)).text
    kw: dict[str, Any] = dict(model=MODEL, temperature=0, max_tokens=4, echo=True,
                              extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=[ids, TEXTS[0]], n=2, logprobs=1, **kw)
    by_index = {c.index: c for c in r.choices}
    assert [by_index[i].text for i in range(4)] == [decoded + want] * 2 + [TEXTS[0] + want0] * 2
    lp = by_index[0].logprobs
    assert lp.text_offset[0] == len(decoded)
    # with ignore_eos the model writes <|im_end|>, which the text leaves out: it takes no place
    hidden = set(llm.tokenizer.all_special_tokens)
    assert hidden & set(lp.tokens), lp.tokens  # (so that this checks it)
    ends = [*lp.text_offset[1:], len(by_index[0].text)]
    for o, end, t in zip(lp.text_offset, ends, lp.tokens):
        assert (o == end) if t in hidden else by_index[0].text[o:o + len(t)] == t
    texts, _, _ = collect_stream(client.completions.create(prompt=ids, stream=True, **kw))
    assert texts == {0: decoded + want}
    plain = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == want  # no echo unless asked


def test_completion_echo_streamed_offsets(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=TEXTS[0], temperature=0, max_tokens=4,
                              echo=True, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c for ch in client.completions.create(stream=True, **kw) for c in ch.choices]
    text = "".join(c.text for c in chunks)
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert all(text[o:o + len(t)] == t for o, t in zip(offsets, tokens))
    assert offsets == whole.text_offset


# -- max_tokens ---------------------------------------------------------------------------------
def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    for kw in ({"max_tokens": 7}, {"max_completion_tokens": 7}):
        r = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=0,
                                           extra_body={"ignore_eos": True}, **kw)
        assert r.choices[0].finish_reason == "length", kw
        assert r.usage is not None and r.usage.completion_tokens == 7, kw
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=9,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 9
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=0,
                                  extra_body={"ignore_eos": True})  # OpenAI's default: 16
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_max_tokens_up_to_the_context(client: openai.OpenAI, llm: LLM) -> None:
    """prompt + max_tokens == context is allowed; one more token is a 400 (tested below)."""
    ids = llm.tokenizer.encode(STORY)
    r = client.completions.create(model=MODEL, prompt=[1] * (CONTEXT - 3 - len(ids)) + ids,
                                  temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.total_tokens == CONTEXT


# -- native /generate and /v1/models ----------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("prompt_kind", ["text", "input_ids"])
def test_generate(server: Server, llm: LLM, stream: bool, prompt_kind: str) -> None:
    want = offline_text(llm, TEXTS[0], greedy(10))
    prompt: Any = TEXTS[0] if prompt_kind == "text" else llm.tokenizer.encode(TEXTS[0])
    body = {prompt_kind: prompt, "sampling_params": {"temperature": 0, "max_tokens": 10},
            "stream": stream}
    if not stream:
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["text"] == want.text and out["output_ids"] == want.token_ids
        meta = out["meta_info"]
    else:
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = list(sse_events(r.iter_lines()))
        assert events[-1] == "[DONE]"
        events = events[:-1]
        assert "".join(e["text"] for e in events) == want.text
        assert [t for e in events for t in e["output_ids"]] == want.token_ids
        assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
        meta = events[-1]["meta_info"]
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        assert counts == sorted(counts)
    assert meta["finish_reason"] == want.finish_reason
    assert meta["prompt_tokens"] == len(want.prompt_token_ids)
    assert meta["completion_tokens"] == len(want.token_ids)


def test_generate_takes_sglangs_max_new_tokens(server: Server, llm: LLM) -> None:
    """SGLang's native API names the length limit max_new_tokens: the same as max_tokens here."""
    want = offline_text(llm, TEXTS[2], greedy(7, ignore_eos=True))
    for extra in ({}, {"max_tokens": 7}):
        sp = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True, **extra}
        r = httpx.post(server.url + "/generate", timeout=120,
                       json={"text": TEXTS[2], "sampling_params": sp})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == want.token_ids and len(want.token_ids) == 7
        assert out["meta_info"]["finish_reason"] == "length"


def test_generate_logprobs(server: Server, llm: LLM) -> None:
    want = offline_text(llm, TEXTS[1], greedy(6, top_logprobs=2, ignore_eos=True))
    r = httpx.post(server.url + "/generate", timeout=120, json={
        "text": TEXTS[1], "sampling_params": {"temperature": 0, "max_tokens": 6,
                                              "ignore_eos": True, "top_logprobs": 2}})
    assert r.status_code == 200, r.text
    entries = r.json()["meta_info"]["logprobs"]
    assert len(entries) == 6
    for (token, lp, top), tid, wlp in zip(entries, want.token_ids, want.logprobs):
        assert token == llm.tokenizer.decode([tid]) and abs(lp - wlp) < TOL
        assert len(top) == 2 and top[0][0] == token


def test_models(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(server.url + "/v1/models")
    assert r.json()["data"][0]["max_model_len"] == CONTEXT


# -- fields OpenAI clients send that the server does not use ----------------------------------------
def test_unknown_fields_are_ignored(client: openai.OpenAI, server: Server) -> None:
    base = client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=0,
                                          max_tokens=12)
    r = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], temperature=0, max_tokens=12, user="user-1",
        metadata={"team": "a"}, parallel_tool_calls=False, store=False, service_tier="auto",
        logit_bias={}, extra_body={"some_future_field": {"x": [1, 2]}})
    assert r.choices[0].message.content == base.choices[0].message.content
    s = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False,  # type: ignore[typeddict-unknown-key]
                        "continuous_usage_stats": False})
    texts, _, chunks = collect_stream(s)
    assert texts == {0: base.choices[0].message.content}
    assert chunks[-1].usage is not None
    c = client.completions.create(model=MODEL, prompt=TEXTS[0], temperature=0, max_tokens=6,
                                  user="user-1", extra_body={"metadata": {"a": "b"}})
    assert c.choices[0].finish_reason in ("stop", "length")
    r2 = httpx.post(server.url + "/generate", timeout=60, json={
        "text": TEXTS[0], "rid": "mine", "sampling_params": {"temperature": 0, "max_tokens": 4,
                                                             "whatever": 1}})
    assert r2.status_code == 200, r2.text


def test_logit_bias_is_applied_or_rejected(client: openai.OpenAI, llm: LLM, server: Server) -> None:
    want = offline_chat(llm, CHATS[0], greedy(4))
    first = want.token_ids[0]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": CHATS[0], "temperature": 0, "max_tokens": 4,
        "logprobs": True, "logit_bias": {str(first): -100}})
    if r.status_code == 400:
        assert_error(r, 400, "logit_bias")
        return
    assert r.status_code == 200, r.text
    first_token = r.json()["choices"][0]["logprobs"]["content"][0]["token"]
    assert first_token != llm.tokenizer.decode([first])


# -- concurrency ------------------------------------------------------------------------------------
def test_32_concurrent_streams_match_sequential(server: Server) -> None:
    prompts = [[{"role": "user", "content": f"Give me a fun fact about the number {i}."}]
               for i in range(32)]
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    alone = []
    for m in prompts:  # one at a time
        r = sync.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=10)
        alone.append((r.choices[0].message.content, r.choices[0].finish_reason))
    assert len(set(alone)) > 16  # the prompts are distinct enough to matter

    async def one(ac: openai.AsyncOpenAI, m: list[dict[str, str]]) -> tuple[str, str | None]:
        s = await ac.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                             max_tokens=10, stream=True)
        text, finish = "", None
        async for ch in s:
            for c in ch.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                timeout=300)
        try:
            return list(await asyncio.gather(*(one(ac, m) for m in prompts)))
        finally:
            await ac.close()

    together = asyncio.run(main())
    assert together == alone
    server.wait_idle()


# -- clients that go away ---------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_everything(server: Server) -> None:
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 480, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
            for _ in range(2):
                assert next(events)["choices"][0]["finish_reason"] is None
            during = server.stats()
            assert during["running"] == 1 and during["held_pages"] > 0
    server.wait_idle(10)


def test_client_timeout_on_plain_request_frees_everything(server: Server) -> None:
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True}
    failure: list[BaseException] = []

    def post() -> None:
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=3)
        except BaseException as e:  # noqa: BLE001 (the thread reports what happened)
            failure.append(e)

    t = threading.Thread(target=post)
    t.start()
    running = 0
    while t.is_alive() and not running:
        running = server.stats()["running"]
        time.sleep(0.05)
    t.join(30)
    assert running == 1, "the request never ran"
    assert len(failure) == 1 and isinstance(failure[0], httpx.TimeoutException), failure
    server.wait_idle(10)


# -- bad requests ------------------------------------------------------------------------------------
M = [{"role": "user", "content": "hi"}]
LONG = "hi " * 600  # 601 tokens with the BOS-less SmolLM2 tokenizer


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": M, **kw}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **kw}


CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"


def bad(case: str, method: str, path: str, body: Any, status: int, param: str | None,
        code: str | None, needles: tuple[str, ...], xfail: str | None = None) -> Any:
    """One row: the request (json body, raw bytes or None) and the error it must get."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(method, path, body, status, param, code, needles, id=case, marks=marks)


BAD = [
    bad("temperature-negative", "POST", CHAT, chat(temperature=-1), 400, "temperature", None, ()),
    bad("temperature-string", "POST", CHAT, chat(temperature="hot"), 400, "temperature", None, ()),
    bad("temperature-too-high", "POST", COMP, comp(temperature=2.5), 400, "temperature", None, ()),
    bad("top_p-zero", "POST", CHAT, chat(top_p=0), 400, "top_p", None, ()),
    bad("top_k-zero", "POST", CHAT, chat(top_k=0), 400, "top_k", None, ()),
    bad("top_k-minus-two", "POST", COMP, comp(top_k=-2), 400, "top_k", None, ()),
    bad("min_p-two", "POST", CHAT, chat(min_p=2), 400, "min_p", None, ()),
    bad("n-zero", "POST", CHAT, chat(n=0), 400, "n", None, ()),
    bad("n-string", "POST", COMP, comp(n="2"), 400, "n", None, ()),
    bad("max_tokens-zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens", None, ()),
    bad("max_tokens-string", "POST", CHAT, chat(max_tokens="x"), 400, "max_tokens", None, ()),
    bad("max_tokens-context", "POST", COMP, comp(max_tokens=CONTEXT), 400, "max_tokens", None,
        (str(CONTEXT),)),
    bad("max_tokens-plus-prompt", "POST", COMP, comp(prompt=[1] * 20, max_tokens=CONTEXT - 10),
        400, "max_tokens", None, ("20", str(CONTEXT - 10), str(CONTEXT + 10), str(CONTEXT))),
    bad("max_completion_tokens-zero", "POST", CHAT, chat(max_completion_tokens=0), 400,
        "max_completion_tokens", None, ()),
    bad("max_completion_tokens-plus-prompt", "POST", CHAT,
        chat(max_completion_tokens=CONTEXT - 5), 400, "max_completion_tokens", None,
        (str(CONTEXT),)),
    bad("prompt-too-long", "POST", COMP, comp(prompt=LONG), 400, "prompt", None,
        ("601", str(CONTEXT))),
    bad("prompt-ids-too-long-streaming", "POST", COMP, comp(prompt=[1] * 600, stream=True), 400,
        "prompt", None, ("600", str(CONTEXT))),
    bad("prompt-at-context", "POST", COMP, comp(prompt=[1] * CONTEXT), 400, "prompt", None,
        (str(CONTEXT),)),
    bad("chat-too-long", "POST", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400,
        "messages", None, (str(CONTEXT),)),
    bad("prompt-id-outside-vocab", "POST", COMP, comp(prompt=[1, 2, 49152]), 400, "prompt", None,
        ("49152",)),
    bad("prompt-id-negative", "POST", COMP, comp(prompt=[1, -1]), 400, "prompt", None, ()),
    bad("prompt-missing", "POST", COMP, {"model": MODEL}, 400, "prompt", None, ()),
    bad("prompt-empty-list", "POST", COMP, comp(prompt=[]), 400, "prompt", None, ()),
    bad("prompt-empty-string", "POST", COMP, comp(prompt=""), 400, "prompt", None, ()),
    bad("prompt-mixed-list", "POST", COMP, comp(prompt=["a", 3]), 400, "prompt", None, ()),
    bad("messages-missing", "POST", CHAT, {"model": MODEL}, 400, "messages", None, ()),
    bad("messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages", None, ()),
    bad("messages-not-object", "POST", CHAT, chat(messages=["hi"]), 400, "messages[0]", None, ()),
    bad("messages-bad-role", "POST", CHAT, chat(messages=[{"role": "bot", "content": "x"}]), 400,
        "messages[0].role", None, ("bot",)),
    bad("messages-content-int", "POST", CHAT,
        chat(messages=[{"role": "system", "content": "a"}, {"role": "user", "content": 3}]), 400,
        "messages[1].content", None, ()),
    bad("messages-content-image", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
        "messages[0].content[0]", None, ()),
    bad("stop-too-many", "POST", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop",
        None, ()),
    bad("stop-not-strings", "POST", CHAT, chat(stop=[1]), 400, "stop", None, ()),
    bad("stop-empty-string", "POST", COMP, comp(stop=""), 400, "stop", None, ()),
    bad("stop_token_ids-negative", "POST", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids",
        None, ()),
    bad("seed-float", "POST", CHAT, chat(seed=1.5), 400, "seed", None, ()),
    bad("logprobs-string", "POST", CHAT, chat(logprobs="yes"), 400, "logprobs", None, ()),
    bad("top_logprobs-30", "POST", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs",
        None, ("30",)),
    bad("top_logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=3), 400, "top_logprobs",
        None, ()),
    bad("completion-logprobs-bool", "POST", COMP, comp(logprobs=True), 400, "logprobs", None, ()),
    bad("completion-logprobs-21", "POST", COMP, comp(logprobs=21), 400, "logprobs", None, ()),
    bad("stream-string", "POST", CHAT, chat(stream="yes"), 400, "stream", None, ()),
    bad("stream_options-without-stream", "POST", CHAT, chat(stream_options={"include_usage": True}),
        400, "stream_options", None, ()),
    bad("stream_options-not-object", "POST", COMP, comp(stream=True, stream_options=1), 400,
        "stream_options", None, ()),
    bad("presence_penalty-3", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty",
        None, ()),
    bad("frequency_penalty-minus-3", "POST", COMP, comp(frequency_penalty=-3), 400,
        "frequency_penalty", None, ()),
    bad("repetition_penalty-zero", "POST", CHAT, chat(repetition_penalty=0), 400,
        "repetition_penalty", None, ()),
    bad("suffix", "POST", COMP, comp(suffix="x"), 400, "suffix", None, ()),
    bad("best_of", "POST", COMP, comp(best_of=2), 400, "best_of", None, ()),
    bad("model-unknown", "POST", CHAT, chat(model="gpt-4"), 404, "model", "model_not_found",
        ("gpt-4",)),
    bad("model-unknown-completions", "POST", COMP, comp(model="nope"), 404, "model",
        "model_not_found", ()),
    bad("generate-temperature", "POST", GEN, {"text": "hi", "sampling_params": {"temperature": -1}},
        400, "sampling_params.temperature", None, ()),
    bad("generate-top_logprobs", "POST", GEN,
        {"text": "hi", "sampling_params": {"top_logprobs": 30}}, 400,
        "sampling_params.top_logprobs", None, ()),
    bad("generate-n", "POST", GEN, {"text": "hi", "sampling_params": {"n": 3}}, 400,
        "sampling_params.n", None, ()),
    bad("generate-max_new_tokens-zero", "POST", GEN,
        {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400,
        "sampling_params.max_new_tokens", None, ()),
    bad("generate-max_new_tokens-vs-max_tokens", "POST", GEN,
        {"text": "hi", "sampling_params": {"max_new_tokens": 3, "max_tokens": 4}}, 400,
        "sampling_params.max_new_tokens", None, ("max_tokens",)),
    bad("generate-both-prompts", "POST", GEN, {"text": "hi", "input_ids": [1]}, 400, "text", None,
        ()),
    bad("generate-no-prompt", "POST", GEN, {"sampling_params": {}}, 400, "text", None, ()),
    bad("generate-id-outside-vocab", "POST", GEN, {"input_ids": [99999]}, 400, "input_ids",
        None, ("99999",)),
    bad("generate-text-too-long", "POST", GEN, {"text": LONG}, 400, "text", None,
        ("601", str(CONTEXT))),
    bad("generate-sampling_params-list", "POST", GEN, {"text": "hi", "sampling_params": [1]}, 400,
        "sampling_params", None, ()),
    bad("invalid-json", "POST", CHAT, b'{"messages": [', 400, None, None, ("JSON",)),
    bad("invalid-utf8", "POST", COMP, b"\xff\xfe", 400, None, None, ("JSON",)),
    bad("body-not-object", "POST", COMP, b"[1, 2]", 400, None, None, ("object",)),
    bad("body-too-large", "POST", COMP, b"x" * (8 * 1024 * 1024 + 1), 413, None, None,
        (str(8 * 1024 * 1024),)),
    bad("get-on-post-route", "GET", CHAT, None, 405, None, "method_not_allowed", ()),
    bad("post-on-get-route", "POST", "/v1/models", b"{}", 405, None, "method_not_allowed", ()),
    bad("unknown-route", "POST", "/v1/embeddings", b"{}", 404, None, "not_found", ()),
    bad("unknown-route-get", "GET", "/nope", None, 404, None, "not_found", ()),
]


def send(server: Server, method: str, path: str, body: Any) -> httpx.Response:
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"] = {"content-type": "application/json"}
    elif body is not None:
        kw["json"] = body
    return httpx.request(method, server.url + path, timeout=60, **kw)


@pytest.mark.parametrize("method,path,body,status,param,code,needles", BAD)
def test_bad_request(server: Server, method: str, path: str, body: Any, status: int,
                     param: str | None, code: str | None, needles: tuple[str, ...]) -> None:
    r = send(server, method, path, body)
    err = assert_error(r, status, param, code)
    if param is not None:
        assert param.rsplit(".", 1)[-1].split("[")[0] in err["message"], err
    for needle in needles:
        assert needle in err["message"], err


def test_healthy_after_bad_requests(server: Server, client: openai.OpenAI) -> None:
    for case in BAD:
        method, path, body, *_ = case.values
        assert send(server, method, path, body).status_code >= 400
    assert httpx.get(server.url + "/health").status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=0,
                                       max_tokens=8)
    assert r.choices[0].message.content
    server.wait_idle(10)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=-1)
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="hi")
    assert missing.value.code == "model_not_found"


# -- a second server: --api-key, --served-model-name, --max-body-bytes -------------------------------
KEY = "s3cret-key"
NAME = "my-model"


@pytest.fixture(scope="module")
def custom() -> Iterator[Server]:
    with running_server(*BASE_ARGS, "--api-key", KEY, "--served-model-name", NAME,
                        "--max-body-bytes", "4096",
                        headers={"Authorization": f"Bearer {KEY}"}) as s:
        yield s


def test_api_key(custom: Server) -> None:
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(custom.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert_error(r, 401, None, "invalid_api_key")
        assert_error(httpx.get(custom.url + "/v1/models", headers=headers), 401, None,
                     "invalid_api_key")
        assert httpx.get(custom.url + "/stats", headers=headers).status_code == 401
    assert httpx.get(custom.url + "/health").status_code == 200  # open: load balancers probe it
    r = httpx.post(custom.url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=custom.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_served_model_name(custom: Server, llm: LLM) -> None:
    c = openai.OpenAI(base_url=custom.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in c.models.list().data] == [NAME]
    want = offline_chat(llm, CHATS[0], greedy(12))
    r = c.chat.completions.create(model=NAME, messages=CHATS[0], temperature=0, max_tokens=12)
    assert r.model == NAME and r.choices[0].message.content == want.text
    r2 = c.completions.create(model=NAME, prompt=TEXTS[0], temperature=0, max_tokens=4)
    assert r2.model == NAME
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2)
    # no model field at all: the served model
    r3 = httpx.post(custom.url + "/v1/completions", timeout=60,
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"prompt": TEXTS[0], "temperature": 0, "max_tokens": 4})
    assert r3.status_code == 200 and r3.json()["model"] == NAME


def test_max_body_bytes(custom: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"model": NAME, "prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = httpx.post(custom.url + "/v1/completions", content=big, headers=auth, timeout=60)
    assert_error(r, 413, None)
    assert "4096" in r.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no content-length: the limit is counted while reading
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(custom.url + "/v1/completions", content=chunked(), headers=auth, timeout=60)
    assert_error(r, 413, None)
    small = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 1,
                        "padding": "x" * 3500}).encode()  # just under the limit
    assert len(small) < 4096
    r = httpx.post(custom.url + "/v1/completions", content=small, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
