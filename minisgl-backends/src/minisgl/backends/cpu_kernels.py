"""CPU kernels in C++ (csrc/), built on first use into one library, ``torch.ops.minisgl_cpu``.

- ``paged_attention`` (cpu_attention.cpp): prefill, extend and decode over the paged KV pool,
  read in place, with or without a sliding window, for bf16.
- ``bf16_pack`` / ``bf16_linear`` (cpu_linear.cpp): bf16 weights in the kernel's own blocked
  layout (in memory from ``weight_zeros``: 2 MiB-aligned arenas madvised for transparent huge
  pages) and the matmul over it, for any number of rows; ``load()`` registers them with
  ``minisgl.core.layers.quant.register_bf16_linear``, so weights converted afterwards (the
  engine builds the attention backend first) use them in place of oneDNN; ``out_dtype=float32``
  widens the result in the same call (the LM head's logits).
- ``int8_pack`` / ``int8_linear`` (cpu_linear.cpp): weight-only int8 in the same blocked layout,
  for any number of rows; ``load()`` registers them with
  ``minisgl.core.layers.quant.register_int8_linear``, so weights quantized afterwards use them in
  place of ATen's int8 matmul (few rows) and per-call dequantization (many).
- ``bf16_linear_silu`` / ``int8_linear_silu`` (cpu_linear.cpp): silu(gate) * up of a merged
  gate-up weight in one call (registered with the linears as their gated form): on AMX tiles
  the gate's and the up half's sums meet in the kernel, so the [M, 2I] output is never
  written; elsewhere the linear, then the product.
- ``decoder_layer`` (cpu_layer.cpp): a Llama-family decoder layer of a step in one call
  (RMSNorm, QKV, RoPE, the K/V store, ``paged_attention``, O, residual, RMSNorm, gate-up, SiLU,
  down), on weights packed by ``bf16_pack`` or ``int8_pack``; ``bf16_rows``: rows of a packed
  weight (a tied embedding's lookup, ``packed_rows``); ``bind_layers`` / ``decoder_layers``:
  a run of them bound once (``LayerRun``), then run in one call per step, which the CPU backend
  uses through ``minisgl.core.layers.register_fused_decoder_layers`` (torch_native.py says
  where); ``MINISGL_FUSED_LAYER=off`` turns that off.
- ``rms_norm`` (cpu_layer.cpp): RMSNorm (with the residual add) of bf16 rows as the layers take it,
  registered with ``minisgl.core.layers.register_rms_norm`` for the model's eager norms (its
  final one, between the layers' one call and the LM head).
- ``argmax_logsumexp`` (cpu_sample.cpp): the greedy token and the log-sum-exp of every row of
  float32 logits in one call; ``load()`` registers it with
  ``minisgl.core.sampling.register_argmax_logsumexp`` for the default sampler.
- ``sample_rows`` (cpu_sample.cpp): a sampled row's token with temperature, top-k, top-p and
  min-p, without sorting the row or drawing a number per token; registered with
  ``minisgl.core.sampling.register_sample_rows``.

Every kernel has two builds: AVX-512 (AVX512-BF16, and AVX512-VNNI for the linears: Intel since
Cooper Lake, AMD since Zen 4) and AVX2 with FMA (x86-64-v3: Intel since Haswell, AMD since Zen;
the build for every such CPU without AVX512-BF16, most laptops among them), which computes the
same sums with 256-bit vectors (the attention in float32). Where the CPU has AMX (Intel since
Sapphire Rapids) and Linux grants its tiles, the AVX-512 build's linears (bf16 from 1 row, int8
from 12, the same integer sums) and the attention's prefill items multiply on tiles;
``MINISGL_AMX=off`` keeps them on vectors. ``linear_isa()`` says which one runs ("avx512+amx",
"avx512", "avx2"). ``MINISGL_CPU_ISA=avx2`` builds the AVX2 one on any CPU that has AVX2 and
FMA (``-march=x86-64-v3``), an AVX-512 one included: how this project's CI, on an AVX-512 host,
also tests the build most laptops run.

The sources are compiled with the machine's compiler (``-O3 -march=native -fopenmp``) through
``torch.utils.cpp_extension`` into ``~/.cache/minisgl/ext/<key>``, the key covering the sources
(and the headers), torch's version and the CPU's instruction-set flags, so a later start loads
the built library in well under a second. Building needs a C++ compiler with OpenMP and ninja
(a dependency of this package); when either is missing, the build fails or the CPU has neither
build's instructions, ``load()`` returns False with the reason in ``load_error`` and the
backends keep their pure-PyTorch path. ``MINISGL_CPU_KERNELS=off`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import sysconfig
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from minisgl.core.layers.norm import register_rms_norm
from minisgl.core.layers.quant import register_bf16_linear, register_int8_linear
from minisgl.core.sampling import register_argmax_logsumexp, register_sample_rows

log = logging.getLogger(__name__)

NAME = "minisgl_cpu_attention"
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("cpu_attention.cpp", "cpu_linear.cpp", "cpu_layer.cpp", "cpu_sample.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name  # part of the build's cache key
           for name in ("vec.h", "kernels.h")]
# -fopenmp: at::parallel_for is a header template whose threads are an ``omp parallel`` region
# compiled into this library; without the flag it runs on one thread (links the libgomp.so.1
# torch has loaded already: same soname, one thread pool)
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
ISAS = ("native", "avx2")  # MINISGL_CPU_ISA: the CPU's own build, or the AVX2 one
load_error: str | None = None
_state: bool | None = None
_lock = threading.Lock()


def cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "cpu family", "flags", ...); empty
    where there is none."""
    fields: dict[str, str] = {}
    if platform.system() != "Linux":
        return fields
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first CPU's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> list[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo), sorted; empty where unknown."""
    return sorted(cpuinfo().get("flags", "").split())


