"""Sampling defaults: the request, then the model's generation_config.json, then OpenAI's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from minisgl.core.config import ModelConfig
from minisgl.server.protocol import ModelInfo, parse_chat, parse_completion

CHAT = [{"role": "user", "content": "hi"}]


def test_generation_config_values_become_defaults(smollm2_path: str, tmp_path: Path) -> None:
    shutil.copy(Path(smollm2_path) / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": 2, "temperature": 0.3, "top_p": 0.8, "min_p": 0.05, "top_k": None,
        "repetition_penalty": 1.1, "do_sample": False, "max_new_tokens": 99}))
    defaults = ModelConfig.from_pretrained(tmp_path).generation_defaults
    assert defaults == {"temperature": 0.3, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.1}


def test_request_then_generation_config_then_openai() -> None:
    info = ModelInfo("m", 512, {"temperature": 0.3, "top_k": 20})
    p = parse_chat({"messages": CHAT}, info).params
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.3, 20, 1.0, 0.0)  # top_p: OpenAI's
    p = parse_chat({"messages": CHAT, "temperature": 0.9, "top_k": 5}, info).params
    assert (p.temperature, p.top_k) == (0.9, 5)
    p = parse_chat({"messages": CHAT, "temperature": 0}, info).params
    assert p.temperature == 0.0  # an explicit 0 is a value, not "unset"
    plain = ModelInfo("m", 512)
    assert parse_chat({"messages": CHAT}, plain).params.temperature == 1.0
    assert parse_chat({"messages": CHAT}, plain).params.max_tokens is None  # rest of the context
    assert parse_completion({"prompt": "x"}, plain).params.max_tokens == 16  # OpenAI's default
