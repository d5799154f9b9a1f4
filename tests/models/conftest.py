"""Tiny random HF checkpoints (session-scoped), one per architecture detail under test.

Weights are re-drawn after HF's init (which uses std 0.02 and all-ones norms): with such weights
attention is nearly uniform and logits nearly flat, so rope, qk-norm or GQA mistakes would hide
under the tolerance and greedy picks would sit on near ties. Here linear weights have std
1/sqrt(fan_in) (unit-scale activations, attention scores of order 1), every norm weight
1 + 0.3 * N(0, 1) and biases 0.3 * N(0, 1), so each of those parts visibly moves the logits.
Embeddings get std 0.1: with a tied head, a larger embedding makes the current token's own logit
dominate and greedy decoding just repeats it. With these draws the smallest top-1 / top-2 logit
gap over all 32-token greedy references is 4.6e-4 (seeds chosen for that), against
engine-vs-HF logit differences of at most 6e-6: the greedy comparisons are not decided by float
rounding (test_greedy_references_have_no_near_ties keeps it so).

Tiny-model tests run torch single-threaded (autouse fixture below): their ops take microseconds,
and on a busy 2-core machine OpenMP's thread hand-off made them 100x slower.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from .reference import torch_threads

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small, so the test prompts (up to 150 tokens) run well past it
               "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class TinySpec:
    name: str
    arch: str  # "llama" | "qwen2" | "qwen3" | "mistral"
    tied: bool
    seed: int
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # None: hidden // heads
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default",
                                                          "rope_theta": 10000.0})
    attention_bias: bool = False
    max_shard_size: str | None = None  # set: sharded checkpoint with an index.json
    hf: dict[str, Any] = field(default_factory=dict)  # fields of its HF config set after the rest

    def __str__(self) -> str:
        return self.name


VOCAB = 256
MAX_POS = 512

SPECS = [
    # GQA 4/2, untied head, llama3 rope scaling (all three frequency bands are hit with
    # head_dim 16: wavelengths 6.3 < 64/4, 19.9 and 62.8 in between, the rest > 64)
    TinySpec("llama-gqa-untied-llama3", "llama", tied=False, seed=1, layers=3, rope=LLAMA3_ROPE),
    # tied embeddings, MQA (one KV head), q/k/v/o biases, rope theta 1e5 like SmolLM2
    TinySpec("llama-tied-mqa-bias", "llama", tied=True, seed=2, kv_heads=1, attention_bias=True,
             rope={"rope_type": "default", "rope_theta": 100000.0}),
    # qk-norm, head_dim (32) explicitly different from hidden / heads (16)
    TinySpec("qwen3-tied", "qwen3", tied=True, seed=3, head_dim=32),
    TinySpec("qwen3-untied", "qwen3", tied=False, seed=8, layers=3, hidden=48, heads=6,
             kv_heads=2, head_dim=16),
    # biases on q/k/v but not on o_proj, tied like Qwen2.5-0.5B, rope theta 1e6 like Qwen2.5
    TinySpec("qwen2-tied", "qwen2", tied=True, seed=9, heads=4, kv_heads=2,
             rope={"rope_type": "default", "rope_theta": 1000000.0}),
    # Mistral's config (its sliding window, 4096 by default, is past every test context)
    TinySpec("mistral-untied", "mistral", tied=False, seed=10),
    # Qwen2 with its sliding window on (24 keys, most prompts are longer) from layer 1 of 3:
    # full and windowed layers in one model
    TinySpec("qwen2-window", "qwen2", tied=False, seed=11, layers=3, hf={
        "sliding_window": 24, "use_sliding_window": True, "max_window_layers": 1,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}),
    # the first spec's architecture again, saved in many shards (model.safetensors.index.json)
    TinySpec("llama-llama3-sharded", "llama", tied=False, seed=5, layers=2, rope=LLAMA3_ROPE,
             max_shard_size="40KB"),
]
SPEC_BY_NAME = {s.name: s for s in SPECS}


# TinySpec.arch -> the prefix of its transformers classes (LlamaConfig, LlamaForCausalLM, ...)
HF_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def _hf_class(spec: TinySpec, suffix: str) -> Any:
    import transformers

    return getattr(transformers, HF_PREFIX[spec.arch] + suffix)


def _hf_config(spec: TinySpec) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=MAX_POS,
        tie_word_embeddings=spec.tied, rope_parameters=dict(spec.rope), rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=spec.attention_bias,
    )
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.arch in ("qwen2", "mistral"):
        del common["attention_bias"]  # fixed by the architecture
    return _hf_class(spec, "Config")(**common)


@torch.no_grad()
def _redraw_weights(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:  # [out, in] linear weights (lm_head included when untied)
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def save_tiny(spec: TinySpec, path: Path, **config: Any) -> Path:
    """The spec's checkpoint in ``path``; ``config`` overrides fields of its HF config."""
    with torch_threads(1):
        return _save_tiny(spec, path, config)


def _save_tiny(spec: TinySpec, path: Path, overrides: dict[str, Any]) -> Path:
    torch.manual_seed(spec.seed)
    hf_config = _hf_config(spec)
    for key, value in {**spec.hf, **overrides}.items():
        setattr(hf_config, key, value)
    model = _hf_class(spec, "ForCausalLM")(hf_config).eval()
    _redraw_weights(model, spec.seed)
    if spec.tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    kw = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(path, **kw)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is spec.tied
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """All tiny checkpoints, written once per session (well under a second each)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {s.name: save_tiny(s, root / s.name) for s in SPECS}


@pytest.fixture(params=SPECS, ids=str)
def tiny(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> tuple[TinySpec, Path]:
    """(spec, checkpoint dir), parametrized over every tiny architecture."""
    spec: TinySpec = request.param
    return spec, tiny_dirs[spec.name]


DOCS_TEXT_FILES = ("README.md", "docs/architecture.md")  # the fixed text perplexity is taken on
CAPITAL_QUESTION = [{"role": "user", "content": "Tell me the capital of France."}]


def docs_text() -> str:
    root = Path(__file__).resolve().parents[2]
    return "\n\n".join((root / f).read_text() for f in DOCS_TEXT_FILES)


def docs_perplexity_and_answer(path: str, **engine: Any) -> tuple[float, str]:
    """SmolLM2's perplexity on the docs (512-token windows) and its greedy answer to the capital
    question, on an engine built with ``engine``'s options."""
    from minisgl.core import LLM, SamplingParams

    with LLM(path, **engine) as llm:
        ppl = llm.perplexity(docs_text(), window=512)
        answer = llm.chat(CAPITAL_QUESTION, SamplingParams(max_tokens=16, temperature=0))[0].text
    return ppl, answer


@pytest.fixture(scope="session")
def bf16_docs_baseline(smollm2_path: str) -> tuple[float, str]:
    """The unquantized engine's (bf16 weights and KV pool) docs_perplexity_and_answer, once per
    session: the int8 weight and int8 KV tests compare against the same run."""
    return docs_perplexity_and_answer(smollm2_path)


@pytest.fixture(autouse=True)
def _single_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("slow") is not None:  # SmolLM2: real matmuls, keep threads
        yield
        return
    with torch_threads(1):
        yield
