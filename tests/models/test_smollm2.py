"""The bundled SmolLM2-135M-Instruct (30 layers) against HF transformers, and its France answer.

Measured float32 logits, engine vs HF (eager attention), for the four prompts below (5 to 48
tokens) run as one batch: max abs diff 4.2e-5 at the first step and up to 5.7e-5 over the next
five decode steps, with logits spanning about -30..+36 (so ~1e-6 relative). That is 10x the
tiny models' number because the float32 rounding of 30 layers accumulates; the bound of 2e-4
leaves ~3.5x headroom for other BLAS blockings and thread counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from minisgl.core import LLM, SamplingParams

from .reference import (
    assert_all_free,
    greedy,
    hf_greedy,
    hf_logits,
    record_logits,
    run_to_completion,
    submit,
)

pytestmark = pytest.mark.slow

ATOL = 2e-4
# "Tell me", not "What is": the latter's first token is a near-tie ("The" 25.325 / "L" 25.243
# in HF float32, one bf16 step apart) that kernels with other summation orders (AMX tiles,
# compiled prefills) break the other way, into "L'Etoile..."; this one leads by 0.73
FRANCE = [{"role": "user", "content": "Tell me the capital of France."}]
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he opened his shop, wound "
    "every clock on the wall, and waited for",
]


def chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@pytest.fixture(scope="module")
def llm_fp32(smollm2_path: str, attention_backend: str) -> Iterator[LLM]:
    llm = LLM(model="smollm2", dtype="float32", attention_backend=attention_backend,
              num_pages=64)
    assert llm.engine.dtype == torch.float32
    yield llm
    del llm


def test_first_step_logits_match_hf(llm_fp32: LLM, smollm2_path: str) -> None:
    engine, scheduler = llm_fp32.engine, llm_fp32.scheduler
    prompts = [llm_fp32.tokenizer.encode(t) for t in TEXTS] + [chat_ids(llm_fp32, FRANCE)]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    reqs = submit(scheduler, prompts, greedy(1))
    batch = scheduler.next_batch()
    assert batch is not None and batch.reqs == reqs and all(batch.sample)
    logits = engine.forward(engine.prepare(batch))
    diffs = [float((logits[i] - hf_logits(smollm2_path, p)[-1]).abs().max())
             for i, p in enumerate(prompts)]
    assert max(diffs) <= ATOL, f"per-prompt max abs diffs {diffs}"
    run_to_completion(scheduler)
    assert [r.output_ids for r in reqs] == [[int(row.argmax())] for row in logits]
    assert_all_free(engine, scheduler)


def test_decode_step_logits_match_hf(llm_fp32: LLM, smollm2_path: str) -> None:
    """Every step of 6 greedy tokens for the three text prompts together, vs HF on the sequence."""
    engine, scheduler = llm_fp32.engine, llm_fp32.scheduler
    prompts = [llm_fp32.tokenizer.encode(t) for t in TEXTS]
    submit(scheduler, prompts, greedy(6))
    with record_logits(engine) as records:
        run_to_completion(scheduler)
    assert len(records) == 6 * len(prompts)
    diffs = [float((row - hf_logits(smollm2_path, seq)[-1]).abs().max()) for seq, row in records]
    assert max(diffs) <= ATOL, f"max abs diff {max(diffs)} after {len(records[0][0])}.. tokens"
    assert_all_free(engine, scheduler)


def test_chat_answer_float32_is_paris_and_matches_hf(llm_fp32: LLM, smollm2_path: str) -> None:
    out = llm_fp32.chat([FRANCE], SamplingParams(max_tokens=20, temperature=0))[0]
    assert "Paris" in out.text, out.text
    # token for token what HF's greedy generate says, up to the end-of-turn token (if reached)
    want = hf_greedy(smollm2_path, chat_ids(llm_fp32, FRANCE), 20)
    assert out.token_ids == want[: len(out.token_ids)]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in llm_fp32.engine.model_config.eos_token_ids
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 20
    assert_all_free(llm_fp32.engine, llm_fp32.scheduler)


def test_chat_answer_default_dtype_bf16_is_paris(smollm2_path: str, attention_backend: str) -> None:
    # Eager steps (compile="off"). FRANCE's answer leads by 0.73 at its first token (see there):
    # the bf16 kernels' summation orders (vectors or AMX tiles) do not flip it. Compiled logits
    # are held to float32 references in test_compile.py.
    llm = LLM(model="smollm2", attention_backend=attention_backend, num_pages=64, compile="off")
    assert llm.engine.dtype == torch.bfloat16  # "auto" on CPU
    out = llm.chat([FRANCE], SamplingParams(max_tokens=20, temperature=0))[0]
    assert "Paris" in out.text, out.text
    assert_all_free(llm.engine, llm.scheduler)
