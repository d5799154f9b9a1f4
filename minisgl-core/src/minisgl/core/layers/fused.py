"""A model's decoder layers in one call for the steps a backend's kernels cover (registered by
them).

A Llama-family decoder layer is ten kernels: RMSNorm, QKV, RoPE and the K/V store, attention,
O, the residual add and RMSNorm, gate-up, SiLU-and-mul, down. In a batch-1 CPU decode step the
Python and dispatch between them (the compiled graph's wrapper, Inductor's small kernels, their
buffers) took ~1/5 of the step while the memory bus idled (docs/benchmarks.md); one call per
layer still cost ~8 us of dispatch each, and one call taking every layer's weights ~0.67 us per
tensor. So a backend may register ``bind(layers, backend)``, asked once per model when its
weights are final (``CausalLM.bind``): a function ``fn(x, residual, cos_sin, ctx)`` that returns
the ``(output, new residual)`` of the run of layers ``layers`` (their parts, in order) in one
call, or None where a step is not its backend's; or None where it does not apply at all (weights
in a layout its kernel does not read, tensor parallelism). The model runs its modules wherever
there is no answer. minisgl-backends registers one for its CPU kernels' steps, prefill and
decode (``MINISGL_FUSED_LAYER=off`` keeps the modules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minisgl.core.attention import AttentionBackend, ForwardContext
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


# fn(x, residual, cos_sin, ctx) -> (output, new residual), or None: run the modules
FusedLayers = Callable[[torch.Tensor, "torch.Tensor | None", CosSin, ForwardContext],
                       "tuple[torch.Tensor, torch.Tensor] | None"]
BindFusedLayers = Callable[[Sequence[DecoderLayerParts], AttentionBackend], "FusedLayers | None"]
_bind: BindFusedLayers | None = None


def register_fused_decoder_layers(bind: BindFusedLayers | None) -> None:
    """Ask ``bind`` for every model's decoder layers bound from now on (None: the modules only)."""
    global _bind
    _bind = bind


def bind_fused_decoder_layers(layers: Sequence[DecoderLayerParts], backend: AttentionBackend
                              ) -> FusedLayers | None:
    """The layers' one call with ``backend`` (weights final), or None: run the modules."""
    return None if _bind is None else _bind(layers, backend)
