from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# fn(x, residual, weight, eps) -> (normed, x + residual), for CPU bf16 rows
AddRMSNorm = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, float],
                      tuple[torch.Tensor, torch.Tensor]]
_kernel: AddRMSNorm | None = None


def register_rms_norm(fn: AddRMSNorm | None) -> None:
    """``fn(x, residual, weight, eps)`` for CPU bf16 ``x`` [..., H] (``residual`` bf16 like x or
    None, ``weight`` bf16 [H]) returns ``RMSNorm.forward``'s pair, each value rounded as its
    PyTorch ops round it, in one call. The CPU kernels register theirs: the model's final norm
    between the layers' one call and the LM head was 8 small operators (~0.1 ms of a batch-1
    decode step, each one's code and data back from DRAM after the weights' stream). Used in
    eager steps; None goes back to torch."""
    global _kernel
    _kernel = fn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like HF; ``forward(x, residual)`` fuses the residual add."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual). With ``residual``, x is added to it first."""
        if (_kernel is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16
                and self.weight.dtype == torch.bfloat16
                and (residual is None or residual.dtype == torch.bfloat16)
                and not torch.compiler.is_compiling()):
            normed, new_residual = _kernel(x, residual, self.weight, self.eps)
            return normed, x if residual is None else new_residual  # (x itself, as below)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
