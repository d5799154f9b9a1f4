"""Prompt-lookup speculative decoding (speculative.py) on a tiny random Llama.

References: HF greedy by full recomputation, the same engine without drafts (seeded sampling),
and brute-force searches for the draft and acceptance rules."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minisgl.core import LLM, SamplingParams
from minisgl.core.request import Batch, Req
from minisgl.core.speculative import NGRAM_SIZES, VERIFY_ROWS, NgramIndex, accept

from .conftest import hf_greedy, save_tiny_llama
from .test_engine import all_free, greedy

# The tiny model's greedy answers fall into short cycles within a few tokens (its own drafts are
# then right); the prompts repeat themselves, so the first steps have drafts from the prompt.
PROMPTS = [[5, 9, 17, 3, 5, 9, 17, 3, 5, 9], [40, 41, 42, 43, 40, 41], [7, 8, 7, 8, 7],
           [100, 3, 60, 60, 2, 11, 100, 3, 60]]


def spec_llm(tiny_llama: Path, attention_backend: str, k: int = 4, **kw: object) -> LLM:
    opts: dict[str, object] = dict(dtype="float32", attention_backend=attention_backend,
                                   page_size=4, num_pages=96, max_running_requests=8)
    opts.update(kw)
    return LLM(model=str(tiny_llama), speculative_tokens=k, **opts)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, attention_backend: str) -> LLM:
    return spec_llm(tiny_llama, attention_backend)


def brute_draft(ids: list[int], k: int) -> list[int]:
    """The latest earlier occurrence of the last n-gram (longest n first), searched in full;
    the tokens after it copied one by one onto the end (a copy may read what it just wrote)."""
    for n in NGRAM_SIZES:
        if len(ids) <= n:
            continue
        for p in range(len(ids) - 2, n - 2, -1):
            if ids[p - n + 1: p + 1] == ids[-n:]:
                ext = list(ids)
                for i in range(k):
                    ext.append(ext[p + 1 + i])
                return ext[len(ids):]
    return []


def test_accept_keeps_sampled_tokens_through_the_first_miss() -> None:
    assert accept([], [7]) == [7]
    assert accept([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    rng = random.Random(0)
    for _ in range(500):
        d = [rng.randrange(3) for _ in range(rng.randrange(6))]
        s = [rng.randrange(3) for _ in range(len(d) + 1)]
        n = next((j for j in range(len(d)) if d[j] != s[j]), len(d))  # first miss
        assert accept(d, s) == s[: n + 1]


def test_ngram_drafts_match_a_full_search_as_tokens_arrive() -> None:
    rng = random.Random(1)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        req = Req([rng.randrange(vocab) for _ in range(rng.randrange(1, 12))], greedy(50))
        index = NgramIndex()
        for _ in range(40):
            k = rng.randrange(1, 6)
            assert index.draft(req, k) == brute_draft(req.all_ids, k), (trial, req.all_ids)
            req.output_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))


def test_greedy_with_drafts_matches_hf_and_frees_pages(llm: LLM, hf_tiny: object) -> None:
    before = llm.scheduler.stats.accepted_tokens
    outs = llm.generate(PROMPTS, greedy(24))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf_tiny, prompt, 24)
        assert out.finish_reason == "length"
    assert llm.scheduler.stats.accepted_tokens - before > 20, "no draft was ever right"
    assert all_free(llm)


def test_stops_and_lengths_inside_a_kept_run(llm: LLM, hf_tiny: object) -> None:
    """A stop token or max_tokens in the middle of the tokens a step keeps ends the request
    there: nothing after it is returned, and its pages are freed."""
    prompt = PROMPTS[0]
    ref = hf_greedy(hf_tiny, prompt, 20)
    for n in range(1, 21):
        out = llm.generate([prompt], greedy(n))[0]
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    for stop in sorted(set(ref)):
        out = llm.generate([prompt], greedy(20, stop_token_ids=[stop]))[0]
        assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    assert all_free(llm)


def test_context_limit_and_row_budget(tiny_llama: Path, attention_backend: str,
                                      hf_tiny: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts never compute past max_model_len, and a step checks at most VERIFY_ROWS tokens
    (or one per request where there are more requests)."""
    llm = spec_llm(tiny_llama, attention_backend, k=8, max_model_len=40)
    steps: list[tuple[Batch, int]] = []  # each step, and the most tokens a request of it has after
    launch = llm.scheduler.scheduler._launch
    monkeypatch.setattr(llm.scheduler.scheduler, "_launch", lambda b: (steps.append(
        (b, max(r.num_computed + n for r, n in zip(b.reqs, b.extend_lens)))), launch(b))[1])
    try:
        prompt = PROMPTS[0]  # 10 tokens: 30 left, the answer cycles through two tokens
        out = llm.generate([prompt], greedy(40))[0]
        assert out.finish_reason == "length" and out.token_ids == hf_greedy(hf_tiny, prompt, 30)
        prompts = [[(3 * i + j) % 5 + 10 for j in range(12)] for i in range(8)]
        outs = llm.generate(prompts, greedy(12))
        assert [o.token_ids for o in outs] == [hf_greedy(hf_tiny, p, 12) for p in prompts]
        verify = [(b, end) for b, end in steps if b.drafts]
        assert verify, "no step had drafts"
        # drafts reached the context's last position (the last token's K/V is never computed)
        assert max(end for _, end in verify) == 39
        for b, _ in verify:
            assert b.num_tokens <= max(VERIFY_ROWS, len(b.reqs))
        assert all_free(llm)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def peaky_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its LM head x20: its sampled answers repeat (as greedy ones do)
    often enough for drafts to be kept, and stray often enough for them to be rejected (the
    unscaled model's distributions are so flat that no sampled n-gram ever recurs)."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path_factory.mktemp("peaky_llama"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    return path


def test_seeded_sampling_is_the_same_with_and_without_drafts(peaky_llama: Path,
                                                             attention_backend: str) -> None:
    """The kept tokens are what decoding one token a step samples: with the same seed and the
    same (float32) logits, the same tokens, drafts rejected or not."""
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=p, seed=s, ignore_eos=True,
                             top_logprobs=2)
              for s, (t, p) in enumerate([(0.5, 1.0), (0.8, 0.9), (1.0, 1.0), (0.7, 0.8)])]
    outs = {}
    for k in (0, 4):
        with spec_llm(peaky_llama, attention_backend, k=k) as llm:
            outs[k] = llm.generate(PROMPTS, params)
            stats = llm.scheduler.stats
            assert all_free(llm)
    assert [o.token_ids for o in outs[4]] == [o.token_ids for o in outs[0]]
    for a, b in zip(outs[4], outs[0]):  # each kept token's log-prob and top-2 from its own row
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [[i for i, _ in t] for t in a.top_logprobs] == [[i for i, _ in t] for t in b.top_logprobs]
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens, \
        "drafts were never both kept and rejected: the test checked nothing"


def test_requests_with_penalties_decode_without_drafts(llm: LLM) -> None:
    drafted = llm.scheduler.stats.draft_tokens
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.5)
    out = llm.generate([PROMPTS[2]], p)[0]
    assert llm.scheduler.stats.draft_tokens == drafted
    with spec_llm(llm.config.model, llm.config.attention_backend, k=0) as plain:
        assert plain.generate([PROMPTS[2]], p)[0].token_ids == out.token_ids
    assert all_free(llm)


def test_bad_speculative_options_name_the_field(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="speculative_tokens"):
        LLM(model=str(tiny_llama), speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_tokens.*overlap"):
        LLM(model=str(tiny_llama), speculative_tokens=2, overlap=True)
    from minisgl.core.config import EngineConfig

    # a GPU's default overlap gives way to drafts (no GPU needed to build the config)
    assert EngineConfig(model="m", device="cuda").use_overlap
    assert not EngineConfig(model="m", device="cuda", speculative_tokens=4).use_overlap
