"""Weight-only int8 (``quantization="int8"``) against independent references.

* the row quantizer against a float64 round trip (error at most half a step per element);
* both matmul paths (int8 kernel for few rows, dequantize + GEMM for many) against float64;
* a whole tiny model: the int8 engine's logits equal HF transformers' run on the *dequantized*
  weights (the same numbers int8 stands for), tied and untied heads;
* SmolLM2: perplexity on this project's own docs within 2% of unquantized (the accuracy target of
  the CPU-performance issue), and the answer to a fixed question still correct.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from minisgl.core import LLM, SamplingParams
from minisgl.core.layers.quant import INT8_MM_MAX_ROWS, int8_linear, quantize_rows

from .conftest import VOCAB, docs_perplexity_and_answer
from .reference import hf_model, make_prompts


def test_quantize_rows_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of all scales
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    nonzero = torch.arange(64) != 3
    assert bool((q.abs().amax(dim=1)[nonzero] == 127).all())
    err = (q.double() * s.double()[:, None] - w.double()).abs()
    assert bool((err <= s.double()[:, None] / 2 + 1e-12).all())


@pytest.mark.parametrize("rows", [1, 5, INT8_MM_MAX_ROWS, INT8_MM_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_float64(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 80, generator=g) / 9
    q, s = quantize_rows(w)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    want = x.double() @ (q.double() * s.double()[:, None]).T
    got = int8_linear(x, q, s)
    assert got.dtype == dtype and got.shape == (rows, 48)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _dequantized_hf(path: Path) -> torch.nn.Module:
    """HF's model with every linear weight (LM head included, untied) replaced by q * scale."""
    model = copy.deepcopy(hf_model(path))  # hf_model is cached: never modify it in place
    with torch.no_grad():
        if model.config.tie_word_embeddings:  # the engine quantizes the head, not the embedding
            model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                q, s = quantize_rows(mod.weight)
                mod.weight.copy_(q.float() * s[:, None])
    return model


@pytest.mark.parametrize("name", ["llama-gqa-untied-llama3", "llama-tied-mqa-bias", "qwen3-tied"])
def test_int8_engine_equals_hf_on_dequantized_weights(name: str, tiny_dirs: dict[str, Path]) -> None:
    path = tiny_dirs[name]
    ref = _dequantized_hf(path)
    prompts = make_prompts([3, 17, 40], VOCAB, seed=4)
    with LLM(str(path), dtype="float32", quantization="int8") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                    top_logprobs=5))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(ref(ids).logits[0, len(prompt) - 1:].double(), dim=-1)
        assert out.token_ids == logp.argmax(dim=-1).tolist()  # greedy under the reference
        for step, top in enumerate(out.top_logprobs):
            for tok, lp in top:
                assert abs(lp - float(logp[step, tok])) < 1e-4, (name, step, tok)


@pytest.mark.slow
def test_smollm2_int8_perplexity_within_2_percent(
        smollm2_path: str, bf16_docs_baseline: tuple[float, str]) -> None:
    ppl, answer = docs_perplexity_and_answer(smollm2_path, quantization="int8")
    print(f"perplexity bf16 {bf16_docs_baseline[0]:.3f} int8 {ppl:.3f}; "
          f"answers {bf16_docs_baseline[1]!r} / {answer!r}")
    assert ppl <= bf16_docs_baseline[0] * 1.02
    assert "Paris" in answer
