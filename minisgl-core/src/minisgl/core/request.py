"""Request state (Req) and the batch the scheduler hands to the engine (Batch)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.core.sampling_params import SamplingParams

_rid_counter = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One generation request. KV for ``all_ids[:num_computed]`` lives in the cache."""

    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    rid: int = field(default_factory=lambda: next(_rid_counter))
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # per output token, the params.top_logprobs most likely (token id, log-prob) pairs
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed: int = 0  # tokens whose K/V are in the cache
    table_row: int = -1  # row of the req -> token-slot table, -1 when not held
    pages: list[int] = field(default_factory=list)  # KV pages covering all_ids, in order
    num_shared: int = 0  # leading pages owned by the prefix cache (locked through `handle`)
    handle: Any = None  # locked prefix-cache node
    prefill_target: int = 0  # prefill computes all_ids[:prefill_target] (set at admission)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    admissions: int = 0  # > 1 once a retracted request was resumed
    generator: torch.Generator | None = None
    ngrams: Any = None  # speculative.NgramIndex of all_ids, built on the first draft

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building all_ids (a decode step needs one token of a
        context of thousands, for every request)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p: end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_seq_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        """True until the prefill target is computed (chunked prefill may take several steps).

        The target is the whole prompt, or prompt + output so far for a retracted request that
        is resumed."""
        return self.num_computed < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def check_stop(self, pos: int, max_model_len: int) -> None:
        """Set ``finish_reason`` if output token number ``pos`` (resolved) ends the request."""
        token, p = self.output_ids[pos], self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish_reason = "stop"
        elif pos + 1 >= p.max_tokens or len(self.prompt_ids) + pos + 1 >= max_model_len:
            self.finish_reason = "length"

    def sampling_view(self, resolve: Callable[[int], int]) -> Req:
        """A copy for the sampler with placeholder output ids (overlap scheduling) resolved."""
        outs = [t if t >= 0 else resolve(t) for t in self.output_ids]
        return Req(self.prompt_ids, self.params, self.eos_token_ids, rid=self.rid,
                   output_ids=outs, generator=self.generator)


@dataclass
class Batch:
    """What one forward step computes, passed explicitly to the engine.

    ``extend_lens[i]`` new tokens of ``reqs[i]`` are computed, starting at ``reqs[i].num_computed``.
    A decode batch has every extend_len 1. ``sample[i]`` is False for a prefill chunk that does not
    reach the end of its prompt (no token is produced for it this step). A step that checks
    speculative drafts (phase "prefill", one input token + ``drafts[i]`` per request) samples
    after every one of its tokens; ``drafts`` is empty in every other step.
    """

    phase: str  # "prefill" | "decode"
    reqs: list[Req]
    extend_lens: list[int]
    sample: list[bool]
    # filled at launch: output position and future-buffer slot of each sampled request's token
    out_pos: list[int] = field(default_factory=list)
    future_slots: list[int] = field(default_factory=list)
    release_after: list[Req] = field(default_factory=list)  # finished while this step ran
    drafts: list[list[int]] = field(default_factory=list)  # per request: tokens guessed to follow
    rng_states: list[Any] = field(default_factory=list)  # per request with drafts: generator state

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def rows(self, i: int) -> int:
        """Tokens sampled for ``reqs[i]`` in this step."""
        return (1 + len(self.drafts[i]) if self.drafts else 1) if self.sample[i] else 0

    @classmethod
    def decode(cls, reqs: list[Req]) -> Batch:
        return cls("decode", reqs, [1] * len(reqs), [True] * len(reqs))

    @classmethod
    def verify(cls, reqs: list[Req], drafts: list[list[int]]) -> Batch:
        """A decode step whose requests also compute their drafts (speculative.py); the
        generators of sampled requests with a draft are saved, to be wound to the kept tokens."""
        states = [r.generator.get_state() if d and not r.params.greedy and r.generator is not None
                  else None for r, d in zip(reqs, drafts)]
        return cls("prefill", reqs, [1 + len(d) for d in drafts], [True] * len(reqs),
                   drafts=drafts, rng_states=states)
