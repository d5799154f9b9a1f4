"""Sliding attention windows (Mistral v0.1, Qwen2 with ``use_sliding_window``): which configs have
one and on which layers, and the engine against HF, which applies the window: past the window
with a backend that supports windows (the torch backend, kernel and PyTorch paths), capped at the
window with one that does not. The qwen2-window checkpoint of conftest.SPECS (window 24 on two
of its three layers) also runs the whole HF reference matrix (test_hf_reference.py, test_tp.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.backends.torch_native import TorchNativeBackend
from minisgl.core import LLM
from minisgl.core.config import ModelConfig
from minisgl.core.scheduler import Scheduler

from .conftest import SPEC_BY_NAME, save_tiny
from .reference import (
    assert_all_free,
    greedy,
    hf_greedy,
    hf_logits,
    make_engine,
    make_prompts,
    record_logits,
    run_to_completion,
    submit,
)

WINDOW = 48


def _config(tmp_path: Path, **extra: Any) -> ModelConfig:
    cfg = {"architectures": ["X"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 4, "num_attention_heads": 2, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("extra", "windows"), [
    ({}, [0] * 4),
    ({"sliding_window": None}, [0] * 4),  # Mistral v0.2 / v0.3
    ({"sliding_window": 4096}, [4096] * 4),  # Mistral v0.1: every layer
    # Qwen2.5's config.json: a window that is off
    ({"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 2}, [0] * 4),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, [0, 0, 64, 64]),
    # on, but only from layer 4 on, and there are 4 layers
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 4}, [0] * 4),
    # transformers >= 4.53 writes each layer's kind
    ({"sliding_window": 64, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
     [0, 0, 0, 64]),
    ({"sliding_window": 64, "layer_types": ["full_attention"] * 4}, [0] * 4),
], ids=["none", "null", "mistral", "qwen2.5-off", "qwen2-on", "qwen2-no-layer", "types-on",
        "types-off"])
def test_which_layers_have_a_window(tmp_path: Path, extra: dict[str, Any],
                                    windows: list[int]) -> None:
    mc = _config(tmp_path, **extra)
    assert mc.layer_windows() == windows
    assert mc.sliding_window == (max(windows) or None)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral whose window (48) is shorter than its 512 positions, on every layer;
    head_dim 32, a shape the CPU attention kernel takes (bf16)."""
    return save_tiny(SPEC_BY_NAME["mistral-untied"], tmp_path_factory.mktemp("mistral-window"),
                     sliding_window=WINDOW, head_dim=32)


@functools.cache
def _full_attention(path: Path) -> Any:
    """The checkpoint in HF (float32, eager) with its window off: full attention everywhere."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((path / "config.json").read_text())
    off: dict[str, Any] = {"sliding_window": None}  # Mistral
    if "use_sliding_window" in cfg:  # Qwen2
        off["use_sliding_window"] = False
    if "layer_types" in cfg:
        off["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **off).eval()


@torch.no_grad()
def _full_attention_logits(path: Path, seq: list[int]) -> torch.Tensor:
    """The last row of HF's logits for seq with full attention (see _full_attention)."""
    return _full_attention(path)(torch.tensor([seq])).logits[0, -1].float()


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_hf_applies_the_window(windowed: Path, tiny_dirs: dict[str, Path], name: str) -> None:
    """HF's windowed logits equal full attention's up to the window and differ past it: the
    references below check windows, not just attention."""
    path, window = (windowed, WINDOW) if name == "mistral" else (tiny_dirs["qwen2-window"], 24)
    seq = make_prompts([window + 20], 256, seed=7)[0]

    def diff(n: int) -> float:
        ref = _full_attention_logits(path, seq[:n])
        return float((hf_logits(path, seq[:n])[-1] - ref).abs().max())

    assert diff(window) < 1e-4
    assert diff(window + 20) > 1e-2


@pytest.mark.parametrize(("page_size", "max_prefill_tokens"), [(16, 4096), (1, 20), (16, 40)],
                         ids=["page16", "page1-chunked20", "page16-chunked40"])
