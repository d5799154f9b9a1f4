"""The AttentionBackend interface: metadata for a batch, then paged attention per layer."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core.kvcache import KVPool


@dataclass
class BatchLayout:
    """Backend-independent description of one forward step (host side, built by the engine).

    For request i: ``q_lens[i]`` new tokens at positions ``kv_lens[i] - q_lens[i] ...
    kv_lens[i] - 1``; its K/V slots are ``req_to_token[rows[i], :kv_lens[i]]``. The new tokens are
    laid out back to back (no padding) in the flattened token dimension, in request order.
    """

    phase: str  # "prefill" | "decode"
    q_lens: list[int]
    kv_lens: list[int]
    rows: list[int]
    req_to_token: torch.Tensor  # [max_reqs, max_len] slot table (device tensor)
    out_loc: torch.Tensor  # [T] slots the new tokens' K/V are written to

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class AttentionBackend(abc.ABC):
    """One instance per engine. ``prepare`` once per step, ``forward`` once per layer."""

    #: Whether ``forward`` honours ``windows``. For a model with sliding-window layers, an
    #: engine whose backend does not caps every context at the window instead.
    supports_sliding_window: bool = False
    #: Whether ``forward`` reads an int8 pool (``kv.quantized``: rows of int8 values and a
    #: float32 scale, ``KVPool.read``/``write`` convert). An engine asked for an int8 pool
    #: (``kv_cache_dtype="int8"``) with a backend that does not refuses to start.
    supports_int8_kv: bool = False

    def __init__(self, kv: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, device: torch.device) -> None:
        self.kv, self.device = kv, device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # per layer: a query at position p attends to keys p - w + 1 .. p only (w > 0), or to
        # all of 0 .. p (w = 0); set by the engine after construction, before ``prepare``
        self.windows: list[int] = [0] * len(kv.k)

    @abc.abstractmethod
    def prepare(self, layout: BatchLayout) -> Any:
        """Build this backend's metadata (tensors only) for one step."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: Any) -> torch.Tensor:
        """Write k/v ([T, kv_heads, head_dim]) to the pool, attend with q ([T, heads, head_dim]).

        Returns [T, heads * head_dim]. Causal over each request's cached prefix + new tokens,
        within ``windows[layer]`` where the backend supports windows.
        """

    def decode_dims(self, meta: Any) -> list[tuple[torch.Tensor, int, str]] | None:
        """For a compilable decode step: the dims of ``meta``'s tensors that vary between steps,
        each ``(tensor, dim, "batch" | "kv")`` (number of requests / keys per request). None
        (the default): this backend's decode is not compiled (``--compile`` leaves it eager).
        A compilable ``forward`` must be traceable by torch.compile: tensor ops only, no
        data-dependent Python control flow in the decode path."""
        return None

    def prefill_dims(self, meta: Any) -> list[tuple[torch.Tensor, int, str]] | None:
        """Like ``decode_dims``, for a prefill/extend step's ``meta``: kinds ``"tokens"`` (the
        batch's new tokens), ``"batch"`` and ``"kv"`` (the longest request's keys). None (the
        default): prefill runs eager. Its ``forward`` must then be traceable for prefill too."""
        return None


@dataclass
class ForwardContext:
    """Everything a model's forward needs besides token ids and positions: passed explicitly.

    ``out_rows``: the rows of the step's tokens whose hidden states the caller reads (int64,
    ascending: the rows it samples from), or None for every row. A model may then return just
    those rows, in that order, and skip what only the others need: in its last layer everything
    after the K/V (every token's K/V is still stored). A model that ignores it returns every row
    and the engine picks the ones it needs."""

    backend: AttentionBackend
    meta: Any
    out_rows: torch.Tensor | None = None
