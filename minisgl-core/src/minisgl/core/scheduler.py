"""The scheduler loop: admission, batch building (prefill chunks / decode), retraction, finishing.

``step()`` runs one forward and returns the requests that changed; a driver (the offline LLM, or
later a server process) calls it in a loop and feeds new requests in between.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from minisgl.core.engine import Engine
from minisgl.core.kv_manager import KVManager
from minisgl.core.policy import SchedulePolicy
from minisgl.core.prefix_cache import make_prefix_cache
from minisgl.core.request import Batch, Req, Status
from minisgl.core.sampling import SampleOutput, draw_keys
from minisgl.core.speculative import VERIFY_ROWS, accept, draft


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_tokens: int = 0  # of those, found in the prefix cache
    computed_tokens: int = 0  # tokens run through the model (prefill chunks + decode)
    retractions: int = 0
    draft_tokens: int = 0  # speculative tokens checked (speculative.py)
    accepted_tokens: int = 0  # of those, the ones that were the tokens sampled


class _NeedSync(Exception):
    """Scheduling needs the step in flight to finish first (to retract safely)."""


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
        self._inflight: deque[tuple[Batch, Future[SampleOutput | None]]] = deque()
        self._collected: list[Req] = []  # results collected early (by a sync), not yet returned
        # one worker thread runs the forward of step N while this thread builds step N+1
        self._executor = ThreadPoolExecutor(1, "minisgl-forward") if cfg.use_overlap else None
        self._last_was_prefill = False
        self._decodes_left_out = 0  # decoding requests the last mixed step had no page or row for
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
        return bool(self.waiting or self.running or self._inflight)

    def check_integrity(self) -> None:
        """Every KV page is free, held by exactly one running request, or owned by the cache."""
        pending = [r for batch, _ in self._inflight for r in batch.release_after]
        self.cache.check_integrity(self.kv.held_pages(self.running + pending))

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
        req.status = Status.FINISHED
        if req.output_ids and req.output_ids[-1] < 0:  # aborted with a token still in flight
            cut = next(i for i, t in enumerate(req.output_ids) if t < 0)
            del req.output_ids[cut:], req.output_logprobs[cut:], req.output_top_logprobs[cut:]
        self._release_when_idle(req)

    def _release_when_idle(self, req: Req) -> None:
        """Free ``req``'s pages and table row, but never while a step in flight still writes
        them: then the release waits for that step to be collected."""
        for batch, _ in self._inflight:
            if req in batch.reqs:
                batch.release_after.append(req)
                return
        self.kv.release(req)

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
        req.admissions += 1
        if req.admissions == 1:  # not a resumed (retracted) request: account the prompt once
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
        if not self.cache.reuses or not batch:
            return False
        own = req.all_ids
        cached = self.cache.match(own[: len(own) - 1]).length
        return any(_common_prefix(own, other.all_ids[:other.prefill_target]) - cached
                   >= self.config.page_size for other in batch)

    def _schedule_prefill(self) -> Batch | None:
        # mixed steps: the running requests' next tokens ride along with the prompt chunks,
        # within the step's token budget (a full step stays at max_prefill_tokens rows: measured,
        # 4,096 + 41 rows cost oneDNN's GEMMs 5% more than 4,096)
        decodes = [r for r in self.running if self._wants_token(r)] if self.config.use_mixed_steps else []
        budget = max(1, self.config.max_prefill_tokens - len(decodes))
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
        for req in self.policy.order(self.waiting, self.cache):
            if budget <= 0:
                break
            if self._shares_uncached_prefix(req, reqs):
                continue
            n = self._admit(req, budget)
            if n == 0:
                break  # head-of-line: later requests would not fit either, keep order fair
            reqs.append(req)
            lens.append(n)
            budget -= n
        if not reqs:
            return None
        sample = [r.num_computed + n == r.prefill_target for r, n in zip(reqs, lens)]
        self._decodes_left_out = 0
        rows = self.engine.prefill_graph_rows  # int8 + compile: keep the step on its graph
        sampled = sum(sample)
        for req in decodes:  # one token each, as in a decode step; one that cannot grow waits
            if rows is not None and sampled >= rows:
                self._decodes_left_out += 1
            elif self.kv.grow(req, req.num_computed + 1):  # for a decode step (which may retract)
                reqs.append(req)
                lens.append(1)
                sample.append(True)
                sampled += 1
            else:
                self._decodes_left_out += 1
        return Batch("prefill", reqs, lens, sample)

    def _wants_token(self, req: Req) -> bool:
        """Decodable and not already at a length limit (counting tokens still in flight)."""
        return (not req.in_prefill and len(req.output_ids) < req.params.max_tokens
                and req.seq_len < self.engine.max_model_len)

    def _schedule_decode(self) -> Batch | None:
        reqs = [r for r in self.running if self._wants_token(r)]
        for req in list(reqs):
            while req in reqs and not self.kv.grow(req, req.num_computed + 1):
                if self._inflight:  # retract only with nothing in flight (see _NeedSync)
                    raise _NeedSync
                # out of KV: preempt the request that has made the least progress
                victim = min(self.running, key=lambda r: (len(r.output_ids), -r.rid))
                if victim is req and len(self.running) == 1:
                    raise RuntimeError("KV pool exhausted by a single request (validation bug)")
                self._retract(victim)
                if victim in reqs:
                    reqs.remove(victim)
        if not reqs:
            return None
        return self._with_drafts(reqs) if self.config.speculative_tokens else Batch.decode(reqs)

    def _with_drafts(self, reqs: list[Req]) -> Batch:
        """The decode step of ``reqs``, with prompt-lookup drafts (speculative.py) in the rows
        that VERIFY_ROWS leaves: a small batch, bound by reading the weights, checks them almost
        for free; a large one gets none. Never past a request's max_tokens or the context."""
        spare = VERIFY_ROWS - len(reqs)
        drafts: list[list[int]] = []
        for req in reqs:
            k = min(self.config.speculative_tokens, spare,
                    req.params.max_tokens - len(req.output_ids) - 1,
                    self.engine.max_model_len - req.seq_len - 1)
            # (penalties depend on the tokens before each sampled one: drafted rows would need
            # their own views; such requests decode a token at a time)
            guess = draft(req, k) if k > 0 and not req.params.has_penalties else []
            if guess and not self.kv.grow(req, req.num_computed + 1 + len(guess)):
                guess = []
            drafts.append(guess)
            spare -= len(guess)
        if not any(drafts):
            return Batch.decode(reqs)
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        return Batch.verify(reqs, drafts)

    def next_batch(self) -> Batch | None:
        # Alternate with decode after a prefill step so a long (chunked) prompt never stalls
        # running requests for more than one chunk (a mixed step that carried every decoding
        # request stalled none).
        decode_first = self._last_was_prefill and any(self._wants_token(r) for r in self.running)
        order = (self._schedule_decode, self._schedule_prefill) if decode_first else (
            self._schedule_prefill, self._schedule_decode)
        for make in order:
            try:
                batch = make()
            except _NeedSync:
                # Retraction frees pages that a step in flight may still write: finish that step
                # first (its results are returned with this step's), then schedule again.
                self._collected.extend(self.drain())
                return self.next_batch()
            if batch is not None:
                self._last_was_prefill = batch.phase == "prefill" and not batch.drafts and (
                    not self.config.use_mixed_steps or self._decodes_left_out > 0)
                return batch
        return None

    # -- the loop ----------------------------------------------------------------------------
    # A step is launched (inputs built, state advanced, sampled tokens entered as placeholders)
    # and later collected (placeholders replaced, stops checked). Without overlap a step is
    # collected right away; with overlap the next step is built and launched while the previous
    # one still runs on the worker thread, and is collected after.
    def step(self) -> list[Req]:
        """One scheduling step. Returns requests that got a token or finished."""
        batch = self.next_batch()
        if batch is not None:
            self._launch(batch)
        changed, self._collected = self._collected, []
        if not self._inflight:
            if batch is None and not changed and self.has_work():
                # nothing can run and nothing is pending: fail loudly instead of spinning forever
                raise RuntimeError(
                    f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} running, "
                    f"{self.engine.allocator.num_free} free pages, "
                    f"{self.cache.evictable_pages} evictable")
            return changed
        if self._executor is not None and batch is not None and len(self._inflight) < 2:
            return changed  # pipeline filling: this step's results are collected next time
        return changed + self._collect()

    def _launch(self, batch: Batch) -> None:
        engine = self.engine
        inputs = engine.prepare(batch)  # reads output ids as they are now, placeholders included
        # one row per sampled token: a request checking a draft samples after each of its tokens
        sample_reqs = [r for i, r in enumerate(batch.reqs) for _ in range(batch.rows(i))]
        batch.future_slots = engine.take_future_slots(len(sample_reqs))
        self.stats.computed_tokens += batch.num_tokens
        for req, n in zip(batch.reqs, batch.extend_lens):
            prefilling = req.in_prefill  # not a decode row of a mixed step
            req.num_computed += n  # K/V for these tokens is being written by this step
            if prefilling:
                # Cache the prefix now, so the next step (built while this one runs) can reuse
                # it: every step that reads these pages runs after this one on the same worker.
                self.kv.cache_prefix(req)
        row = 0
        for i, req in enumerate(batch.reqs):
            if batch.sample[i]:  # a placeholder for the first token (drafts need no overlap)
                batch.out_pos.append(len(req.output_ids))
                req.output_ids.append(-1 - batch.future_slots[row])
                req.output_logprobs.append(0.0)
                req.output_top_logprobs.append([])
                row += batch.rows(i)
        if self._executor is None:
            fut: Future[SampleOutput | None] = Future()
            fut.set_result(engine.run(inputs, sample_reqs, batch.future_slots))
        else:
            fut = self._executor.submit(engine.run, inputs, sample_reqs, batch.future_slots)
        self._inflight.append((batch, fut))

    def _collect(self) -> list[Req]:
        batch, fut = self._inflight.popleft()
        out = fut.result()
        tokens = out.tokens.tolist() if out is not None else []
        logprobs = out.logprobs.tolist() if out is not None else []
        top_ids = top_lps = None
        if out is not None and out.top_ids is not None and out.top_logprobs is not None:
            top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        changed: list[Req] = []
        row = 0
        sampled = [i for i, s in enumerate(batch.sample) if s]
        for i, pos in zip(sampled, batch.out_pos):
            req, first, n = batch.reqs[i], row, batch.rows(i)
            row += n
            if req.finished:  # finished (or aborted) while this step ran: drop its token
                continue
            if batch.drafts:  # the sampled tokens up to the first that is not the draft's
                n = len(accept(batch.drafts[i], tokens[first: first + n]))
                self.stats.accepted_tokens += n - 1
                state = batch.rng_states[i]
                if state is not None and req.generator is not None:
                    # as if only the kept rows had drawn: a seeded request samples the same
                    # tokens with drafts as without (given the same logits)
                    req.generator.set_state(state)
                    draw_keys([req.generator] * n)
            k = req.params.top_logprobs
            for j in range(first, first + n):
                if pos == len(req.output_ids):
                    req.output_ids.append(0)
                    req.output_logprobs.append(0.0)
                    req.output_top_logprobs.append([])
                req.output_ids[pos] = tokens[j]
                req.output_logprobs[pos] = logprobs[j]
                if k and top_ids is not None and top_lps is not None:
                    req.output_top_logprobs[pos] = list(zip(top_ids[j][:k], top_lps[j][:k]))
                req.check_stop(pos, self.engine.max_model_len)
                if req.finish_reason is not None:
                    del req.output_ids[pos + 1:], req.output_logprobs[pos + 1:]
                    del req.output_top_logprobs[pos + 1:]
                    break
                pos += 1
            if batch.drafts:  # K/V of the input token and the kept draft tokens stay valid
                req.num_computed = req.seq_len - 1
            if req.finish_reason is not None:
                self._finish(req)
            changed.append(req)
        for req in batch.release_after:
            self._release_when_idle(req)
        return changed

    def drain(self) -> list[Req]:
        """Collect every step still in flight."""
        changed: list[Req] = []
        while self._inflight:
            changed.extend(self._collect())
        return changed

    def close(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
