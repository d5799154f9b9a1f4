"""Weight-only int8 quantization (``--quantization int8``).

Each linear weight row (one output feature) is scaled by its largest magnitude / 127 and rounded
to int8; activations stay in the model dtype. On CPU the matmul is ``aten._weight_int8pack_mm``
(int8 weights read from memory, converted in registers), which halves the bytes a decode step reads
compared with bf16. Elsewhere the weight is dequantized per call (correct, not fast).
The LM head is quantized too; with tied embeddings the embedding keeps the float weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 [N, K], float32 scales [N]) with w ~= q * scale[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


# Up to this many rows (tokens) the int8 kernel wins: it reads half the bytes of bf16 and small
# matmuls are bandwidth-bound. Beyond it the int8 kernel lags the bf16 GEMM (2.4x slower at 256
# rows, 576 x 1536 weight, 2 cores), so big batches (prefill) dequantize and use the GEMM.
INT8_MM_MAX_ROWS = 32


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] * scales[:, None]).T in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and flat.shape[0] <= INT8_MM_MAX_ROWS:
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, qweight, scales.to(x.dtype))
    else:
        y = F.linear(flat, qweight.to(x.dtype) * scales.to(x.dtype)[:, None])
    return y.reshape(*x.shape[:-1], qweight.shape[0])


class QuantizableLinear(nn.Module):
    """Mixin for layers whose ``weight`` [N, K] is used as ``F.linear(x, weight)``: after
    ``quantize_int8()`` the matmul reads the int8 copy (and the float weight is dropped unless
    ``keep_float`` because something else, like a tied embedding, still reads it)."""

    weight: nn.Parameter
    qweight: torch.Tensor | None = None
    qscale: torch.Tensor | None = None

    def quantize_int8(self, keep_float: bool = False) -> None:
        q, s = quantize_rows(self.weight)
        self.qweight, self.qscale = q, s  # plain attributes: not in the state dict
        if not keep_float:  # free the float copy
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and self.qscale is not None:
            return int8_linear(x, self.qweight, self.qscale)
        return F.linear(x, self.weight)


def quantize_model_int8(model: nn.Module) -> int:
    """Quantize every quantizable layer of ``model`` in place; returns how many."""
    from minisgl.core.layers.embedding import VocabParallelEmbedding

    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, QuantizableLinear)}
    count = 0
    for m in list(model.modules()):
        if isinstance(m, QuantizableLinear) and m.qweight is None:
            m.quantize_int8(keep_float=id(m.weight) in embeddings)
            count += 1
    return count
