"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core.distributed import Communicator
from minisgl.core.layers.quant import QuantizableLinear
from minisgl.core.weights import WeightSource, read, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, comm: Communicator) -> None:
        super().__init__()
        self.comm, self.vocab_size = comm, vocab_size
        self.vocab_local = -(-vocab_size // comm.world_size)  # last rank may be partly padding
        self.vocab_start = comm.rank * self.vocab_local
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: int = 0) -> None:
        n = max(0, min(self.vocab_local, shape_of(src)[0] - self.vocab_start))
        param.data[:n].copy_(read(src, 0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding, QuantizableLinear):
    """hidden -> logits over the full vocabulary (local slice, then all-gather)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
