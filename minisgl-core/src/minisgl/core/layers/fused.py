"""A model's decoder layers in one call for the steps a backend's kernels cover (registered by
them).

A Llama-family decoder layer is ten kernels: RMSNorm, QKV, RoPE and the K/V store, attention,
O, the residual add and RMSNorm, gate-up, SiLU-and-mul, down. In a batch-1 CPU decode step the
Python and dispatch between them (the compiled graph's wrapper, Inductor's small kernels, their
buffers) took ~1/5 of the step while the memory bus idled (docs/benchmarks.md); one call per
layer still cost ~8 us of dispatch each. A backend may register ``fn(layers, x, residual,
cos_sin, ctx)``: the ``(output, new residual)`` of the run of layers ``layers`` (their parts, in
order) computed in one call, or None where it does not apply (another backend's metadata,
weights in a layout its kernel does not read, tensor parallelism); the model then runs its
modules. minisgl-backends registers one for its CPU kernels' steps, prefill and decode
(``MINISGL_FUSED_LAYER=off`` keeps the modules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minisgl.core.attention import ForwardContext
from minisgl.core.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minisgl.core.layers.norm import RMSNorm

CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DecoderLayerParts:
    """The modules of a pre-norm decoder layer with a gated SiLU MLP, in the order they run."""

    layer_id: int
    in_norm: RMSNorm
    qkv: QKVParallelLinear
    o: RowParallelLinear
    post_norm: RMSNorm
    gate_up: MergedColumnParallelLinear
    down: RowParallelLinear
    q_norm: RMSNorm | None = None  # RMSNorm on each head of q and k before RoPE (Qwen3)
    k_norm: RMSNorm | None = None


FusedLayers = Callable[[Sequence[DecoderLayerParts], torch.Tensor, "torch.Tensor | None", CosSin,
                        ForwardContext], "tuple[torch.Tensor, torch.Tensor] | None"]
_fused: FusedLayers | None = None


def register_fused_decoder_layers(fn: FusedLayers | None) -> None:
    """Use ``fn`` for every model's decoder layers from now on (None: the modules only)."""
    global _fused
    _fused = fn


def fused_decoder_layers(layers: Sequence[DecoderLayerParts], x: torch.Tensor,
                         residual: torch.Tensor | None, cos_sin: CosSin, ctx: ForwardContext
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layers' (output, new residual) in one call, or None: run the modules."""
    return None if _fused is None else _fused(layers, x, residual, cos_sin, ctx)
