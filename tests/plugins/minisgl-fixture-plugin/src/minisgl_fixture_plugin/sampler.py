"""A sampler plugin with a rule a test can check independently of minisgl."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.core.request import Req
from minisgl.core.sampling import SampleOutput, Sampler


class LowestOfTopTwoSampler(Sampler):
    """Picks the lower token id of the two highest logits; ignores the sampling parameters.

    Log-probs are those of the chosen token under ``log_softmax`` of the raw logits.
    """

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleOutput:
        if logits.shape[0] != len(reqs):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(reqs)} requests")
        raw = logits[:, : self.vocab_size].float()
        tokens = raw.topk(2, dim=-1).indices.min(dim=-1).values
        logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return SampleOutput(tokens.cpu(), logprobs.cpu())
