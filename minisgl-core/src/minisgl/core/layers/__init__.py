"""TP-aware building blocks for models. Every layer takes a Communicator (identity at TP=1)."""

from minisgl.core.layers.activation import SiluAndMul
from minisgl.core.layers.attention import AttentionLayer
from minisgl.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.core.layers.fused import (
    DecoderLayerParts,
    FusedLayers,
    bind_fused_decoder_layers,
    register_fused_decoder_layers,
)
from minisgl.core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minisgl.core.layers.norm import RMSNorm, register_rms_norm
from minisgl.core.layers.rope import RotaryEmbedding

__all__ = [
    "AttentionLayer",
    "ColumnParallelLinear",
    "DecoderLayerParts",
    "FusedLayers",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "bind_fused_decoder_layers",
    "register_fused_decoder_layers",
    "register_rms_norm",
]
