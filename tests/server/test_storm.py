"""A storm of mixed requests on a real server whose KV pool is too small for them all at once.

Greedy completions (token-id prompts) run beside streams whose clients hang up, plain requests
whose clients time out, and bad requests, all at once, on a server with 24 KV pages (384 tokens)
for ~1,150 tokens of greedy work whose answers outgrow their prompts: the scheduler admits
requests on their prompts and must retract running ones when their answers fill the pool.
Every greedy answer must still be the offline engine's (float32, no shortage of pages), the
bad requests get 400s naming their field, and afterwards nothing runs, waits or holds a page.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from minisgl.core import LLM, SamplingParams

from .conftest import BASE_ARGS, Server, running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PAGES = 24  # x 16 tokens: a third of the greedy requests' KV at once


@pytest.fixture(scope="module")
def tight() -> Iterator[Server]:
    with running_server(*BASE_ARGS, "--num-pages", str(PAGES)) as s:
        yield s


def _workload() -> tuple[list[tuple[list[int], int]], list[list[int]]]:
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    greedy = [(ids(rng.randint(20, 60)), rng.randint(50, 100)) for _ in range(10)]
    return greedy, [ids(rng.randint(20, 100)) for _ in range(10)]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": "x", "n": 100}, "n"),
    ({"prompt": [7] * 600, "max_tokens": 4}, "prompt"),  # past the 512-token context
    ({"prompt": "x", "stop": [""]}, "stop"),
]


def test_mixed_storm_on_a_tight_pool(tight: Server) -> None:
    greedy, others = _workload()
    llm = LLM(model=MODEL, dtype="float32")
    try:
        outs = llm.generate([p for p, _ in greedy],
                            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                             for _, n in greedy])
        expected = [o.text for o in outs]
    finally:
        llm.close()
    assert len(set(expected)) == len(expected)
    before = tight.stats()["retractions"]

    async def complete(ac: openai.AsyncOpenAI, prompt: list[int], n: int) -> str:
        r = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage is not None
        assert r.usage.completion_tokens == n
        return r.choices[0].text

    async def hang_up(ac: openai.AsyncOpenAI, prompt: list[int], after: int) -> None:
        s = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=200,
                                        temperature=0.8, stream=True,
                                        extra_body={"ignore_eos": True})
        seen = 0
        async for _ in s:
            seen += 1
            if seen > after:
                break
        await s.close()

    async def time_out(ac: openai.AsyncOpenAI, prompt: list[int], seconds: float) -> None:
        with pytest.raises((openai.APITimeoutError, openai.APIConnectionError)):
            await ac.with_options(timeout=seconds).completions.create(
                model=MODEL, prompt=prompt, max_tokens=200, extra_body={"ignore_eos": True})

    async def bad(http: httpx.AsyncClient, body: dict[str, Any], field: str) -> None:
        r = await http.post("/v1/completions", json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text

    async def storm() -> list[Any]:
        ac = openai.AsyncOpenAI(base_url=tight.url + "/v1", api_key="x", max_retries=0,
                                timeout=600)
        http = httpx.AsyncClient(base_url=tight.url, timeout=60)
        try:
            jobs = [complete(ac, p, n) for p, n in greedy]
            jobs += [hang_up(ac, p, i % 3) for i, p in enumerate(others[:6])]
            jobs += [time_out(ac, p, 0.3 + 0.3 * i) for i, p in enumerate(others[6:])]
            jobs += [bad(http, body, field) for body, field in BAD]
            order = list(range(len(jobs)))
            random.Random(1).shuffle(order)
            results = await asyncio.gather(*(jobs[i] for i in order))
            by_job = dict(zip(order, results))
            return [by_job[i] for i in range(len(greedy))]
        finally:
            await ac.close()
            await http.aclose()

    got = asyncio.run(storm())
    assert got == expected
    idle = tight.wait_idle(30)
    assert idle["retractions"] > before, "the pool never ran out: the storm tested nothing"
    assert tight.stats()["integrity"] == "ok"
