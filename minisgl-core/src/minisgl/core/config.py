"""Frozen configs, validated once at start. Derived values are properties.

Torch-free at import (torch is imported where a dtype or device is resolved): the server's
launcher validates options with these and never loads torch.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

COMPILE_MODES = ("auto", "on", "off", "wait")  # EngineConfig.compile (minisgl.core.compile)


def default_mode() -> str:
    """``$MINISGL_COMPILE`` when set (the test matrix runs both ways), else ``auto``."""
    return os.environ.get("MINISGL_COMPILE", "auto")


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from an HF ``config.json`` (+ ``generation_config.json``)."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    hf_dtype: str | None
    # a sliding attention window (Mistral v0.1, Qwen2 with use_sliding_window): the layers in
    # sliding_layers attend to their last sliding_window keys only (layer_windows)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    hf: dict[str, Any] = field(default_factory=dict, repr=False)

    def layer_windows(self) -> list[int]:
        """Per layer, the keys it attends to back from each query: the window, or 0 for all."""
        return [self.sliding_window if self.sliding_window and i in self.sliding_layers else 0
                for i in range(self.num_layers)]

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        p = Path(path)
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{p} has no config.json: not an HF model directory")
        hf = _read_json(cfg_file)
        gen = _read_json(p / "generation_config.json") if (p / "generation_config.json").is_file() else {}
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_file} lists no 'architectures'; cannot pick a model class")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # transformers >= 5 keeps rope settings in "rope_parameters"; older files use
        # "rope_theta" + "rope_scaling".
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        eos: list[int] = []
        for src in (gen.get("eos_token_id"), hf.get("eos_token_id")):
            for t in src if isinstance(src, list) else ([src] if src is not None else []):
                if int(t) not in eos:
                    eos.append(int(t))
        # sampling defaults for requests that leave these fields out (the server's; vLLM's set)
        gen_defaults: dict[str, Any] = {k: gen[k] for k in GENERATION_DEFAULTS
                                        if gen.get(k) is not None}
        window, window_layers = _sliding_window(hf)
        return cls(
            path=str(p),
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            eos_token_ids=tuple(eos),
            hf_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            sliding_window=window,
            sliding_layers=window_layers,
            generation_defaults=gen_defaults,
            hf=hf,
        )


def _sliding_window(hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """The window of a config whose layers (any of them) attend to the last N tokens only, and
    those layers; (None, ()) without one."""
    window, layers = hf.get("sliding_window"), int(hf["num_hidden_layers"])
    if window is None:
        return None, ()
    if "layer_types" in hf:  # transformers >= 4.53 names each layer's kind
        which = tuple(i for i, t in enumerate(hf["layer_types"]) if t == "sliding_attention")
    elif "use_sliding_window" in hf:  # Qwen2: off unless asked for, then from max_window_layers on
        first = int(hf.get("max_window_layers", layers))
        which = tuple(range(first, layers)) if hf["use_sliding_window"] else ()
    else:  # Mistral: every layer
        which = tuple(range(layers))
    return (int(window), which) if which else (None, ())


def check_tp_split(mc: ModelConfig, tp: int) -> None:
    """Fail before any process starts when the model cannot be split ``tp`` ways."""
    if tp < 1:
        raise ValueError(f"tp: must be >= 1 (got {tp})")
    problems = []
    if mc.num_heads % tp:
        problems.append(f"num_attention_heads ({mc.num_heads}) is not divisible by tp ({tp})")
    kv = mc.num_kv_heads
    if kv >= tp and kv % tp:
        problems.append(f"num_key_value_heads ({kv}) is not divisible by tp ({tp})")
    if kv < tp and tp % kv:
        problems.append(f"tp ({tp}) is not a multiple of num_key_value_heads ({kv}), so KV "
                        "heads cannot be replicated evenly")
    if mc.intermediate_size % tp:
        problems.append(f"intermediate_size ({mc.intermediate_size}) is not divisible by tp ({tp})")
    if problems:
        raise ValueError(f"tp: {mc.path} cannot be split {tp} ways: " + "; ".join(problems))


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # name -> torch's name


def _is_torch_dtype(x: object) -> bool:
    torch_module = sys.modules.get("torch")  # a torch.dtype value means torch is loaded
    return torch_module is not None and isinstance(x, torch_module.dtype)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_dtype: str | None) -> torch.dtype:
    """``auto``: bf16 on CPU (float16 has no fast CPU kernels), the checkpoint's dtype on GPU."""
    import torch

    if isinstance(dtype, torch.dtype):
        out = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            return torch.bfloat16
        out = getattr(torch, _DTYPES.get(hf_dtype or "", "bfloat16"))
        return torch.bfloat16 if out == torch.float32 else out
    elif dtype in _DTYPES:
        out = getattr(torch, _DTYPES[dtype])
    else:
        raise ValueError(f"dtype: unknown value {dtype!r}; use auto, bfloat16, float32 or float16")
    if out == torch.float16 and device.type == "cpu":
        raise ValueError("dtype: float16 has no fast kernels on CPU; use bfloat16 or float32")
    return out


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine (one rank). ``LLM(...)`` keyword arguments map onto these."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "torch"
    sampler: str = "default"
    schedule_policy: str = "fcfs"
    cache: str = "radix"  # prefix cache: "radix" (reuse shared prefixes) or "naive" (none)
    # Build step N+1 on the host while step N runs (a forward worker thread). None: on for GPUs
    # without speculative_tokens, off on CPU, where the worker's OpenMP team slows every op of
    # the process (measured 0.6x).
    overlap: bool | None = None
    # Prefill steps also compute one token of every decoding request (SGLang's mixed chunk), so
    # a new prompt does not cost the running requests a step of their own. None: on for CPU
    # (measured: server at 32 clients +2-9%), off elsewhere (not measured on GPUs, where a
    # decode step of its own runs a cheaper graph).
    mixed_steps: bool | None = None
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; overrides kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for K and V of all layers
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    # torch CPU threads of each rank. None: torch's default (the machine's physical cores, or
    # OMP_NUM_THREADS) split among the ranks on this machine.
    threads: int | None = None
    # While other processes keep cores busy, time CPU steps with fewer threads too and run the
    # faster count (threads.py). Single-rank CPU engines only; False: always ``threads``.
    adapt_threads: bool = True
    dist_timeout: float = 300.0  # seconds a TP collective may wait before it is an error
    quantization: str | None = None  # "int8": weight-only int8 linear layers and LM head
    # the KV pool's element type: "auto" (the model's dtype) or "int8" (a float32 scale per head
    # and token; half of bf16's bytes: twice the tokens per byte, less for attention to read)
    kv_cache_dtype: str = "auto"
    # Prompt-lookup speculative decoding (speculative.py): up to this many tokens per decoding
    # request guessed from its own earlier tokens and checked in the same step; 0: off. Steps
    # that check drafts need the tokens of the step before, so it excludes overlap.
    speculative_tokens: int = 0
    # torch.compile of the decode step (compile.py): auto | on (background) | wait | off
    compile: str = field(default_factory=default_mode)

    def __post_init__(self) -> None:
        checks = [
            ("dtype", _is_torch_dtype(self.dtype) or self.dtype in ("auto", *_DTYPES),
             f"must be auto or one of {', '.join(_DTYPES)}"),
            ("page_size", self.page_size >= 1, "must be >= 1"),
            ("cache", self.cache in ("radix", "naive"), "must be 'radix' or 'naive'"),
            ("num_pages", self.num_pages is None or self.num_pages >= 1, "must be >= 1"),
            ("kv_cache_memory", self.kv_cache_memory > 0, "must be > 0 bytes"),
            ("max_running_requests", self.max_running_requests >= 1, "must be >= 1"),
            ("max_prefill_tokens", self.max_prefill_tokens >= 1, "must be >= 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2, "must be >= 2"),
            ("tp_size", self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size, "bad tp rank/size"),
            ("threads", self.threads is None or self.threads >= 1, "must be >= 1"),
            ("dist_timeout", self.dist_timeout > 0, "must be > 0 seconds"),
            ("quantization", self.quantization in (None, "int8"), "must be None or 'int8'"),
            ("kv_cache_dtype", self.kv_cache_dtype in ("auto", "int8"), "must be 'auto' or 'int8'"),
            ("compile", self.compile in COMPILE_MODES, f"must be one of {', '.join(COMPILE_MODES)}"),
            ("speculative_tokens", self.speculative_tokens >= 0, "must be >= 0"),
            ("speculative_tokens", not (self.speculative_tokens and self.overlap),
             "needs overlap off (a draft is made from the previous step's tokens)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

    @property
    def device_type(self) -> str:
        """"cpu", "cuda", ... (``torch_device.type`` without loading torch)."""
        return str(self.device).partition(":")[0]

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def use_mixed_steps(self) -> bool:
        return self.mixed_steps if self.mixed_steps is not None else self.device_type == "cpu"

    @property
    def use_overlap(self) -> bool:
        if self.overlap is not None:
            return self.overlap
        return self.device_type != "cpu" and not self.speculative_tokens
