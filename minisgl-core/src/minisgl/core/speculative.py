"""Prompt-lookup speculative decoding: drafts from the request's own tokens, checked in one step.

A decode step streams every weight of the model for the few tokens it computes, so on a CPU a
step that computes a few more tokens per request costs little more (SmolLM2, one request, 384
keys: 1 token 4.3 ms, 5 tokens 6.9 ms). When the text repeats itself (a summary quoting its
source, code edited in place, a list), the tokens that followed the last occurrence of the
request's final n-gram are a good guess at what comes next. The scheduler appends such a draft
to a decoding request's input; the step computes logits after the input token and after each
drafted token; the request keeps the sampled tokens up to and including the first one that
differs from the draft (``accept``).

Sampling stays exact: the token sampled after draft token j is drawn from the model's
distribution given everything before it, and it is only kept when all draft tokens before it
were the tokens actually sampled, so the kept tokens are a draw from the same sequence
distribution as decoding one token per step (with a deterministic draft, rejection sampling
reduces to this comparison). Greedy outputs are the same tokens as without drafts.
"""

from __future__ import annotations

from minisgl.core.request import Req

# the longest match first (replayed on real answers, 4/3/2-, 3- and 3/2/1-grams came within a
# few percent of this: docs/benchmarks.md, fiftieth sitting)
NGRAM_SIZES = (3, 2)

# The most tokens (rows) a step that checks drafts computes. On 2 Zen 5 cores a SmolLM2 step is
# bound by reading the weights up to ~16 rows and by the matmuls beyond (8 requests x 384 keys:
# 1 row each 9.9 ms, 2 each 11.3, 3 each 12.9, 5 each 18.4; 32 requests: 1 each 19.4, 2 each
# 33.9): past that, a drafted token that is rejected costs about what a token decoded costs.
VERIFY_ROWS = 16


class NgramIndex:
    """Where each n-gram of a request's tokens last ended, kept up to date as tokens arrive.

    ``last[n][gram]`` is the latest position p < len(ids) - 1 where ``ids[p-n+1 : p+1] == gram``:
    the final position is left out, so the final n-gram never finds itself."""

    def __init__(self) -> None:
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self.indexed = 0  # positions below this are in ``last``

    def update(self, req: Req) -> None:
        end = req.seq_len - 1
        if end <= self.indexed:
            return
        width = max(NGRAM_SIZES)
        lo = max(0, self.indexed - width + 1)
        ids = req.token_slice(lo, end)
        for p in range(self.indexed, end):
            for n, table in self.last.items():
                if p >= n - 1:
                    table[tuple(ids[p - n + 1 - lo: p + 1 - lo])] = p
        self.indexed = end

    def draft(self, req: Req, k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the request's last n-gram
        (the longest n of NGRAM_SIZES that occurred before); [] when none did. Where that
        continuation runs into the end of the tokens, it goes on as a copy of itself (a cycle
        of ``period`` tokens goes on cycling), as an LZ77 copy would."""
        self.update(req)
        end = req.seq_len
        width = max(NGRAM_SIZES)
        tail = req.token_slice(max(0, end - width), end)
        for n, table in self.last.items():
            if len(tail) < n:
                continue
            p = table.get(tuple(tail[len(tail) - n:]))
            if p is not None:
                guess, period = req.token_slice(p + 1, min(p + 1 + k, end)), end - 1 - p
                while len(guess) < k:
                    guess.append(guess[len(guess) - period])
                return guess
        return []


def draft(req: Req, k: int) -> list[int]:
    """``req``'s draft: ``k`` tokens, or none (its index is built on first use, then updated)."""
    if req.ngrams is None:
        req.ngrams = NgramIndex()
    index: NgramIndex = req.ngrams
    return index.draft(req, k)


def accept(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a request keeps from a step that checked ``draft``: ``sampled[j]`` is the
    token sampled after the input token and draft[:j], so the request keeps sampled[0], then
    sampled[j + 1] for as long as ``draft[j] == sampled[j]``. One to len(draft) + 1 tokens."""
    assert len(sampled) == len(draft) + 1
    n = 1
    while n <= len(draft) and draft[n - 1] == sampled[n - 1]:
        n += 1
    return sampled[:n]
