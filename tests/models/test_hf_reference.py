"""minisgl vs HF transformers (float32) on tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints.

Every test is parametrized over the checkpoints of conftest.SPECS: Llama with GQA and llama3 rope
scaling (untied head), Llama with a tied head, MQA and attention biases, Qwen3 (qk-norm, head_dim
!= hidden / heads) tied and untied, Qwen2 (q/k/v biases, none on o_proj; tied), Mistral, and a
sharded checkpoint. Prompts run up to 150 tokens, past the llama3
``original_max_position_embeddings`` of 64.

Measured engine-vs-HF max abs logit differences (logit std about 0.8-1.2), over 8 prompts and 8
greedy steps, page size 16 unchunked and page size 1 with 48-token prefill chunks alike:
first step 1.6e-6 .. 3.0e-6, decode steps 2.0e-6 .. 5.4e-6 (Qwen2 and Mistral, added
later: first step 7.7e-7 .. 2.9e-6, decode steps 6.0e-7 .. 3.9e-6). The bound
ATOL = 1e-4 leaves a ~18x margin.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl.core import LLM
from minisgl.core.scheduler import Scheduler

from .conftest import SPEC_BY_NAME, VOCAB, TinySpec
from .reference import (
    DEVICE,
    assert_all_free,
    explain_mismatch,
    greedy,
    hf_greedy,
    hf_logits,
    make_engine,
    make_prompts,
    max_abs_diff,
    record_logits,
    run_to_completion,
    submit,
)

ATOL = 1e-4
LENGTHS = [1, 3, 17, 40, 65, 90, 150, 7]  # 8 prompts; four run past position 64
PROMPTS = make_prompts(LENGTHS, VOCAB, seed=1234)
GREEDY_TOKENS = 32

Tiny = tuple[TinySpec, Path]


def test_sharded_checkpoint_is_sharded(tiny_dirs: dict[str, Path]) -> None:
    """The sharded spec really exercises the index.json path (all other tests then load it)."""
    d = tiny_dirs["llama-llama3-sharded"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 3 and all((d / f).is_file() for f in files)
    assert not (d / "model.safetensors").exists()
    assert SPEC_BY_NAME["llama-llama3-sharded"].max_shard_size


def test_tied_checkpoint_has_no_lm_head_and_engine_shares_it(tiny_dirs: dict[str, Path],
                                                            attention_backend: str) -> None:
    from safetensors import safe_open

    for name in ("llama-tied-mqa-bias", "qwen3-tied"):
        d = tiny_dirs[name]
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            assert not any(k.startswith("lm_head.") for k in f.keys())
        engine = make_engine(d, attention_backend, num_pages=8)
        model = engine.model
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # type: ignore[union-attr]


def test_greedy_references_have_no_near_ties(tiny: Tiny) -> None:
    """Every HF greedy pick wins by more than 2 * ATOL, so logits within ATOL of HF's must pick
    the same token: a greedy mismatch below is an engine bug, never a float-rounding coin flip."""
    spec, path = tiny
    for p in PROMPTS:
        ref = hf_greedy(path, p, GREEDY_TOKENS)
        rows = hf_logits(path, p + ref[:-1])[len(p) - 1:]
        top2 = rows.topk(2, dim=-1)
        assert top2.indices[:, 0].tolist() == ref  # generate() agrees with a plain forward
        gap = float((top2.values[:, 0] - top2.values[:, 1]).min())
        assert gap > 2 * ATOL, f"{spec}: near tie (gap {gap}) in the greedy reference"


@pytest.mark.parametrize("page_size", [1, 16])
def test_first_step_logits_of_one_mixed_batch(tiny: Tiny, attention_backend: str,
                                              page_size: int) -> None:
    """8 prompts of lengths 1..150 prefilled together in one batch: each row = HF's last row."""
    spec, path = tiny
    engine = make_engine(path, attention_backend, page_size=page_size)
    scheduler = Scheduler(engine)
    reqs = submit(scheduler, PROMPTS, greedy(1))
    batch = scheduler.next_batch()
    assert batch is not None and batch.phase == "prefill"
    assert batch.reqs == reqs and batch.extend_lens == LENGTHS and all(batch.sample)
    logits = engine.forward(engine.prepare(batch))
    assert logits.shape == (len(PROMPTS), VOCAB) and logits.dtype == torch.float32
    diffs = [max_abs_diff(logits[i], hf_logits(path, p)[-1]) for i, p in enumerate(PROMPTS)]
    assert max(diffs) <= ATOL, f"{spec}: per-prompt max abs diffs {diffs}"

    run_to_completion(scheduler)  # the same prefill again, then sampling; frees everything
    for req, row in zip(reqs, logits):
        assert req.output_ids == [int(row.argmax())]
    assert_all_free(engine, scheduler)


