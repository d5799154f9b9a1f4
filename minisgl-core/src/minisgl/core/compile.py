"""torch.compile of the decode step (``--compile``), with eager execution until a graph is ready.

What gets compiled: the engine's decode forward (future-token lookup, the model, the LM head) for
a few batch-size buckets: ``1``, ``2..32`` and ``33..max_running_requests``. Within a bucket the
batch size and the number of keys per request are symbolic (``mark_dynamic`` with the bucket's
range), so a bucket is one graph whatever the context lengths. Prefill stays eager: it is
matmul-bound and has a different shape every step.

Why it pays on CPU: a single-token step is ~1,000 small ops (norms, RoPE, residuals, softmax,
casts) around the weight matmuls; Inductor fuses them into a few C++ loops. The matmuls
themselves stay library calls (oneDNN prepacked bf16 through a custom op, int8, or aten).

Compiling costs ~25 s per bucket for SmolLM2 on 2 cores, so:

* ``on``: the buckets compile one after another on a background thread; steps run eager until
  their bucket is ready, and stay eager for a bucket whose compilation failed (logged once);
* ``wait``: compile every bucket before the engine serves (benchmarks, tests);
* ``off``: never compile. ``auto`` = ``on`` for one CPU rank, ``off`` otherwise (tensor
  parallelism and GPUs run eager);
* Inductor's on-disk caches live in ``~/.cache/minisgl/inductor`` (``TORCHINDUCTOR_CACHE_DIR``
  overrides it): a second start finds the graphs compiled (~5 s per bucket instead of ~25).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("minisgl.compile")

COMPILE_MODES = ("auto", "on", "off", "wait")
SMALL_BATCH_MAX = 32  # bucket boundary; also the int8 kernel's row limit (one graph each side)
DUMMY_KV_LEN = 96  # keys per request in the warm-up batch: any value > 1, unlike any batch size

# (tensor, dim, kind): kind "batch" = the number of requests, "kv" = keys per request
DynamicDims = list[tuple[torch.Tensor, int, str]]


def resolve_mode(mode: str, device: torch.device, tp_size: int) -> str:
    if mode == "auto":
        return "on" if device.type == "cpu" and tp_size == 1 else "off"
    if mode != "off" and tp_size > 1:
        raise ValueError("compile: not supported with tensor parallelism (tp > 1) yet; "
                         "use compile='off' (the default for tp > 1)")
    return mode


def buckets_for(max_batch: int) -> list[tuple[int, int]]:
    """Batch-size ranges, one graph each: [1, 1], [2, 32], [33, max_batch] (clipped)."""
    out = [(1, 1)]
    if max_batch >= 2:
        out.append((2, min(SMALL_BATCH_MAX, max_batch)))
    if max_batch > SMALL_BATCH_MAX:
        out.append((SMALL_BATCH_MAX + 1, max_batch))
    return out


def _use_persistent_cache() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path.home() / ".cache" / "minisgl" / "inductor"))
    import torch._inductor.config as inductor_config

    # compile in this process: no pool of worker processes left behind a server's children
    inductor_config.compile_threads = 1


class DecodeGraphs:
    """Compiled decode forwards per batch bucket; ``run`` returns None where the step must run
    eager (bucket not compiled yet, or its compilation failed).

    ``fn(*args)`` is the forward to compile; ``dims(args)`` names the symbolic dims of its
    tensor arguments; ``dummy(batch_size, kv_len)`` builds warm-up arguments that write only to
    the pool's scratch page.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], dims: Callable[..., DynamicDims],
                 dummy: Callable[[int, int], tuple[Any, ...]], max_batch: int) -> None:
        _use_persistent_cache()
        self._compiled = torch.compile(fn, dynamic=False)
        self._dims, self._dummy = dims, dummy
        self.buckets = buckets_for(max_batch)
        self.ready: set[tuple[int, int]] = set()
        self.failed: dict[tuple[int, int], str] = {}
        self.compile_seconds: dict[tuple[int, int], float] = {}
        self._thread: threading.Thread | None = None

    def bucket(self, batch_size: int) -> tuple[int, int] | None:
        for lo, hi in self.buckets:
            if lo <= batch_size <= hi:
                return lo, hi
        return None

    def _mark(self, args: tuple[Any, ...], bucket: tuple[int, int]) -> None:
        lo, hi = bucket
        for t, d, kind in self._dims(*args):
            if kind == "kv":
                torch._dynamo.mark_dynamic(t, d)
            elif lo != hi:
                torch._dynamo.mark_dynamic(t, d, min=lo, max=hi)

    def _call(self, args: tuple[Any, ...], bucket: tuple[int, int]) -> torch.Tensor:
        self._mark(args, bucket)
        with torch.inference_mode():
            out: torch.Tensor = self._compiled(*args)
        return out

    def compile_bucket(self, bucket: tuple[int, int]) -> None:
        start = time.perf_counter()
        try:
            self._call(self._dummy(max(bucket[0], 2) if bucket[1] > 1 else 1, DUMMY_KV_LEN),
                       bucket)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
            self.failed[bucket] = f"{type(e).__name__}: {e}"
            log.warning("decode graph for batch %s-%s failed to compile; it runs eager: %s",
                        *bucket, self.failed[bucket].splitlines()[0])
            return
        self.compile_seconds[bucket] = time.perf_counter() - start
        self.ready.add(bucket)
        log.info("decode graph for batch %s-%s ready (%.1f s)", *bucket,
                 self.compile_seconds[bucket])

    def compile_all(self) -> None:
        for b in self.buckets:
            self.compile_bucket(b)

    def start(self, wait: bool) -> None:
        if wait:
            self.compile_all()
            return
        self._thread = threading.Thread(target=self.compile_all, name="minisgl-compile",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self, args: tuple[Any, ...], batch_size: int) -> torch.Tensor | None:
        bucket = self.bucket(batch_size)
        if bucket is None or bucket not in self.ready:
            return None
        try:
            return self._call(args, bucket)
        except Exception as e:  # noqa: BLE001 - a graph that breaks at run time: back to eager
            self.ready.discard(bucket)
            self.failed[bucket] = f"{type(e).__name__}: {e}"
            log.warning("decode graph for batch %s-%s failed; it runs eager from now: %s",
                        *bucket, self.failed[bucket].splitlines()[0])
            return None