def isa() -> str:
    """``MINISGL_CPU_ISA``: "native" (default) or "avx2"."""
    value = os.environ.get("MINISGL_CPU_ISA", "native").lower()
    if value not in ISAS:
        raise ValueError(f"MINISGL_CPU_ISA must be one of {', '.join(ISAS)} (got {value!r})")
    return value


def cflags() -> list[str]:
    """CFLAGS for the build ``isa()`` asks for (x86-64-v3, tuned for this CPU, for "avx2")."""
    if isa() == "native":
        return CFLAGS
    return [f for f in CFLAGS if f != "-march=native"] + ["-march=x86-64-v3", "-mtune=native"]


def _cache_dir() -> Path:
    key = hashlib.sha256("\n".join(
        [*(source.read_text() for source in (*SOURCES, *HEADERS)), torch.__version__,
         platform.machine(), " ".join(cpu_flags()),
         *cflags(), *LDFLAGS]).encode())
    root = Path(os.environ.get("MINISGL_EXT_DIR", Path.home() / ".cache" / "minisgl" / "ext"))
    return root / key.hexdigest()[:16]


def _on(variable: str) -> bool:
    return os.environ.get(variable, "on").lower() not in ("0", "off", "false", "no")


def enabled() -> bool:
    return _on("MINISGL_CPU_KERNELS")


def fused_layer_enabled() -> bool:
    """Whether the steps run ``decoder_layer`` (``MINISGL_FUSED_LAYER``, default on)."""
    return _on("MINISGL_FUSED_LAYER")


def load() -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.minisgl_cpu`` is usable."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


def _load() -> bool:
    global load_error
    if not enabled():
        load_error = "MINISGL_CPU_KERNELS=off"
        return False
    isa()  # a bad MINISGL_CPU_ISA is an error, not a silent fallback to the PyTorch path
    try:
        library = _cache_dir() / f"{NAME}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(library)  # loads it too
        if not torch.ops.minisgl_cpu.available():
            raise RuntimeError("this CPU or compiler has neither AVX2 with FMA nor AVX512-BF16")
    except Exception as e:  # no compiler, no ninja, a compile error: keep the PyTorch path
        text = f"{type(e).__name__}: {e}"
        errors = [x.strip() for x in text.splitlines() if "error" in x.lower()]
        load_error = (errors[1] if len(errors) > 1 else text.splitlines()[0])[:300]
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", load_error)
        return False
    _register_fake()
    ops = torch.ops.minisgl_cpu
    register_bf16_linear(ops.bf16_pack.default, ops.bf16_linear.default,
                         ops.bf16_linear_silu.default, packed_rows, widens=True)
    register_int8_linear(ops.int8_pack.default, ops.int8_linear.default,
                         ops.int8_linear_silu.default, widens=True)
    register_argmax_logsumexp(ops.argmax_logsumexp.default)
    register_sample_rows(ops.sample_rows.default)
    register_rms_norm(ops.rms_norm.default)
    return True


