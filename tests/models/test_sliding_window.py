"""Sliding attention windows (Mistral v0.1, Qwen2 with ``use_sliding_window``): which configs have
one, and the engine's answer to it: contexts capped at the window, where windowed attention and
the full attention minisgl computes are the same (checked against HF, which applies the window).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import LLM
from minisgl.core.config import ModelConfig

from .conftest import SPEC_BY_NAME, save_tiny
from .reference import greedy, hf_greedy, hf_logits, make_prompts, torch_threads

WINDOW = 48


def _config(tmp_path: Path, **extra: Any) -> ModelConfig:
    cfg = {"architectures": ["X"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 4, "num_attention_heads": 2, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("extra", "window"), [
    ({}, None),
    ({"sliding_window": None}, None),  # Mistral v0.2 / v0.3
    ({"sliding_window": 4096}, 4096),  # Mistral v0.1: every layer
    # Qwen2.5's config.json: a window that is off
    ({"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 2}, None),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, 64),
    # on, but only from layer 4 on, and there are 4 layers
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 4}, None),
    # transformers >= 4.53 writes each layer's kind
    ({"sliding_window": 64, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, 64),
    ({"sliding_window": 64, "layer_types": ["full_attention"] * 4}, None),
], ids=["none", "null", "mistral", "qwen2.5-off", "qwen2-on", "qwen2-no-layer", "types-on",
        "types-off"])
def test_which_configs_have_a_window(tmp_path: Path, extra: dict[str, Any],
                                     window: int | None) -> None:
    assert _config(tmp_path, **extra).sliding_window == window


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral whose window (48) is shorter than its 512 positions."""
    return save_tiny(SPEC_BY_NAME["mistral-untied"], tmp_path_factory.mktemp("mistral-window"),
                     sliding_window=WINDOW)


def test_the_window_matters_past_it(windowed: Path) -> None:
    """HF's windowed logits equal full attention's up to the window and differ past it: the
    cap is what keeps minisgl's full attention exact."""
    from transformers import MistralForCausalLM

    seq = make_prompts([WINDOW + 20], 256, seed=7)[0]
    with torch_threads(1), torch.no_grad():
        full = MistralForCausalLM.from_pretrained(windowed, sliding_window=None).eval()

        def diff(n: int) -> float:
            ref = full(torch.tensor([seq[:n]])).logits[0, -1].float()
            return float((hf_logits(windowed, seq[:n])[-1] - ref).abs().max())

        assert diff(WINDOW) < 1e-4
        assert diff(WINDOW + 20) > 1e-2


def test_context_capped_at_the_window_matches_hf(windowed: Path, caplog: Any) -> None:
    with torch_threads(1), caplog.at_level("WARNING", logger="minisgl.engine"):
        llm = LLM(model=str(windowed), dtype="float32", num_pages=64, max_model_len=4096)
    assert llm.engine.max_model_len == WINDOW
    assert "sliding window of 48 tokens" in caplog.text
    prompts = make_prompts([5, 30, WINDOW - 1], 256, seed=3)
    outs = llm.generate(prompts, greedy(40))
    for p, out in zip(prompts, outs):
        n = min(40, WINDOW - len(p))  # the two longer prompts stop at the window
        assert out.token_ids == hf_greedy(windowed, p, n)
        assert out.finish_reason == "length"
    with pytest.raises(ValueError, match="context length of 48 tokens"):
        llm.generate([make_prompts([WINDOW], 256, seed=4)[0]], greedy(1))