def test_every_step_past_the_window_matches_hf(windowed: Path, attention_backend: str,
                                               page_size: int, max_prefill_tokens: int) -> None:
    """Every layer windowed (Mistral v0.1's layout): each sampled row's logits equal HF's for
    the sequence so far, prompts shorter than, as long as and 3x the window, prefill chunks
    shorter than the window, decode running past it."""
    engine = make_engine(windowed, attention_backend, page_size=page_size,
                         max_prefill_tokens=max_prefill_tokens)
    assert engine.max_model_len == 512  # not capped
    assert engine.backend.windows == [WINDOW] * 2
    scheduler = Scheduler(engine)
    prompts = make_prompts([5, WINDOW, 3 * WINDOW], 256, seed=3)
    reqs = submit(scheduler, prompts, greedy(60))
    with record_logits(engine) as records:
        run_to_completion(scheduler)
    assert len(records) == 180
    for seq, row in records:
        d = float((row - hf_logits(windowed, seq)[-1]).abs().max())
        assert d <= 1e-4, f"logits after {len(seq)} tokens differ by {d}"
    for req, p in zip(reqs, prompts):
        assert req.output_ids == hf_greedy(windowed, p, 60)
    assert_all_free(engine, scheduler)


@pytest.mark.parametrize("compile_mode", ["off", "wait"])
def test_bf16_kernel_past_the_window(windowed: Path, compile_mode: str) -> None:
    """The CPU attention kernel's window (bf16 pool), eager and in compiled graphs: every
    sampled row's logits within bf16 noise of HF's windowed float32 logits for the same sequence
    (measured 0.03-0.11), and past the window far from what full attention gives (0.5-4.9)."""
    engine = make_engine(windowed, "torch", dtype="bfloat16", compile=compile_mode)
    backend = engine.backend
    assert isinstance(backend, TorchNativeBackend)
    if not backend.uses_cpu_kernel:
        pytest.skip("no CPU attention kernel on this machine")
    scheduler = Scheduler(engine)
    submit(scheduler, make_prompts([5, WINDOW, 3 * WINDOW], 256, seed=3), greedy(40))
    with record_logits(engine) as records:
        run_to_completion(scheduler)
    assert len(records) == 120
    if compile_mode == "wait":  # the windowed graphs compiled and ran the steps
        graphs = engine.graphs
        assert graphs is not None
        assert graphs.steps[("decode", 2, 32)] > 30 and graphs.steps[("prefill", 2, 64)] == 1, (
            graphs.describe())
    for seq, row in records:
        err = float((row - hf_logits(windowed, seq)[-1]).abs().max())
        assert err <= 0.15, f"logits after {len(seq)} tokens differ by {err}"
        if len(seq) > WINDOW + 8:
            assert float((row - _full_attention_logits(windowed, seq)).abs().max()) > 0.3
    assert_all_free(engine, scheduler)


def test_backend_without_windows_caps_the_context(windowed: Path, caplog: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend without sliding windows: contexts stop at the window, where windowed and full
    attention agree (exact against HF), with a warning at load and a clear error past it."""
    monkeypatch.setattr(TorchNativeBackend, "supports_sliding_window", False)
    with caplog.at_level("WARNING", logger="minisgl.engine"):
        llm = LLM(model=str(windowed), dtype="float32", num_pages=64, max_model_len=4096)
    assert llm.engine.max_model_len == WINDOW
    assert llm.engine.backend.windows == [0, 0]
    assert "sliding window of 48 tokens" in caplog.text
    prompts = make_prompts([5, 30, WINDOW - 1], 256, seed=3)
    outs = llm.generate(prompts, greedy(40))
    for p, out in zip(prompts, outs):
        n = min(40, WINDOW - len(p))  # the two longer prompts stop at the window
        assert out.token_ids == hf_greedy(windowed, p, n)
        assert out.finish_reason == "length"
    with pytest.raises(ValueError, match="context length of 48 tokens"):
        llm.generate([make_prompts([WINDOW], 256, seed=4)[0]], greedy(1))
