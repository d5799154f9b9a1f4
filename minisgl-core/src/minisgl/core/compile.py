"""torch.compile of the engine's steps (``--compile``), with eager execution until a graph is ready.

What gets compiled: the engine's forward (future-token lookup, the model, the LM head), for decode
in a few batch-size buckets: ``1``, ``2..32`` and ``33..max_running_requests``. Within a bucket
the batch size, the number of keys per request and the KV pool's size are symbolic
(``mark_dynamic``), so a bucket is one graph whatever the context lengths. Prefill/extend steps
get two graphs (one request; 2..max_running_requests) with the token count symbolic too, where
the attention backend can trace its prefill (``prefill_dims``; the CPU kernel can, the PyTorch
path cannot): eager, a prefill step spends ~20% of its time in norms, RoPE and casts.

Where it pays on CPU: a single-token step of a model run as modules is ~1,000 small ops (norms,
RoPE, residuals, softmax, casts) around the weight matmuls; Inductor fuses them into a few C++
loops. The matmuls themselves stay library calls (the CPU kernels' bf16 linear, oneDNN, int8, or
aten). Where the backend runs a step's decoder layers in one call (core/layers/fused.py), what is
left around it is ~10 ops, and the eager step measured as fast as the graph's (SmolLM2, one
process alternating, medians of 10-12 pairs: 1, 8, 32 and 64 decoding requests, 1,024- and
4 x 256-token prefills within 0.997-1.013x in bf16 and 0.990-1.020x in int8), while the graphs
cost a SmolLM2 server ~120 MB, 2-5x the latency of its first ~8 s of requests while they load,
and on a first start a compile worker (~750 MB more; docs/benchmarks.md): there ``auto`` does
not compile.

Compiling costs 1-10 s per bucket for SmolLM2 on 2 cores where the decoder layers are one C++
op (33-39 s with the PyTorch modules), and most of it is Python holding the GIL: on a thread of
the serving process it would stall every eager step. So:

* ``on``: a worker process (``python -m minisgl.core.compile``, the same engine config with a
  tiny KV pool, nice 10, killed with its parent) compiles every bucket into Inductor's on-disk
  cache and announces each one it finished; a background thread of the engine loads each from
  there as it is announced (0.2-2 s per bucket: cache hits), while the worker goes on with the
  next. Steps run eager until their bucket is ready, and stay eager where compilation failed
  (logged);
* ``wait``: compile every bucket in-process before the engine serves (benchmarks, tests);
* ``off``: never compile. ``auto`` = ``on`` on CPUs where the model runs its decoder layers as
  modules (every tensor-parallel rank: each compiles its own graphs, their collectives are ops
  bound to the rank's group, see distributed.py), ``off`` where they run in one call
  (``CausalLM.layers_in_one_call``) and on GPUs, which run eager for now;
* the cache lives in ``~/.cache/minisgl/inductor`` (``TORCHINDUCTOR_CACHE_DIR`` overrides it):
  a later start with the same model shapes, dtype and flags finds its graphs there. Once a
  worker has compiled every graph of a config, a marker says so (``warm_marker``): a later
  ``on`` start with that config loads its graphs on the engine's thread, with no worker (on a
  warm cache the worker lived ~15 s beside a SmolLM2 server at ~830 MB). Should one of them
  not come from the cache after all, the marker goes and the worker does the rest.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minisgl.core.distributed import LOCAL, Communicator, bind
from minisgl.core.gc_pause import paused

log = logging.getLogger("minisgl.compile")

SMALL_BATCH_MAX = 32  # bucket boundary; also ATen's int8 matmul row limit (one graph each side)
DUMMY_KV_LEN = 96  # keys per request in the warm-up batch: any value > 1, unlike any batch size

WORKER_NUM_PAGES = 37  # the compile worker's KV pool: tiny, and a size no other dim has
READY_LINE = "minisgl-graph-ready"  # the worker's stdout: "<READY_LINE> <phase> <lo> <hi>"
_announce = False  # set in the compile worker: print READY_LINE for each graph compiled
# (tensor, dim, kind): kind "batch" = the number of requests, "kv" = keys per request,
# "tokens" = new tokens in a prefill step, "rows" = its sampled rows, "pool" = slots in the KV
# pool
DynamicDims = list[tuple[torch.Tensor, int, str]]
# A graph: ("decode", lo, hi) for batch sizes lo..hi, ("prefill", lo, hi) for lo..hi requests
Key = tuple[str, int, int]


def resolve_mode(mode: str, device: torch.device, layers_in_one_call: bool = False) -> str:
    """``mode`` with ``auto`` decided: ``on`` for a CPU model whose decoder layers run as modules,
    else ``off``."""
    if mode == "auto":
        return "on" if device.type == "cpu" and not layers_in_one_call else "off"
    return mode


def prefill_keys(max_batch: int) -> list[Key]:
    """One request (its dims of size 1 are specialised) and 2..max_batch requests."""
    return [("prefill", 1, 1)] + ([("prefill", 2, max_batch)] if max_batch >= 2 else [])


def buckets_for(max_batch: int) -> list[tuple[int, int]]:
    """Batch-size ranges, one graph each: [1, 1], [2, 32], [33, max_batch] (clipped)."""
    out = [(1, 1)]
    if max_batch >= 2:
        out.append((2, min(SMALL_BATCH_MAX, max_batch)))
    if max_batch > SMALL_BATCH_MAX:
        out.append((SMALL_BATCH_MAX + 1, max_batch))
    return out


def _use_persistent_cache() -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # importing torch._dynamo pins the variable to torch's default (a temp dir): that value is
    # replaced too, only a directory of the user's own choosing is kept
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path.home() / ".cache" / "minisgl" / "inductor")
    import torch._inductor.config as inductor_config

    # compile in this process: no pool of worker processes left behind a server's children
    inductor_config.compile_threads = 1


WARM_DIR = "minisgl-warm"  # the markers, in Inductor's cache directory


def warm_marker(config: dict[str, Any], threads: int) -> Path:
    """The file that says the compile worker compiled every graph of ``config`` (the worker's
    EngineConfig fields) at ``threads`` threads into the cache: named by a digest of what the
    cache's entries hang on besides the traced code's shapes: the config, the threads (they
    are in Inductor's generated code), torch, Python, the CPU, the ``MINISGL_*`` and
    ``TORCHINDUCTOR_*`` variables (one that changes from start to start only costs the
    worker's run), and the source of minisgl's packages (a model or kernel
    edited since then traces to other graphs)."""
    import minisgl

    digest = hashlib.sha256()
    for part in (json.dumps(config, sort_keys=True), str(threads), torch.__version__,
                 sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability(),
                 *sorted(f"{k}={v}" for k, v in os.environ.items()
                         if k.startswith(("MINISGL_", "TORCHINDUCTOR_"))
                         and k != "MINISGL_PARENT_PID")):  # (a server's children's, per start)
        digest.update(part.encode() + b"\0")
    for root in sorted(minisgl.__path__):  # the namespace's portions: core, models, ...
        for f in sorted(Path(root).rglob("*")):
            if f.suffix in (".py", ".cpp", ".h"):
                digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir()
    return Path(cache) / WARM_DIR / digest.hexdigest()[:32]


def _compiled_anew() -> int:
    """Graphs this process compiled rather than found in Inductor's cache, so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"]
               + counters["inductor"]["fxgraph_cache_bypass"])


def _keep_shape_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's guards re-checked before every call: only the symbolic shapes' ranges and the
    global state (inference mode, dtype defaults). The default set also re-checks every
    parameter, buffer and pool tensor of the model, ~0.9 ms per SmolLM2 step (profiled), for
    things the engine never changes after load; a bucket's shapes are routed by ``run``."""
    return [e.guard_type in ("SHAPE_ENV", "GLOBAL_STATE") for e in entries]


# No per-call size/stride asserts in the generated code: a SmolLM2 step's graph checked its ~400
# inputs one by one, ~0.5 us each (0.2 ms of a 12 ms decode step). The shape guards still route
# every step; the weights and the KV pool never change after load, and the engine builds the
# step's inputs contiguous. (torch.compile takes guard_filter_fn out of the dict it is given:
# each call gets its own copy.)
GRAPH_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "guard_filter_fn": _keep_shape_guards, "size_asserts": False, "scalar_asserts": False}


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A wrapper of ``fn`` with its own code object. Dynamo keeps compiled graphs per code
    object; one per bucket means each holds exactly one graph, selected by ``run``, not by
    guards."""
    def call(*args: Any) -> Any:
        return fn(*args)

    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name,
                              None, call.__closure__)


class StepGraphs:
    """Compiled forwards per key (decode batch bucket, prefill request range); ``run`` returns
    None where the step must run eager (not compiled yet, compilation failed, or a shape the
    graph does not cover).

    ``fn(*args)`` is the forward to compile; ``dims[phase](args)`` names the symbolic dims of its
    tensor arguments; ``dummy[phase](batch_size)`` builds warm-up arguments that write only to
    the pool's scratch page. Phases without ``dims``/``dummy`` (prefill, where the backend
    cannot trace it) get no graphs.
    """

    def __init__(self, fn: Callable[..., torch.Tensor],
                 dims: dict[str, Callable[..., DynamicDims]],
                 dummy: dict[str, Callable[[int], tuple[Any, ...]]], max_batch: int,
                 worker_config: dict[str, Any] | None = None, max_rows: int | None = None,
                 comm: Communicator | None = None) -> None:
        self._fn = fn
        self._comm = comm or Communicator()  # the group the graphs' collectives run on
        # a prefill graph's sampled rows range over 2..max_rows (an int8 LM head without the
        # int8 kernel switches from ATen's matmul at INT8_MM_MAX_ROWS rows; a graph covers one
        # side)
        self._max_rows = max_rows or max_batch
        self._worker_config = worker_config  # EngineConfig fields for the compile worker
        self._dims, self._dummy = dims, dummy
        self.keys: list[Key] = [("decode", lo, hi) for lo, hi in buckets_for(max_batch)]
        if "prefill" in dims:
            self.keys += prefill_keys(max_batch)
        # torch.compile's wrappers, made where compiling starts (_prepare): importing Dynamo
        # and Inductor takes ~1 s of the engine's start (~1.7 s beside a server's other
        # processes on 2 cores), which with `on` then happens after the engine is up
        self._compiled: dict[Key, Callable[..., Any]] = {}
        self.ready: set[Key] = set()
        self.failed: dict[Key, str] = {}
        self.compile_seconds: dict[Key, float] = {}
        self.steps: dict[Key, int] = dict.fromkeys(self.keys, 0)  # steps each graph ran
        self._thread: threading.Thread | None = None
        # Held while a graph compiles and while a step runs on a graph. A step runs under the
        # "fail_on_recompile" stance, which is process-wide: a graph compiling on the background
        # thread meanwhile was refused too, and stayed eager (seen: the server's prefill graphs
        # while decode steps ran on theirs). Steps find it taken while a graph compiles and run
        # eager instead of waiting.
        self._lock = threading.Lock()

    def key(self, phase: str, batch_size: int) -> Key | None:
        for k in self.keys:
            if k[0] == phase and k[1] <= batch_size <= k[2]:
                return k
        return None

    def _mark(self, args: tuple[Any, ...], key: Key) -> None:
        phase, lo, hi = key
        for t, d, kind in self._dims[phase](*args):
            if kind in ("kv", "pool", "tokens"):  # >= 2 (0 and 1 are specialised)
                torch._dynamo.mark_dynamic(t, d)
            elif kind == "rows":  # one request: one row, static
                if hi > 1:
                    torch._dynamo.mark_dynamic(t, d, min=2, max=max(self._max_rows, 3))
            elif lo != hi:
                torch._dynamo.mark_dynamic(t, d, min=lo, max=hi)

    def _call(self, args: tuple[Any, ...], key: Key, comm: Communicator) -> torch.Tensor:
        with torch.inference_mode(), bind(comm):
            out: torch.Tensor = self._compiled[key](*args)
        return out

    def _prepare(self) -> None:
        if self._compiled:
            return
        _use_persistent_cache()
        self._compiled = {k: torch.compile(_own_code(self._fn, f"{k[0]}_{k[1]}_to_{k[2]}"),
                                           dynamic=False, options=dict(GRAPH_OPTIONS))
                          for k in self.keys}

    def compile_one(self, key: Key) -> None:
        self._prepare()
        start = time.perf_counter()
        try:
            # the marks matter while tracing only: later steps are checked by the shape guards
            args = self._dummy[key[0]](min(max(key[1], 5), key[2]) if key[2] > 1 else 1)
            self._mark(args, key)
            # dummy inputs, at a moment of this rank's choosing: collectives act as if alone
            with self._lock:
                self._call(args, key, LOCAL)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
            self.failed[key] = f"{type(e).__name__}: {e}"
            log.warning("%s graph for batch %s-%s failed to compile; it runs eager: %s",
                        *key, self.failed[key].splitlines()[0])
            return
        self.compile_seconds[key] = time.perf_counter() - start
        self.ready.add(key)
        log.info("%s graph for batch %s-%s ready (%.1f s)", *key, self.compile_seconds[key])
        if _announce:
            print(READY_LINE, *key, flush=True)

    def describe(self) -> str:
        """One line: each graph's state and compile time."""
        parts = []
        for k in self.keys:
            state = (f"{self.compile_seconds[k]:.1f} s" if k in self.ready else
                     "failed" if k in self.failed else "pending")
            parts.append(f"{k[0]} {k[1]}-{k[2]}: {state}")
        return ", ".join(parts)

    def compile_all(self) -> None:
        for k in self.keys:
            self.compile_one(k)

    def _run_worker(self) -> None:
        """The compile worker fills the on-disk cache, one graph after the other; each graph it
        announces is loaded here meanwhile (a cache hit), so that graphs come into use one by
        one, and a warm cache is walked by the two processes side by side, not one after the
        other (SmolLM2's five graphs on 2 cores with the PyTorch modules, warm cache: all
        ready ~40 s after start, the batch-1 decode graph after 17 s; 56-63 s and 37 s when the
        engine waited for the worker to exit, then loaded them all; with the C++ decoder layers
        ~12 s, ~24 s from a cold cache). Graphs the worker did not announce (it failed on them,
        or exited) stay eager."""
        argv = [sys.executable, "-m", "minisgl.core.compile", json.dumps(self._worker_argv_config()),
                str(torch.get_num_threads())]
        # stderr to a file: a pipe nobody reads while stdout is followed could fill and stall it
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err)
            atexit.register(_kill, proc)
            assert proc.stdout is not None
            for line in proc.stdout:
                parts = line.decode(errors="replace").split()
                if len(parts) == 4 and parts[0] == READY_LINE:
                    key = (parts[1], int(parts[2]), int(parts[3]))
                    if key in self.keys and key not in self.ready:
                        self.compile_one(key)
            proc.wait()
            if proc.pid in _killed:  # this process is exiting: nothing left to report
                return
            err.seek(0)
            why = (err.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        missing = [k for k in self.keys if k not in self.ready and k not in self.failed]
        for k in missing:
            self.failed[k] = f"compile worker exited with {proc.returncode}: {why}"
        if missing:
            log.warning("compile worker exited with %s without %s; they run eager: %s",
                        proc.returncode, ", ".join(f"{k[0]} {k[1]}-{k[2]}" for k in missing), why)

    def _worker_argv_config(self) -> dict[str, Any]:
        assert self._worker_config is not None
        return dict(self._worker_config, compile="wait", num_pages=WORKER_NUM_PAGES)

    def _load_warm(self, marker: Path) -> bool:
        """Every graph from the cache, on this thread, one after the other (each comes into use
        as it is loaded); False, the marker removed, at the first that was compiled instead
        (it is ready all the same) or failed: the worker does the rest."""
        for k in self.keys:
            before = _compiled_anew()
            self.compile_one(k)
            if k in self.failed or _compiled_anew() > before:
                self.failed.pop(k, None)  # the worker tries it again
                marker.unlink(missing_ok=True)
                log.info("the compile cache did not hold the %s graph for batch %s-%s; the "
                         "compile worker does the rest", *k)
                return False
        return True

    def _background(self) -> None:
        with paused():  # Dynamo's and Inductor's modules (gc_pause)
            self._prepare()  # (the worker's cache directory too)
        if self._worker_config is None:
            self.compile_all()
            return
        marker = warm_marker(self._worker_argv_config(), torch.get_num_threads())
        with paused():
            if marker.exists() and self._load_warm(marker):
                return
        self._run_worker()
        if self.ready == set(self.keys):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

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

    def run(self, phase: str, args: tuple[Any, ...], batch_size: int) -> torch.Tensor | None:
        key = self.key(phase, batch_size)
        if key is None or key not in self.ready or not self._lock.acquire(blocking=False):
            return None  # (the lock: another graph is compiling)
        try:
            # a shape the graph's guards reject would recompile here, in the serving process,
            # for a minute: refused instead, and that step runs eager
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self._call(args, key, self._comm)
            self.steps[key] += 1
            return out
        except RuntimeError as e:
            if "recompil" in str(e).lower():
                log.debug("%s graph for batch %s-%s: step not covered, eager: %s", *key, e)
                return None
            self._disable(key, e)
        except Exception as e:  # noqa: BLE001 - a graph that breaks at run time: back to eager
            self._disable(key, e)
        finally:
            self._lock.release()
        return None

    def _disable(self, key: Key, e: Exception) -> None:
        self.ready.discard(key)
        self.failed[key] = f"{type(e).__name__}: {e}"
        log.warning("%s graph for batch %s-%s failed; it runs eager from now: %s",
                    *key, self.failed[key].splitlines()[0])


_killed: set[int] = set()  # pids of compile workers this process killed on its way out


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        _killed.add(proc.pid)
        proc.kill()


def _worker_main(config_json: str, threads: str) -> int:
    """``python -m minisgl.core.compile CONFIG``: build the engine (compile='wait'), which
    compiles every graph into the on-disk cache, then exit."""
    from minisgl.core import compile as graphs_module
    from minisgl.core.child import die_with_parent
    from minisgl.core.config import EngineConfig
    from minisgl.core.engine import Engine

    die_with_parent()
    # each graph compiled, on stdout: the serving process loads it then. Set on the module the
    # engine imports: under -m this file also runs as __main__, another copy of it
    graphs_module._announce = True
    # Below the serving process in the CPU scheduler: on 2 cores an equal-priority compiler
    # slowed eager steps 4x (measured). The serving process's thread count, though: Inductor's
    # generated code, and so its cache key, depend on it.
    os.nice(10)
    torch.set_num_threads(int(threads))
    engine = Engine(EngineConfig(**json.loads(config_json)))
    graphs = engine.graphs
    return 0 if graphs is not None and not graphs.failed else 1


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], sys.argv[2]))
