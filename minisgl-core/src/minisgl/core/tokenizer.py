"""A checkpoint's tokenizer (HF transformers), for the offline LLM and the server's tokenizer and
detokenizer processes.

Torch-free: those two processes only turn text into ids and back, and call ``hide_torch`` first.
transformers imports torch whenever it is installed (and with it torch.distributed, sympy,
accelerate: ~180 MB of anonymous memory and ~2 s per process on 2 cores, measured); with torch
hidden the same ``AutoTokenizer`` loads in ~90 MB and gives the same ids.

``AutoTokenizer`` picks the class from tokenizer_config.json *and* the model's config class, which
it imports to do so: transformers' modelling modules, ~1 s in a process with torch (the offline
LLM) and ~0.4 s in the torch-free ones, measured. A checkpoint that declares the generic
tokenizers-library class, ships no custom code and has a model type that transformers maps to that
same class gets it directly (``load_tokenizer``; tests/server/test_tokenizer_procs.py checks the
mapping against ``AutoTokenizer`` for each type listed).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from minisgl.core.gc_pause import paused

Message = dict[str, Any]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # one class in transformers 5
# model types whose generic declaration AutoTokenizer keeps (it overrides it for e.g. qwen2)
GENERIC_MODEL_TYPES = ("llama", "mistral", "qwen3")


def hide_torch() -> bool:
    """For a process that only tokenizes, before transformers is imported: make torch look
    absent (``sys.modules["torch"] = None``, which ``import`` and ``find_spec`` both honour).
    False (nothing done) where torch is loaded already."""
    if "torch" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"
    return True


def load_tokenizer(path: str) -> Any:
    """The checkpoint's HF tokenizer, or None when it has none (tiny test models): such models
    still take token-id prompts."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    with paused():  # transformers' modules (gc_pause)
        if _declares_generic(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def _declares_generic(path: str) -> bool:
    """Whether ``AutoTokenizer`` would load the generic fast class for this checkpoint (above)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(declared, dict) and isinstance(config, dict)
            and declared.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in declared
            and config.get("model_type") in GENERIC_MODEL_TYPES
            and os.path.exists(os.path.join(path, "tokenizer.json")))


def chat_token_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The chat template applied to one conversation, with the generation prompt, as ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
