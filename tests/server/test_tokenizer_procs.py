"""Only the engine's processes load torch: the launcher (the API), the tokenizer and the
detokenizer run without it (minisgl.core.tokenizer, config, child), with the same ids and text as
the offline engine's tokenizer, at a fraction of the memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Server

TEXTS = ["The capital of France is", "  leading spaces\tand tabs\n\nnew lines",
         "émojis 🦙 and 漢字", "<|im_start|>user\nspecial tokens in text<|im_end|>", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🦙"}],
]
IDS = [[1, 9690, 198, 2683, 2, 198, 28, 216], [0, 17, 49151, 5, 2]]

# Loads the tokenizer as the tokenizer processes do (torch hidden first) and prints what it makes
# of the inputs, as JSON, with whether torch got loaded.
PROBE = """
import json, sys
from minisgl.core.tokenizer import chat_token_ids, hide_torch, load_tokenizer
assert hide_torch()
tok = load_tokenizer(sys.argv[1])
inp = json.loads(sys.argv[2])
print(json.dumps({
    "torch": sys.modules.get("torch") is not None,
    "model modules": sorted(m for m in sys.modules if m.startswith("transformers.models.")),
    "encode": [tok.encode(t) for t in inp["texts"]],
    "chat": [chat_token_ids(tok, c) for c in inp["conversations"]],
    "decode": [[tok.decode(i, skip_special_tokens=s) for s in (True, False)] for i in inp["ids"]],
    "special": sorted(tok.all_special_ids),
}))
"""


def describe(tok: Any) -> dict[str, Any]:
    from minisgl.core.tokenizer import chat_token_ids

    return {"torch": True,
            "encode": [tok.encode(t) for t in TEXTS],
            "chat": [chat_token_ids(tok, c) for c in CONVERSATIONS],
            "decode": [[tok.decode(i, skip_special_tokens=s) for s in (True, False)] for i in IDS],
            "special": sorted(tok.all_special_ids)}


def test_tokenizer_without_torch_matches_the_offline_one(smollm2_path: str) -> None:
    """Reference: transformers' AutoTokenizer in a process with torch (the offline LLM's)."""
    from transformers import AutoTokenizer

    want = describe(AutoTokenizer.from_pretrained(smollm2_path))
    inputs = json.dumps({"texts": TEXTS, "conversations": CONVERSATIONS, "ids": IDS})
    out = subprocess.run([sys.executable, "-c", PROBE, smollm2_path, inputs], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got.pop("torch") is False, "torch was loaded"
    # the generic class loaded directly: AutoConfig's model modules never imported
    assert got.pop("model modules") == []
    want.pop("torch")
    assert got == want
    assert "PyTorch was not found" not in out.stderr


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "qwen2"])
def test_generic_tokenizer_is_autotokenizers_choice(smollm2_path: str, tmp_path: Path,
                                                    model_type: str) -> None:
    """load_tokenizer skips AutoTokenizer's class lookup for the model types it lists
    (GENERIC_MODEL_TYPES); for each, and for one it does not list (qwen2, where AutoTokenizer
    overrides the checkpoint's generic declaration), the class and behaviour are AutoTokenizer's."""
    from transformers import AutoTokenizer

    from minisgl.core.tokenizer import GENERIC_MODEL_TYPES, _declares_generic, load_tokenizer

    for f in Path(smollm2_path).iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "config.json":
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((Path(smollm2_path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type=model_type)))
    assert _declares_generic(str(tmp_path)) == (model_type in GENERIC_MODEL_TYPES)
    want = AutoTokenizer.from_pretrained(str(tmp_path))
    got = load_tokenizer(str(tmp_path))
    assert type(got) is type(want)
    assert describe(got) == describe(want)
    assert got.eos_token_id == want.eos_token_id and got.pad_token_id == want.pad_token_id


def test_hide_torch_leaves_a_loaded_torch_alone() -> None:
    import torch  # noqa: F401  (loaded in this process)

    from minisgl.core.tokenizer import hide_torch

    assert hide_torch() is False
    assert sys.modules["torch"] is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_server_helpers_run_without_torch(server: Server) -> None:
    """In a running server, only the scheduler maps libtorch; the launcher, tokenizer and
    detokenizer hold < 150 MB of anonymous memory each (153, 267, 267 MB with torch loaded)."""
    pids = httpx.get(server.url + "/stats", timeout=10).json()["pids"]
    pids["launcher"] = server.proc.pid

    def libtorch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    def anon_mb(pid: int) -> float:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024

    assert libtorch(pids["scheduler"])
    for name in ("launcher", "tokenizer", "detokenizer"):
        assert not libtorch(pids[name]), name
        assert anon_mb(pids[name]) < 150, (name, anon_mb(pids[name]))