def _build(library: Path) -> None:
    """Compile into a private directory, then move the library into place (atomic): processes
    starting together each build, the last rename wins, none waits on another's lock."""
    from torch.utils import cpp_extension

    scripts = sysconfig.get_path("scripts")  # pip's ninja, in a venv that is not activated
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), scripts])
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent.parent) as tmp:
        cpp_extension.load(name=NAME, sources=[str(source) for source in SOURCES],
                           extra_cflags=cflags(), extra_ldflags=LDFLAGS, build_directory=tmp,
                           is_python_module=False, verbose=False)
        os.replace(Path(tmp) / f"{NAME}.so", library)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight [N, K] that ``bf16_pack`` packed, exactly
    (``bf16_rows``): what a tied embedding reads instead of keeping its own copy of the LM
    head's weight."""
    if ids.dim() == 1:  # a step's ids: no reshape ops (each costs ~10 us right after a decode step)
        out: torch.Tensor = torch.ops.minisgl_cpu.bf16_rows(packed, ids)
        return out
    rows: torch.Tensor = torch.ops.minisgl_cpu.bf16_rows(packed, ids.reshape(-1))
    return rows.reshape(*ids.shape, rows.shape[-1])


def _register_fake() -> None:
    @torch.library.register_fake("minisgl_cpu::paged_attention")
    def _(q, k, v, slots, kv_lens, q_start, q_lens, scale,  # type: ignore[no-untyped-def]
          window=0, threads=0):
        return q.new_empty(q.shape)

    @torch.library.register_fake("minisgl_cpu::int8_linear")
    def _(x, w, s, n, out_dtype=None):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n, dtype=out_dtype or x.dtype)

    @torch.library.register_fake("minisgl_cpu::decoder_layer")
    def _(x, residual, *rest):  # type: ignore[no-untyped-def]
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("minisgl_cpu::decoder_layers")
    def _(x, residual, run, cos, sin, out_loc, slots, kv_lens, q_start,  # type: ignore[no-untyped-def]
          q_lens, rows=None):
        n = x.shape[0] if rows is None else rows.shape[0]
        return x.new_empty(n, x.shape[1]), x.new_empty(n, x.shape[1])

    @torch.library.register_fake("minisgl_cpu::rms_norm")
    def _(x, residual, weight, eps):  # type: ignore[no-untyped-def]
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("minisgl_cpu::bf16_rows")
    def _(packed, ids):  # type: ignore[no-untyped-def]
        return packed.new_empty(ids.shape[0], packed.shape[1] * 2)

    @torch.library.register_fake("minisgl_cpu::bf16_linear")
    def _(x, w, n, out_dtype=None):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n, dtype=out_dtype or x.dtype)

    @torch.library.register_fake("minisgl_cpu::bf16_linear_silu")
    def _(x, w, n):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n // 2)

    @torch.library.register_fake("minisgl_cpu::int8_linear_silu")
    def _(x, w, s, n):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n // 2)


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
             int8_kv: bool = False) -> bool:
    """Whether ``paged_attention`` takes this shape (and runs on this CPU); ``int8_kv``: over
    an int8 pool (``KVPool(kv_dtype=torch.int8)``)."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8 and load()
            and (not int8_kv or torch.ops.minisgl_cpu.int8_kv()))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    kv_lens: torch.Tensor, q_start: torch.Tensor, q_lens: torch.Tensor,
                    scale: float, window: int = 0, threads: int = 0) -> torch.Tensor:
    """Causal attention of a batch's new tokens over their requests' pool slots, in place.

    q [T, H, D] bf16 (request b's queries are rows q_start[b] .. + q_lens[b], the last q_lens[b]
    of its kv_lens[b] positions); k, v [KVH, S, D] bf16, the pool with the new K/V already
    written; slots [B, Lk] int64 (row b's first kv_lens[b] entries are its slots in position
    order; a request with q_lens[b] = 0 is skipped, its rows of the result left as they were
    allocated). ``window`` > 0: a query at position p sees keys p - window + 1 .. p only (a sliding
    window; its keys further back are not read). ``threads`` (0: the call's
    ``torch.get_num_threads()``): the thread count that decides how far few decode requests'
    keys are split over the threads, and so the order of their sums: an engine passes its own,
    so that the steps its thread tuner runs on fewer threads give the same numbers. Returns
    [T, H, D]."""
    out: torch.Tensor = torch.ops.minisgl_cpu.paged_attention(q, k, v, slots, kv_lens, q_start,
                                                              q_lens, scale, window, threads)
    return out


def decoder_layer(x: torch.Tensor, residual: torch.Tensor | None, in_norm: torch.Tensor,
                  post_norm: torch.Tensor, weights: list[torch.Tensor],
                  scales: list[torch.Tensor], qkv_bias: torch.Tensor | None,
                  o_bias: torch.Tensor | None, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, out_loc: torch.Tensor,
                  slots: torch.Tensor, kv_lens: torch.Tensor, q_start: torch.Tensor,
                  q_lens: torch.Tensor, scale: float, eps: float, heads: int, kv_heads: int,
                  window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's decoder layer (cpu_layer.cpp): returns (output, new residual).

    x, residual [M, hidden] bf16 (residual None in the first layer: x is the residual); norm
    weights [hidden]; ``weights`` the qkv (q, k, v heads in order), o, gate_up (gate then up)
    and down weights packed by ``bf16_pack`` (``scales`` empty) or by ``int8_pack`` (``scales``
    their float32 per-output scales); the qkv and o biases and Qwen3's per-head q and k norm
    weights where the layer has them (else None); cos, sin [M, head_dim] at each row's
    position; the pool and index tensors as for ``paged_attention`` with one new token per
    request, stored at out_loc."""
    y, r = torch.ops.minisgl_cpu.decoder_layer(
        x, residual, in_norm, post_norm, weights, scales, qkv_bias, o_bias, q_norm, k_norm, cos,
        sin, k_pool, v_pool, out_loc, slots, kv_lens, q_start, q_lens, scale, eps, heads,
        kv_heads, window)
    return y, r


