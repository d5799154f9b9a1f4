"""Tensor-parallel linear layers. Weights are [out, in] like HF; loaders read only this rank's part.

Column parallel: each rank holds a slice of the outputs (no communication).
Row parallel: each rank holds a slice of the inputs; partial outputs are summed (all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core.distributed import Communicator
from minisgl.core.layers.activation import SiluAndMul
from minisgl.core.layers.quant import QuantizableLinear
from minisgl.core.weights import WeightSource, read, shape_of

_silu_and_mul = SiluAndMul()


def divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({parts})")
    return n // parts


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T (+ b) with W split by output rows. ``out_sizes`` > 1 entries = merged projections;
    each is split across ranks separately and loaded with ``shard_id`` = its index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, comm: Communicator,
                 name: str = "linear") -> None:
        super().__init__()
        tp = comm.world_size
        self.comm = comm
        self.local_sizes = [divide(n, tp, f"{name} output size") for n in out_sizes]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(out_sizes))]
        total = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(total), requires_grad=False) if bias else None

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this layer's local output, start in the checkpoint tensor, size)."""
        size = self.local_sizes[shard_id]
        return self.offsets[shard_id], self.comm.rank * size, size

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: int = 0) -> None:
        dst_off, start, size = self.shard_range(shard_id)
        param.data[dst_off: dst_off + size].copy_(read(src, 0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_proj + up_proj as one matmul (shard ids 0 and 1)."""

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output: one call of the registered kernel's gated
        form where it has one (on AMX tiles the [.., 2 * d] output is never written), else
        ``SiluAndMul`` of ``forward``."""
        y = self.gated_matmul(x) if self.bias is None else None
        return _silu_and_mul(self(x)) if y is None else y


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matmul, split by heads. With fewer KV heads than ranks, each
    KV head is replicated on ``tp / num_kv_heads`` ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 comm: Communicator) -> None:
        tp = comm.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = comm.rank * self.num_kv_heads
        else:
            replicas = divide(tp, num_kv_heads, f"tp size vs num_key_value_heads={num_kv_heads}:"
                              " tp size")
            self.num_kv_heads = 1
            self.kv_head_start = comm.rank // replicas
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden, [q * tp, kv * tp, kv * tp], bias, comm, "qkv")
        self.local_sizes = [q, kv, kv]
        self.offsets = [0, q, q + kv]

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        size = self.local_sizes[shard_id]
        if shard_id == 0:
            return 0, self.comm.rank * size, size
        return self.offsets[shard_id], self.kv_head_start * self.head_dim, size


class RowParallelLinear(QuantizableLinear):
    """y = all_reduce(x_local W_local^T) + b, W split by input columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Communicator,
                 name: str = "linear") -> None:
        super().__init__()
        self.comm = comm
        self.in_local = divide(in_features, comm.world_size, f"{name} input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: int = 0) -> None:
        if param is self.bias or len(shape_of(src)) == 1:
            param.data.copy_(read(src))
        else:
            param.data.copy_(read(src, 1, self.comm.rank * self.in_local, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.comm.world_size > 1:
            y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias
