"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core.distributed import Communicator
from minisgl.core.layers.quant import QuantizableLinear
from minisgl.core.weights import WeightSource, read, shape_of


class VocabParallelEmbedding(nn.Module):
    # rows read from a tied LM head's packed weight instead of ``weight`` (read_rows_from)
    rows_packed: torch.Tensor | None = None
    rows_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, vocab_size: int, hidden: int, comm: Communicator) -> None:
        super().__init__()
        self.comm, self.vocab_size = comm, vocab_size
        self.vocab_local = -(-vocab_size // comm.world_size)  # last rank may be partly padding
        self.vocab_start = comm.rank * self.vocab_local
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, hidden), requires_grad=False)

    def read_rows_from(self, packed: torch.Tensor,
                       rows_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Look rows up as ``rows_of(packed, ids)`` (a tied LM head's packed copy of this
        weight, which gives the same rows) and drop the float weight."""
        self.rows_packed, self.rows_of = packed, rows_of
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_of is not None and self.rows_packed is not None:
            return self.rows_of(self.rows_packed, ids)
        return F.embedding(ids, self.weight)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: int = 0) -> None:
        n = max(0, min(self.vocab_local, shape_of(src)[0] - self.vocab_start))
        param.data[:n].copy_(read(src, 0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self._lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = self._lookup(local.masked_fill(outside, 0))
        return self.comm.all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding, QuantizableLinear):
    """hidden -> logits over the full vocabulary (local slice, then all-gather)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [.., vocab] (the matmul's values: bf16 ones widened, in its call)."""
        logits = self.matmul(hidden, torch.float32)
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
