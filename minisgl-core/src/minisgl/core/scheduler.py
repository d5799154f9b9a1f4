"""The scheduler loop: admission, batch building (prefill chunks / decode), retraction, finishing.

``step()`` runs one forward and returns the requests that changed; a driver (the offline LLM, or
later a server process) calls it in a loop and feeds new requests in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core.engine import Engine
from minisgl.core.kv_manager import KVManager
from minisgl.core.policy import SchedulePolicy
from minisgl.core.prefix_cache import make_prefix_cache
from minisgl.core.request import Batch, Req, Status


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_tokens: int = 0  # of those, found in the prefix cache
    computed_tokens: int = 0  # tokens run through the model (prefill chunks + decode)
    retractions: int = 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    def __init__(self, engine: Engine, policy: SchedulePolicy | None = None) -> None:
        self.engine = engine
        self.config = cfg = engine.config
        if policy is None:
            policy = engine.plugins.schedulers.get(cfg.schedule_policy)(cfg)
        self.policy = policy
        self.cache = make_prefix_cache(cfg.cache, engine.allocator, cfg.page_size)
        self.kv = KVManager(engine.allocator, engine.table, self.cache, cfg.page_size)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted: prefilling (maybe chunked) or decoding
        self.stats = SchedulerStats()
        self._last_was_prefill = False
        self._seed_counter = 0

    # -- requests in and out -----------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise ValueError naming the field for a request that can never run."""
        n, limit = len(req.prompt_ids), self.engine.max_model_len
        vocab = self.engine.model_config.vocab_size
        if n == 0:
            raise ValueError("prompt: must not be empty")
        if n >= limit:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within the context "
                             f"length of {limit} tokens")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        req.params.validate()
        need = self.kv.pages_for(min(req.max_seq_len, limit))
        have = self.engine.allocator.capacity
        if need > have:  # even alone in the pool it could never finish
            raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({req.params.max_tokens}) "
                             f"needs {need} KV pages but the pool holds {have}")

    def add(self, req: Req) -> None:
        self.validate(req)
        if req.generator is None:
            seed = req.params.seed
            if seed is None:  # reproducible per engine: derived from the engine seed
                seed = self.config.seed * 1_000_003 + self._seed_counter
                self._seed_counter += 1
            req.generator = torch.Generator().manual_seed(seed)
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, rid: int) -> Req | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    req.finish_reason = "abort"
                    self._finish(req)
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_integrity(self) -> None:
        """Every KV page is free, held by exactly one running request, or owned by the cache."""
        self.cache.check_integrity(self.kv.held_pages(self.running))

    def clear_cache(self) -> None:
        """Free every page the prefix cache holds (only while nothing runs)."""
        if self.running:
            raise RuntimeError("clear_cache: requests are still running")
        self.cache.reset()

    def _finish(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
        req.status = Status.FINISHED

    def _retract(self, req: Req) -> None:
        """Preempt a running request: its computed prefix stays cached, it waits to resume."""
        self.running.remove(req)
        self.kv.release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.insert(0, req)
        self.stats.retractions += 1

    # -- batch building ----------------------------------------------------------------------
    def _admit(self, req: Req, budget: int) -> int:
        """Admit ``req`` with a first chunk of at most ``budget`` tokens; 0 if it cannot start."""
        if len(self.running) >= self.config.max_running_requests:
            return 0
        if not self.kv.admit(req):
            return 0
        chunk = min(req.prefill_target - req.num_computed, budget)
        # keep a page of decode headroom per running request, so admission rarely forces retraction
        headroom = len(self.running)
        fits = self.kv.available_pages - headroom >= self.kv.pages_for(req.num_computed + chunk) - len(req.pages)
        if not fits or not self.kv.grow(req, req.num_computed + chunk):
            self.kv.release(req)
            req.num_computed = 0
            return 0
        if req.cached_tokens == 0 and not req.output_ids:  # first admission: account the prompt
            req.cached_tokens = req.num_computed
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.cached_tokens += req.num_computed
        self.waiting.remove(req)
        self.running.append(req)
        req.status = Status.RUNNING
        return chunk

    def _shares_uncached_prefix(self, req: Req, batch: list[Req]) -> bool:
        """Would ``req`` recompute a prefix that a request of this batch is computing right now?

        Deferring it one step lets it find that prefix in the cache instead (a burst of prompts
        with one system prompt computes the system prompt once)."""
        if not self.cache.reuses:
            return False
        own = req.all_ids
        return any(_common_prefix(own, other.all_ids) - req.num_computed >= self.config.page_size
                   for other in batch)

    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        for req in [r for r in self.running if r.in_prefill]:  # unfinished chunks first
            if budget <= 0:
                break
            n = min(req.prefill_target - req.num_computed, budget)
            if not self.kv.grow(req, req.num_computed + n):
                break
            reqs.append(req)
            lens.append(n)
            budget -= n
        new: list[Req] = []
        for req in self.policy.order(self.waiting, self.cache):
            if budget <= 0:
                break
            if self._shares_uncached_prefix(req, new):
                continue
            n = self._admit(req, budget)
            if n == 0:
                break  # head-of-line: later requests would not fit either, keep order fair
            new.append(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
        if not reqs:
            return None
        sample = [r.num_computed + n == r.prefill_target for r, n in zip(reqs, lens)]
        return Batch("prefill", reqs, lens, sample)

    def _schedule_decode(self) -> Batch | None:
        reqs = [r for r in self.running if not r.in_prefill]
        for req in list(reqs):
            while req in reqs and not self.kv.grow(req, req.num_computed + 1):
                # out of KV: preempt the request that has made the least progress
                victim = min(self.running, key=lambda r: (len(r.output_ids), -r.rid))
                if victim is req and len(self.running) == 1:
                    raise RuntimeError("KV pool exhausted by a single request (validation bug)")
                self._retract(victim)
                if victim in reqs:
                    reqs.remove(victim)
        return Batch.decode(reqs) if reqs else None

    def next_batch(self) -> Batch | None:
        # Alternate with decode after a prefill step so a long (chunked) prompt never stalls
        # running requests for more than one chunk.
        decode_first = self._last_was_prefill and any(not r.in_prefill for r in self.running)
        order = (self._schedule_decode, self._schedule_prefill) if decode_first else (
            self._schedule_prefill, self._schedule_decode)
        for make in order:
            batch = make()
            if batch is not None:
                self._last_was_prefill = batch.phase == "prefill"
                return batch
        return None

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """One forward step. Returns requests that got a token or finished this step."""
        batch = self.next_batch()
        if batch is None:
            return []
        out = self.engine.step(batch)
        return self.process(batch, out.tokens.tolist() if out else [],
                            out.logprobs.tolist() if out else [])

    def process(self, batch: Batch, tokens: list[int], logprobs: list[float]) -> list[Req]:
        """Apply a step's results: advance, append sampled tokens, finish, cache prefixes."""
        changed: list[Req] = []
        k = 0
        self.stats.computed_tokens += batch.num_tokens
        for req, n, sample in zip(batch.reqs, batch.extend_lens, batch.sample):
            req.num_computed += n
            if batch.phase == "prefill":
                self.kv.cache_prefix(req)  # later requests (even in the next step) can reuse it
            if not sample:
                continue
            req.output_ids.append(tokens[k])
            req.output_logprobs.append(logprobs[k])
            k += 1
            req.check_stop()
            if req.finish_reason is None and req.seq_len >= self.engine.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                self._finish(req)
            changed.append(req)
        return changed