class LayerRun:
    """Consecutive decoder layers bound once to the kernels (``bind_layers``): per layer l
    ``norms[2l]``, ``norms[2l + 1]`` (input, post-attention), ``weights[4l:4l + 4]`` and their
    ``scales`` (int8; empty for bf16), its qkv and o bias (one per layer, or empty lists where
    the layers have none), its q and k norms (``qk_norms[2l:2l + 2]``, or empty),
    ``k_pools[l]``, ``v_pools[l]``, ``windows[l]``; ``scale``, ``eps`` and the head counts as
    for ``decoder_layer``, shared; ``threads``: the attention's, as for ``paged_attention``.
    ``handle`` is the run's id in an int64 tensor [1]: what a step passes instead of the ~8
    tensors per layer (cpu_layer.cpp says why). The kernels hold the tensors until this object
    is collected."""

    def __init__(self, norms: list[torch.Tensor], weights: list[torch.Tensor],
                 scales: list[torch.Tensor], qkv_biases: list[torch.Tensor],
                 o_biases: list[torch.Tensor], qk_norms: list[torch.Tensor],
                 k_pools: list[torch.Tensor], v_pools: list[torch.Tensor], windows: list[int],
                 scale: float, eps: float, heads: int, kv_heads: int, threads: int = 0) -> None:
        ops = torch.ops.minisgl_cpu
        self.handle: torch.Tensor = ops.bind_layers(norms, weights, scales, qkv_biases, o_biases,
                                                    qk_norms, k_pools, v_pools, windows, scale,
                                                    eps, heads, kv_heads, threads)
        self.num_layers = len(k_pools)
        # a C function, not an op: the collector may run this while the thread traces a graph
        # (under the fake-tensor mode, which refuses real tensors); no Python frame either
        unbind = ctypes.CFUNCTYPE(None, ctypes.c_int64)(ops.unbind_layers_address())
        weakref.finalize(self, unbind, int(self.handle[0]))


def decoder_layers(run: LayerRun, x: torch.Tensor, residual: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, out_loc: torch.Tensor,
                   slots: torch.Tensor, kv_lens: torch.Tensor, q_start: torch.Tensor,
                   q_lens: torch.Tensor, rows: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers of ``run`` in one call, each as ``decoder_layer``; returns the last one's
    (output, residual). The rest as for ``decoder_layer``, shared by the layers. ``rows``
    (int64, rows of x): the last layer's (output, residual) of those rows only, in that order;
    every row's K/V is stored, the last layer's attention, O and MLP run for them alone (a
    prefill step's sampled rows; see ``layer_into`` in cpu_layer.cpp)."""
    y, r = torch.ops.minisgl_cpu.decoder_layers(x, residual, run.handle, cos, sin, out_loc,
                                                slots, kv_lens, q_start, q_lens, rows)
    return y, r
