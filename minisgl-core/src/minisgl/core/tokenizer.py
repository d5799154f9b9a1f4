"""A checkpoint's tokenizer (HF transformers), for the offline LLM and the server's tokenizer and
detokenizer processes.

Torch-free: those two processes only turn text into ids and back, and call ``hide_torch`` first.
transformers imports torch whenever it is installed (and with it torch.distributed, sympy,
accelerate: ~180 MB of anonymous memory and ~2 s per process on 2 cores, measured); with torch
hidden the same ``AutoTokenizer`` loads in ~90 MB and gives the same ids.
"""

from __future__ import annotations

import os
import sys
from typing import Any

Message = dict[str, Any]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_token_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The chat template applied to one conversation, with the generation prompt, as ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
