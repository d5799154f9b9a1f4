"""The scheduler process (one per rank): the engine and the scheduler loop behind ZMQ."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from minisgl.core import tp
from minisgl.core.config import EngineConfig
from minisgl.core.tp import Lockstep, start_rank
from minisgl.server.ipc import POLL_MS, Endpoints, Sockets, child_main, parent_alive
from minisgl.server.messages import (
    Abort,
    Accepted,
    Error,
    Heartbeat,
    Ready,
    Stats,
    StatsQuery,
    TokenBatch,
    TokenizedReq,
    TokenOut,
)


class SchedulerServer:
    """Turns messages into scheduler calls and finished steps into TokenBatch messages."""

    def __init__(self, config: EngineConfig, dist_addr: str, local_ranks: int,
                 socks: Sockets) -> None:
        scheduler, channel = start_rank(config, dist_addr, local_ranks)
        self.engine = scheduler.engine
        # at TP > 1, every add/abort/step is mirrored on the other ranks (minisgl.core.tp)
        self.scheduler = Lockstep(scheduler, channel)
        self.socks = socks
        self.reqs: dict[str, Any] = {}  # rid -> Req, until its last TokenOut is sent
        self.sent: dict[str, int] = {}  # rid -> output tokens already sent
        self.rid_of: dict[int, str] = {}  # Req.rid -> the API's rid
        self.want_logprobs: set[str] = set()

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"max_model_len": e.max_model_len, "num_pages": e.allocator.capacity,
                "page_size": self.scheduler.config.page_size,
                "eos_token_ids": list(e.model_config.eos_token_ids)}

    # -- messages in -------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedReq):
            self.add(msg)
        elif isinstance(msg, Abort):
            req = self.reqs.get(msg.rid)
            if req is not None and not req.finished:
                self.scheduler.abort(req.rid)
                self.emit([req])
        elif isinstance(msg, StatsQuery):
            self.socks.send("detokenizer", Stats(qid=msg.qid, stats=self.stats()))

    def add(self, msg: TokenizedReq) -> None:
        from minisgl.core.request import Req
        from minisgl.core.sampling_params import SamplingParams

        n, limit = len(msg.input_ids), self.engine.max_model_len
        p = msg.params
        try:
            if n >= limit:
                raise ValueError(f"{msg.field}: the prompt has {n} tokens, which leaves no room "
                                 f"to generate within the context length of {limit} tokens")
            # unset: the rest of the context, or of the KV pool if that is smaller
            room = min(limit, self.engine.allocator.capacity * self.scheduler.config.page_size)
            max_tokens = max(1, room - n) if p.max_tokens is None else p.max_tokens
            if n + max_tokens > limit:
                raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) "
                                 f"= {n + max_tokens} exceeds the context length of {limit} tokens")
            # the wire struct is SamplingParams' fields plus "send logprobs back at all"
            fields = msgspec.structs.asdict(p)
            del fields["logprobs"]
            sp = SamplingParams(**(fields | {"max_tokens": max_tokens}))
            req = Req(list(msg.input_ids), sp, frozenset(self.engine.model_config.eos_token_ids))
            self.scheduler.validate(req)
        except ValueError as e:
            field, _, rest = str(e).partition(":")
            if field == "prompt":  # name the field the client sent (messages, input_ids, ...)
                field = msg.field
            self.socks.send("detokenizer", Error(rid=msg.rid, status=400,
                                                 message=f"{field}:{rest}", param=field))
            return
        self.socks.send("detokenizer", Accepted(
            rid=msg.rid, prompt_tokens=n, stop=msg.stop,
            skip_special_tokens=msg.skip_special_tokens, logprobs=p.logprobs, echo=msg.echo))
        self.reqs[msg.rid] = req
        self.sent[msg.rid] = 0
        self.rid_of[req.rid] = msg.rid
        if p.logprobs:
            self.want_logprobs.add(msg.rid)
        self.scheduler.add(req)

    # -- messages out ------------------------------------------------------------------------
    def emit(self, changed: list[Any]) -> None:
        items = []
        for req in changed:
            rid = self.rid_of.get(req.rid)
            if rid is None:
                continue
            start, end = self.sent[rid], len(req.output_ids)
            for i in range(start, end):  # overlap: placeholders (< 0) at the end are in flight
                if req.output_ids[i] < 0:
                    end = i
                    break
            if end == start and not req.finished:
                continue
            lp = rid in self.want_logprobs
            items.append(TokenOut(rid, req.output_ids[start:end],
                                  req.output_logprobs[start:end] if lp else [],
                                  req.output_top_logprobs[start:end] if lp else [],
                                  req.finish_reason if req.finished else None, req.cached_tokens))
            self.sent[rid] = end
            if req.finished:
                for table in (self.reqs, self.sent):
                    del table[rid]
                del self.rid_of[req.rid]
                self.want_logprobs.discard(rid)
        if items:
            self.socks.send("detokenizer", TokenBatch(items=items))

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        try:
            s.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"broken: {e}"
        return {"running": len(s.running), "waiting": len(s.waiting),
                "num_pages": self.engine.allocator.capacity,
                "free_pages": self.engine.allocator.num_free,
                "cached_pages": s.cache.evictable_pages,
                "held_pages": len(s.kv.held_pages(s.running)),
                "prompt_tokens": s.stats.prompt_tokens, "cached_tokens": s.stats.cached_tokens,
                "computed_tokens": s.stats.computed_tokens, "retractions": s.stats.retractions,
                "draft_tokens": s.stats.draft_tokens, "accepted_tokens": s.stats.accepted_tokens,
                "integrity": integrity}

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> None:
        last_beat = 0.0
        try:
            while parent_alive():
                if time.monotonic() - last_beat > 1.0:
                    self.socks.send("detokenizer", Heartbeat())
                    last_beat = time.monotonic()
                busy = self.scheduler.has_work()
                msg = self.socks.recv(0 if busy else POLL_MS)
                while msg is not None:  # take everything that arrived before the next step
                    self.handle(msg)
                    msg = self.socks.recv(0)
                if self.scheduler.has_work():
                    self.emit(self.scheduler.step())
                else:  # TP: a heartbeat, so a rank that died is noticed while idle too
                    self.scheduler.sync()
        finally:
            self.scheduler.close()  # TP: the other ranks exit too


def run(ep: Endpoints, config: EngineConfig, dist_addr: str, local_ranks: int) -> None:
    def body() -> None:
        socks = Sockets(ep.scheduler, detokenizer=ep.detokenizer)
        server = SchedulerServer(config, dist_addr, local_ranks, socks)
        socks.send("detokenizer", Ready(process="scheduler", info=server.info()))
        server.loop()

    child_main("scheduler", ep.api, body)


def run_rank(ep: Endpoints | None, config: EngineConfig, dist_addr: str, local_ranks: int) -> None:
    """A rank > 0: mirrors rank 0's scheduler (no sockets of its own)."""
    child_main(f"rank{config.tp_rank}", ep.api if ep is not None else None,
               lambda: tp.run_rank(config, dist_addr, local_ranks))
