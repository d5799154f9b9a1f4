"""The scheduler loop: admission, batch building (prefill chunks / decode), finishing.

``step()`` runs one forward and returns the requests that changed; a driver (the offline LLM, or
later a server process) calls it in a loop and feeds new requests in between.
"""

from __future__ import annotations

import torch

from minisgl.core.engine import Engine
from minisgl.core.policy import SchedulePolicy
from minisgl.core.request import Batch, Req, Status


class Scheduler:
    def __init__(self, engine: Engine, policy: SchedulePolicy | None = None) -> None:
        self.engine = engine
        self.config = engine.config
        if policy is None:
            policy = engine.plugins.schedulers.get(self.config.schedule_policy)(self.config)
        self.policy = policy
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted: prefilling (maybe chunked) or decoding
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
        need, have = self._pages_needed(req), self.engine.allocator.capacity
        if need > have:
            raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({req.params.max_tokens}) "
                             f"needs {need} KV pages but the pool holds {have}")

    def add(self, req: Req) -> None:
        self.validate(req)
        if req.generator is None:
            seed = req.params.seed
            if seed is None:  # reproducible per engine: derived from the engine seed
                seed, self._seed_counter = self.config.seed * 1_000_003 + self._seed_counter, self._seed_counter + 1
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

    # -- KV bookkeeping ----------------------------------------------------------------------
    def _pages_needed(self, req: Req) -> int:
        tokens = min(req.max_seq_len, self.engine.max_model_len)
        return -(-tokens // self.config.page_size)

    def _admit(self, req: Req) -> bool:
        """Reserve a table row and the pages for the request's whole lifetime."""
        table, alloc = self.engine.table, self.engine.allocator
        if table.num_free == 0:
            return False
        pages = alloc.alloc(self._pages_needed(req))
        if pages is None:
            return False
        row = table.alloc()
        assert row is not None
        req.table_row, req.pages = row, pages
        table.write_pages(req.table_row, 0, pages, self.config.page_size)
        req.status = Status.RUNNING
        return True

    def _finish(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.pages:
            self.engine.allocator.free(req.pages)
            req.pages = []
        if req.table_row >= 0:
            self.engine.table.free(req.table_row)
            req.table_row = -1
        req.status = Status.FINISHED

    # -- batch building ----------------------------------------------------------------------
    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        # unfinished chunked prefills continue first, then new requests in policy order
        candidates = [r for r in self.running if r.in_prefill] + self.policy.order(self.waiting)
        for req in candidates:
            if budget <= 0:
                break
            if req.status is Status.WAITING:
                if len(self.running) >= self.config.max_running_requests or not self._admit(req):
                    break  # head-of-line: keep arrival order fair
                self.waiting.remove(req)
                self.running.append(req)
            n = min(len(req.prompt_ids) - req.num_computed, budget)
            reqs.append(req)
            lens.append(n)
            budget -= n
        if not reqs:
            return None
        sample = [r.num_computed + n == len(r.prompt_ids) for r, n in zip(reqs, lens)]
        return Batch("prefill", reqs, lens, sample)

    def _schedule_decode(self) -> Batch | None:
        reqs = [r for r in self.running if not r.in_prefill]
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
        tokens = out.tokens.tolist() if out is not None else []
        logprobs = out.logprobs.tolist() if out is not None else []
        changed: list[Req] = []
        k = 0
        for req, n, sample in zip(batch.reqs, batch.extend_lens, batch.sample):
            req.num_computed += n
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
