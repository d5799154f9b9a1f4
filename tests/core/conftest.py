from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def save_tiny_llama(path: Path, eos: list[int] | int = 2, seed: int = 0) -> Path:
    """A 2-layer random Llama (GQA) saved as an HF safetensors directory."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=eos if isinstance(eos, int) else eos[0], bos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(path)
    GenerationConfig(eos_token_id=eos, bos_token_id=1).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """n greedy tokens by full recomputation (no HF cache, no EOS stop): the reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def write_eos(path: Path, eos: list[int]) -> None:
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (path / "generation_config.json").write_text(json.dumps(gen))