@pytest.mark.parametrize(("page_size", "max_prefill_tokens"), [(16, 4096), (1, 48), (16, 48)],
                         ids=["page16", "page1-chunked48", "page16-chunked48"])
def test_every_step_logits_match_hf(tiny: Tiny, attention_backend: str, page_size: int,
                                    max_prefill_tokens: int) -> None:
    """Logits of every sampled row of every step (prefill, last prefill chunk, decode) equal
    HF's logits for the full sequence so far."""
    spec, path = tiny
    engine = make_engine(path, attention_backend, page_size=page_size,
                         max_prefill_tokens=max_prefill_tokens)
    scheduler = Scheduler(engine)
    prompts = PROMPTS[2:7]  # 17, 40, 65, 90, 150 tokens
    max_tokens = [6, 3, 8, 5, 7]
    reqs = submit(scheduler, prompts, [greedy(n) for n in max_tokens])
    with record_logits(engine) as records:
        run_to_completion(scheduler)
    assert len(records) == sum(max_tokens)
    num_decode_rows = sum(seq not in prompts for seq, _ in records)
    assert num_decode_rows == sum(max_tokens) - len(prompts)
    worst = 0.0
    for seq, row in records:
        d = max_abs_diff(row, hf_logits(path, seq)[-1])
        assert d <= ATOL, f"{spec}: logits after {len(seq)} tokens differ by {d}"
        worst = max(worst, d)
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert req.output_ids == hf_greedy(path, p, GREEDY_TOKENS)[:n]
        assert req.finish_reason == "length"
    assert_all_free(engine, scheduler)


@pytest.mark.parametrize(("page_size", "max_prefill_tokens"),
                         [(16, 4096), (1, 4096), (16, 40), (1, 40)],
                         ids=["page16", "page1", "page16-chunked40", "page1-chunked40"])
def test_greedy_32_tokens_match_hf_generate(tiny: Tiny, attention_backend: str, page_size: int,
                                            max_prefill_tokens: int) -> None:
    """8 prompts in one generate() call == HF generate(do_sample=False) per prompt, alone."""
    spec, path = tiny
    llm = LLM(model=str(path), dtype="float32", device=DEVICE, attention_backend=attention_backend,
              page_size=page_size, num_pages=4096 // page_size + 1,
              max_prefill_tokens=max_prefill_tokens)
    outs = llm.generate(PROMPTS, greedy(GREEDY_TOKENS))
    for p, out in zip(PROMPTS, outs):
        want = hf_greedy(path, p, GREEDY_TOKENS)
        assert out.token_ids == want, f"{spec}: {explain_mismatch(path, p, out.token_ids, want)}"
        assert out.finish_reason == "length" and out.prompt_token_ids == p
    assert_all_free(llm.engine, llm.scheduler)


@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_joining_while_others_decode(tiny: Tiny, attention_backend: str,
                                              page_size: int) -> None:
    """Batch composition changes every few steps (arrivals mid-decode, chunked prefills between
    decode steps, requests finishing at different lengths, a full running set making later
    arrivals wait); no request's greedy tokens change."""
    spec, path = tiny
    engine = make_engine(path, attention_backend, page_size=page_size, max_prefill_tokens=64,
                         max_running_requests=6)
    scheduler = Scheduler(engine)
    first_prompts = [PROMPTS[i] for i in (1, 2, 4, 3)]  # 3, 17, 65, 40 tokens
    later_prompts = [PROMPTS[i] for i in (6, 0, 5, 7)]  # 150, 1, 90, 7 tokens
    first = submit(scheduler, first_prompts, [greedy(n) for n in (32, 12, 20, 32)])
    for _ in range(6):
        scheduler.step()
    decoding = [r for r in first if r.output_ids]
    assert len(decoding) >= 2 and not any(r.finished for r in first)
    later = submit(scheduler, later_prompts, [greedy(n) for n in (32, 8, 24, 32)])
    run_to_completion(scheduler)
    for req in first + later:
        want = hf_greedy(path, req.prompt_ids, GREEDY_TOKENS)[: req.params.max_tokens]
        assert req.output_ids == want, (
            f"{spec}: {explain_mismatch(path, req.prompt_ids, req.output_ids, want)}")
        assert req.finished and req.finish_reason == "length"
    assert_all_free(engine, scheduler)
