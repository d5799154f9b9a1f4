"""Weight formats of the linear layers: prepacked bf16 on CPU, weight-only int8.

Prepacking (always on for bf16 on a CPU): the weight is reordered once, at load, into a blocked
layout that a matmul kernel reads directly. Two kernels can do it, both with the arithmetic of
``F.linear`` (bf16 products, float32 accumulation):

- a kernel registered with ``register_bf16_linear`` (minisgl-backends registers its
  ``bf16_linear`` on x86 CPUs with AVX2 and FMA when its CPU kernels load; with AVX512-BF16 a
  decode step's 121 SmolLM2 weights stream at 93-98% of the machine's read speed, 1.5-1.7x
  faster than oneDNN, and it keeps up with oneDNN up to 4,096 rows; without, oneDNN has no fast
  bf16 at all), used when registered before the weights are converted
  (the engine builds the attention backend first);
- otherwise oneDNN on its own prepacked layout, where oneDNN supports bf16 on this CPU (a 1-row
  matmul streams the weight ~1.9x faster than ``F.linear`` on the plain weight).

Weight-only int8 (``--quantization int8``):

Each linear weight row (one output feature) is scaled by its largest magnitude / 127 and rounded
to int8, which halves the bytes a decode step reads compared with bf16. On CPU a kernel
registered with ``register_int8_linear`` computes every int8 linear layer, any number of rows, on
weights it reordered once at load (minisgl-backends registers its ``int8_pack`` / ``int8_linear``
when its CPU kernels load: int8 products against x scaled to 13-bit integers per row, finer than
bf16; a decode step's 121 SmolLM2 weights in 5.9-6.9 ms against 8.6-10.6 for the previous
float32-converting GEMV on AMD Zen 4, and prefill at bf16 speed, see docs/benchmarks.md). Without one (another CPU, float32 models):
``aten._weight_int8pack_mm`` up to ``INT8_MM_MAX_ROWS`` rows, above that the weight is
dequantized per call (correct, not fast); other devices always dequantize.
The LM head is quantized too; with tied embeddings the embedding keeps the float weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 [N, K], float32 scales [N]) with w ~= q * scale[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


# Without a registered int8 kernel: up to this many rows ATen's int8 matmul; beyond it, where
# it lags the bf16 GEMM (2.4x slower at 256 rows, 576 x 1536 weight, 2 cores), the weight is
# dequantized and multiplied by the GEMM.
INT8_MM_MAX_ROWS = 32
Int8Pack = Callable[[torch.Tensor], torch.Tensor]
Int8Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
_int8_kernel: tuple[Int8Pack, Int8Linear, Int8Linear | None] | None = None
_int8_widens = False


def register_int8_linear(pack: Int8Pack | None, linear: Int8Linear | None = None,
                         gated: Int8Linear | None = None, widens: bool = False) -> None:
    """Hold CPU int8 weights as ``pack(qweight [N, K] int8) -> packed`` (any layout, K even) and
    compute ``linear(x [M, K] bf16, packed, scales [N] float32, N) -> [M, N] bf16`` (x @ (qweight
    * scales[:, None]).T) for any M; None goes back to ATen. ``gated`` (optional), with the same
    arguments: ``silu(g) * u`` [M, N / 2] of that output's halves [g u] (a merged gate-up
    projection, ``MergedColumnParallelLinear.silu_mul``), silu(g) rounded to bf16 as ``F.silu``
    rounds it. ``widens``: ``linear`` also takes ``out_dtype`` (a fifth argument; float32: its
    result's values as float32, in the same call), what ``matmul(x, torch.float32)`` then
    asks of it. Only weights quantized afterwards use them. All torch ops when compiled graphs
    are to call them."""
    global _int8_kernel, _int8_widens
    if pack is not None and linear is None:
        raise ValueError("register_int8_linear: a pack function needs its linear")
    _int8_kernel = None if pack is None or linear is None else (pack, linear, gated)
    _int8_widens = widens and _int8_kernel is not None


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] * scales[:, None]).T in x's dtype, without a registered
    kernel: ATen's int8 matmul for up to ``INT8_MM_MAX_ROWS`` rows on CPU, else dequantized."""
    flat = x.reshape(-1, x.shape[-1])
    y: torch.Tensor
    if x.device.type == "cpu" and flat.shape[0] <= INT8_MM_MAX_ROWS:
        y = torch.ops.aten._weight_int8pack_mm(flat, qweight, scales.to(x.dtype))
    else:
        y = F.linear(flat, qweight.to(x.dtype) * scales.to(x.dtype)[:, None])
    return y.reshape(*x.shape[:-1], qweight.shape[0])


def int8_rows_limit(model: nn.Module) -> int | None:
    """Rows up to which ``model``'s int8 layers keep one matmul path (a compiled graph must not
    straddle a switch): ``INT8_MM_MAX_ROWS`` where some layer runs ATen's, None (any) where
    every one runs a registered kernel."""
    layers = [m for m in model.modules() if isinstance(m, QuantizableLinear) and m.qweight is not None]
    return None if all(m.qlinear is not None for m in layers) else INT8_MM_MAX_ROWS


Bf16Pack = Callable[[torch.Tensor], torch.Tensor]
Bf16Linear = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
Bf16Rows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_bf16_linear: tuple[Bf16Pack, Bf16Linear, Bf16Linear | None] | None = None
_bf16_rows: Bf16Rows | None = None
_bf16_widens = False


def register_bf16_linear(pack: Bf16Pack | None, linear: Bf16Linear | None = None,
                         gated: Bf16Linear | None = None, rows: Bf16Rows | None = None,
                         widens: bool = False) -> None:
    """Prepack CPU bf16 weights with ``pack(weight [N, K]) -> packed`` (any layout, K even) and
    compute ``linear(x [M, K], packed, N) -> [M, N]`` for any M; None goes back to oneDNN.
    ``gated`` (optional), with the same arguments: ``silu(g) * u`` [M, N / 2] of that output's
    halves, as for ``register_int8_linear``. ``rows`` (optional): ``rows(packed, ids) ->
    weight[ids]`` [*ids.shape, K], exactly, so that an embedding tied to a packed LM head reads
    its rows there and the float weight need not stay (``_convert_linears``). ``widens``:
    ``linear`` also takes ``out_dtype``, as for ``register_int8_linear``. Only weights converted
    afterwards use them. All torch ops when compiled graphs are to call them."""
    global _bf16_linear, _bf16_rows, _bf16_widens
    if pack is not None and linear is None:
        raise ValueError("register_bf16_linear: a pack function needs its linear")
    _bf16_linear = None if pack is None or linear is None else (pack, linear, gated)
    _bf16_rows = rows if _bf16_linear is not None else None
    _bf16_widens = widens and _bf16_linear is not None


def _kernel_can_pack(weight: torch.Tensor) -> bool:
    return (_bf16_linear is not None and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0)


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be prepacked: CPU bf16, for the registered kernel or for oneDNN."""
    return _kernel_can_pack(weight) or (
        weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = _linear_pointwise(x, packed, None, "none", [], "")
    return y


def _pack_token(packed: torch.Tensor) -> torch.Tensor:
    """An empty tensor carrying the packed weight as an attribute. Graphs cannot take oneDNN
    tensors as inputs (no fake tensors for them, no pickling for the compile cache), so the
    compiled decode step passes this token to ``packed_linear`` instead; tensors keep their
    Python object across the dispatcher, so the op finds the weight on it at run time."""
    token = torch.empty(0)
    token.onednn_weight = packed  # type: ignore[attr-defined]
    return token


# The op ``minisgl::packed_linear(x, token, out_features)``: ``x @ W^T`` with W the oneDNN-packed
# weight attached to ``token``, opaque to Inductor. Defined through a plain Library with a CPU
# kernel rather than ``torch.library.custom_op``, whose Python wrapper layers cost ~2.5 us more
# per call (measured, 576 x 576 weight): a decode step of SmolLM2 makes 121 of these calls.
_lib = torch.library.Library("minisgl", "DEF")  # type: ignore[no-untyped-call]
_lib.define(  # type: ignore[no-untyped-call]
    "packed_linear(Tensor x, Tensor token, int out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, token: torch.Tensor, out_features: int) -> torch.Tensor:
    packed: torch.Tensor = getattr(token, "onednn_weight")  # noqa: B009 - set dynamically
    return _onednn_linear(x, packed)


_lib.impl("packed_linear", _packed_linear, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("minisgl::packed_linear")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, token: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class QuantizableLinear(nn.Module):
    """Mixin for layers whose ``weight`` [N, K] is used as ``F.linear(x, weight)``: after
    ``quantize_int8()`` or ``prepack()`` the matmul reads the converted copy (and the float weight
    is dropped unless ``keep_float`` because something else, like a tied embedding, reads it)."""

    weight: nn.Parameter
    qweight: torch.Tensor | None = None  # int8: [N, K], or the registered kernel's layout
    qscale: torch.Tensor | None = None  # its per-row scales (float32 for the kernel)
    qlinear: Int8Linear | None = None  # the registered int8 kernel's matmul, else None: ATen's
    packed: torch.Tensor | None = None  # prepacked bf16 weight (the kernel's or oneDNN's layout)
    packed_out: int = 0  # output features of ``packed`` or of the kernel's ``qweight``
    # the registered kernel's matmul when ``packed`` is in its layout (a plain tensor, which
    # compiled graphs take as an input), else None: oneDNN's
    packed_linear: Bf16Linear | None = None
    pack_token: torch.Tensor | None = None  # stands for oneDNN's ``packed`` in compiled graphs
    # the registered kernel's gated form for ``packed`` (bf16) or ``qweight`` (int8), if it has one
    gated_linear: Bf16Linear | None = None
    gated_qlinear: Int8Linear | None = None
    # the registered kernel's row lookup in ``packed`` (weight[ids]), if it has one
    packed_rows: Bf16Rows | None = None
    widens: bool = False  # packed_linear / qlinear take out_dtype (register_bf16_linear)

    def _drop_float(self, keep_float: bool) -> None:
        if not keep_float:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def prepack(self, keep_float: bool = False) -> None:
        w = self.weight.detach()
        self.packed_out = w.shape[0]
        if _bf16_linear is not None and _kernel_can_pack(w):
            pack, self.packed_linear, self.gated_linear = _bf16_linear
            self.packed, self.packed_rows, self.widens = pack(w), _bf16_rows, _bf16_widens
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            self.pack_token = _pack_token(self.packed)
        self._drop_float(keep_float)

    def quantize_int8(self, keep_float: bool = False) -> None:
        w = self.weight.detach()
        q, s = quantize_rows(w)
        # plain attributes (not in the state dict)
        if (_int8_kernel is not None and w.device.type == "cpu" and w.dtype == torch.bfloat16
                and w.shape[1] % 2 == 0):
            pack, self.qlinear, self.gated_qlinear = _int8_kernel
            self.qweight, self.qscale, self.packed_out = pack(q), s, w.shape[0]
            self.widens = _int8_widens
        else:  # ATen's: scales in the activations' dtype (a cast inside a graph would not lower)
            self.qweight, self.qscale = q, s.to(w.dtype)
        self._drop_float(keep_float)

    def gated_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(g) * u [.., N / 2] of this layer's matmul [g u] [.., N] in one call of the
        registered kernel's gated form, or None where it has none for this layer's weight."""
        flat, n = x.reshape(-1, x.shape[-1]), self.packed_out
        y: torch.Tensor
        if self.packed is not None and self.gated_linear is not None:
            y = self.gated_linear(flat, self.packed, n)
        elif (self.qweight is not None and self.qscale is not None
              and self.gated_qlinear is not None):
            y = self.gated_qlinear(flat, self.qweight, self.qscale, n)
        else:
            return None
        return y.reshape(*x.shape[:-1], n // 2)

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ weight.T``; with ``out_dtype``, its values in that dtype (``.to(out_dtype)``),
        in the registered kernel's call where it widens (the LM head's float32 logits)."""
        y: torch.Tensor
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (each op counts: engine.py)
        widen = (out_dtype,) if self.widens and out_dtype is not None else ()
        if self.packed is not None:
            n = self.packed_out
            if self.packed_linear is not None:
                y = self.packed_linear(flat, self.packed, n, *widen)
            elif torch.compiler.is_compiling():
                y = torch.ops.minisgl.packed_linear(flat, self.pack_token, n)
            else:
                y = _onednn_linear(flat, self.packed)
            y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
        elif self.qweight is not None and self.qscale is not None:
            if self.qlinear is not None:
                y = self.qlinear(flat, self.qweight, self.qscale, self.packed_out, *widen)
                y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.packed_out)
            else:
                y = int8_linear(x, self.qweight, self.qscale)
        else:
            y = F.linear(x, self.weight)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def _convert_linears(model: nn.Module, convert: str) -> int:
    """Call ``convert`` (a QuantizableLinear method name) on every layer not converted yet;
    returns how many. A weight shared with an embedding (a tied LM head) keeps its float copy
    for the embedding, unless the layer's packed copy can give the embedding its rows
    (``packed_rows``, exact): then neither keeps it, a vocabulary x hidden matrix less (SmolLM2
    56 MiB of 270, a Qwen3-0.6B-shaped model 297 MiB of 1,137). int8 keeps it: the embedding
    stays unquantized."""
    from minisgl.core.layers.embedding import VocabParallelEmbedding

    embeddings = {id(m.weight): m for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, QuantizableLinear)}
    count = 0
    for m in list(model.modules()):
        if isinstance(m, QuantizableLinear) and m.qweight is None and m.packed is None:
            tied = embeddings.get(id(m.weight))
            getattr(m, convert)(keep_float=tied is not None)
            if tied is not None and m.packed is not None and m.packed_rows is not None:
                tied.read_rows_from(m.packed, m.packed_rows)
                m._drop_float(keep_float=False)
            count += 1
    return count


def quantize_model_int8(model: nn.Module) -> int:
    """Quantize every quantizable layer of ``model`` in place; returns how many."""
    return _convert_linears(model, "quantize_int8")


def prepack_model(model: nn.Module) -> int:
    """Prepack every linear layer (the registered kernel's layout, else oneDNN's) when all of
    their weights allow it (see ``can_prepack``); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    if not layers or not all(can_prepack(m.weight) for m in layers):
        return 0
    return _convert_linears(model, "prepack")
