"""torch.compile of the decode step (``--compile``), with eager execution until a graph is ready.

What gets compiled: the engine's decode forward (future-token lookup, the model, the LM head) for
a few batch-size buckets: ``1``, ``2..32`` and ``33..max_running_requests``. Within a bucket the
batch size, the number of keys per request and the KV pool's size are symbolic
(``mark_dynamic``), so a bucket is one graph whatever the context lengths. Prefill stays eager:
it is matmul-bound and has a different shape every step.

Why it pays on CPU: a single-token step is ~1,000 small ops (norms, RoPE, residuals, softmax,
casts) around the weight matmuls; Inductor fuses them into a few C++ loops. The matmuls
themselves stay library calls (oneDNN prepacked bf16 through a custom op, int8, or aten).

Compiling costs 35-60 s per bucket for SmolLM2 on 2 cores, and most of it is Python holding the
GIL: on a thread of the serving process it would stall every eager step. So:

* ``on``: a worker process (``python -m minisgl.core.compile``, the same engine config with a
  tiny KV pool, nice 10, killed with its parent) compiles every bucket into Inductor's on-disk
  cache; then a background thread of the engine loads them from there (~7 s per bucket). Steps
  run eager until their bucket is ready, and stay eager where compilation failed (logged);
* ``wait``: compile every bucket in-process before the engine serves (benchmarks, tests);
* ``off``: never compile. ``auto`` = ``on`` for one CPU rank, ``off`` otherwise (tensor
  parallelism and GPUs run eager for now);
* the cache lives in ``~/.cache/minisgl/inductor`` (``TORCHINDUCTOR_CACHE_DIR`` overrides it):
  a later start with the same model shapes, dtype and flags finds its graphs there.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("minisgl.compile")

COMPILE_MODES = ("auto", "on", "off", "wait")
SMALL_BATCH_MAX = 32  # bucket boundary; also the int8 kernel's row limit (one graph each side)
DUMMY_KV_LEN = 96  # keys per request in the warm-up batch: any value > 1, unlike any batch size

WORKER_NUM_PAGES = 37  # the compile worker's KV pool: tiny, and a size no other dim has
# (tensor, dim, kind): kind "batch" = the number of requests, "kv" = keys per request,
# "pool" = slots in the KV pool
DynamicDims = list[tuple[torch.Tensor, int, str]]


def default_mode() -> str:
    """``$MINISGL_COMPILE`` when set (the test matrix runs both ways), else ``auto``."""
    return os.environ.get("MINISGL_COMPILE", "auto")


def resolve_mode(mode: str, device: torch.device, tp_size: int) -> str:
    if tp_size > 1:
        if mode in ("on", "wait"):
            log.warning("compile=%s: not supported with tensor parallelism yet; ranks run eager",
                        mode)
        return "off"
    if mode == "auto":
        return "on" if device.type == "cpu" else "off"
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


def _keep_shape_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's guards re-checked before every call: only the symbolic shapes' ranges and the
    global state (inference mode, dtype defaults). The default set also re-checks every
    parameter, buffer and pool tensor of the model, ~0.9 ms per SmolLM2 step (profiled), for
    things the engine never changes after load; a bucket's shapes are routed by ``run``."""
    return [e.guard_type in ("SHAPE_ENV", "GLOBAL_STATE") for e in entries]


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A wrapper of ``fn`` with its own code object. Dynamo keeps compiled graphs per code
    object; one per bucket means each holds exactly one graph, selected by ``run``, not by
    guards."""
    def call(*args: Any) -> Any:
        return fn(*args)

    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name,
                              None, call.__closure__)


class DecodeGraphs:
    """Compiled decode forwards per batch bucket; ``run`` returns None where the step must run
    eager (bucket not compiled yet, or its compilation failed).

    ``fn(*args)`` is the forward to compile; ``dims(args)`` names the symbolic dims of its
    tensor arguments; ``dummy(batch_size, kv_len)`` builds warm-up arguments that write only to
    the pool's scratch page.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], dims: Callable[..., DynamicDims],
                 dummy: Callable[[int, int], tuple[Any, ...]], max_batch: int,
                 worker_config: dict[str, Any] | None = None) -> None:
        _use_persistent_cache()
        self._worker_config = worker_config  # EngineConfig fields for the compile worker
        self._dims, self._dummy = dims, dummy
        self.buckets = buckets_for(max_batch)
        self._compiled = {b: torch.compile(_own_code(fn, f"decode_batch_{b[0]}_to_{b[1]}"),
                                           dynamic=False,
                                           options={"guard_filter_fn": _keep_shape_guards})
                          for b in self.buckets}
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
            if kind in ("kv", "pool"):
                torch._dynamo.mark_dynamic(t, d)
            elif lo != hi:
                torch._dynamo.mark_dynamic(t, d, min=lo, max=hi)

    def _call(self, args: tuple[Any, ...], bucket: tuple[int, int]) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = self._compiled[bucket](*args)
        return out

    def compile_bucket(self, bucket: tuple[int, int]) -> None:
        start = time.perf_counter()
        try:
            # the marks matter while tracing only: later steps are checked by the shape guards
            args = self._dummy(max(bucket[0], 2) if bucket[1] > 1 else 1, DUMMY_KV_LEN)
            self._mark(args, bucket)
            self._call(args, bucket)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
            self.failed[bucket] = f"{type(e).__name__}: {e}"
            log.warning("decode graph for batch %s-%s failed to compile; it runs eager: %s",
                        *bucket, self.failed[bucket].splitlines()[0])
            return
        self.compile_seconds[bucket] = time.perf_counter() - start
        self.ready.add(bucket)
        log.info("decode graph for batch %s-%s ready (%.1f s)", *bucket,
                 self.compile_seconds[bucket])

    def describe(self) -> str:
        """One line: each bucket's state and compile time."""
        parts = []
        for b in self.buckets:
            state = (f"{self.compile_seconds[b]:.1f} s" if b in self.ready else
                     "failed" if b in self.failed else "pending")
            parts.append(f"batch {b[0]}-{b[1]}: {state}")
        return ", ".join(parts)

    def compile_all(self) -> None:
        for b in self.buckets:
            self.compile_bucket(b)

    def _run_worker(self) -> bool:
        """The compile worker fills the on-disk cache; False (all buckets failed) if it fails."""
        assert self._worker_config is not None
        cfg = dict(self._worker_config, compile="wait", num_pages=WORKER_NUM_PAGES)
        argv = [sys.executable, "-m", "minisgl.core.compile", json.dumps(cfg),
                str(torch.get_num_threads())]
        proc = subprocess.Popen(argv,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        atexit.register(_kill, proc)
        _, err = proc.communicate()
        if proc.returncode == 0:
            return True
        why = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        for b in self.buckets:
            self.failed[b] = f"compile worker exited with {proc.returncode}: {why}"
        log.warning("decode compile worker failed (exit %s); decode runs eager: %s",
                    proc.returncode, why)
        return False

    def _background(self) -> None:
        if self._worker_config is None or self._run_worker():
            self.compile_all()  # cache hits after the worker

    def start(self, wait: bool) -> None:
        if wait:
            self.compile_all()
            return
        self._thread = threading.Thread(target=self._background, name="minisgl-compile",
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


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()


def _worker_main(config_json: str, threads: str) -> int:
    """``python -m minisgl.core.compile CONFIG``: build the engine (compile='wait'), which
    compiles every decode bucket into the on-disk cache, then exit."""
    from minisgl.core.config import EngineConfig
    from minisgl.core.engine import Engine
    from minisgl.core.tp import die_with_parent

    die_with_parent()
    # Below the serving process in the CPU scheduler: on 2 cores an equal-priority compiler
    # slowed eager steps 4x (measured). The serving process's thread count, though: Inductor's
    # generated code, and so its cache key, depend on it.
    os.nice(10)
    torch.set_num_threads(int(threads))
    engine = Engine(EngineConfig(**json.loads(config_json)))
    graphs = engine.decode_graphs
    return 0 if graphs is not None and not graphs.failed else 1


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], sys.argv[2]))
