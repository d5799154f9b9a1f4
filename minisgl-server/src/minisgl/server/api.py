"""The API server process: a starlette app (OpenAI-compatible + native /generate) on uvicorn.

It owns no model: prompts go to the tokenizer process over ZMQ, and text comes back from the
detokenizer. ``Pipeline`` is the asyncio side of those sockets; the routes turn HTTP into
GenerateReq messages and TextOut messages into JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from minisgl.server.ipc import Endpoints
from minisgl.server.messages import (
    Abort,
    Error,
    Fatal,
    GenerateReq,
    Heartbeat,
    Ready,
    Stats,
    StatsQuery,
    TextBatch,
    TextOut,
    decode,
    encode,
)
from minisgl.server.protocol import (
    APIError,
    ModelInfo,
    Parsed,
    parse_chat,
    parse_completion,
    parse_generate,
)


class Pipeline:
    """The API's end of the process pipeline: submit requests, receive their events.

    Every sub-request (rid) is routed to the asyncio queue of the HTTP request that made it.
    Events are TextOut or Error messages; a dead pipeline puts an Error with status 503.
    """

    def __init__(self, ep: Endpoints, served_name: str, defaults: dict[str, Any]) -> None:
        self.ctx = zmq.asyncio.Context()
        # Every scheduler step's text arrives here: a plain socket drained by an event-loop
        # reader callback, without zmq.asyncio's future and callbacks per message.
        self.pull = zmq.Context.shadow(self.ctx.underlying).socket(zmq.PULL)
        self.pull.bind(ep.api)
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(ep.tokenizer)
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.stats_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready: set[str] = set()
        self.info: ModelInfo | None = None
        self.served_name, self.defaults = served_name, defaults
        self.dead: str | None = None  # why the deployment can no longer serve
        self.closing = False
        self.pids: dict[str, int] = {}  # child process name -> pid (set by the launcher)
        self.last_heartbeat = 0.0  # monotonic time of the scheduler's last sign of life

    @property
    def healthy(self) -> bool:
        return self.info is not None and {"tokenizer", "scheduler"} <= self.ready \
            and self.dead is None and not self.closing

    async def receive_forever(self) -> None:
        """Dispatch every message from the pipeline until cancelled."""
        loop = asyncio.get_running_loop()
        fd = self.pull.getsockopt(zmq.FD)
        self._reader = (loop, fd)
        loop.add_reader(fd, self._drain)
        self._drain()  # what arrived before the reader was registered
        try:
            await loop.create_future()  # forever: the reader does the work
        finally:
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self._reader is not None:
            loop, fd = self._reader
            self._reader = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    def _drain(self) -> None:
        """Every message queued on the socket (its FD signals edges: read until none is left)."""
        while self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            data = self.pull.recv(zmq.NOBLOCK)
            try:
                self.dispatch(decode(data))
            except Exception as e:  # a bad message must not stop the others
                print(f"minisgl api: dropped a message from the pipeline: {e!r}", flush=True)

    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, TextBatch):
            for out in msg.items:
                queue = self.queues.get(out.rid)
                if queue is not None:
                    queue.put_nowait(out)
        elif isinstance(msg, Error):
            queue = self.queues.get(msg.rid)
            if queue is not None:
                queue.put_nowait(msg)
        elif isinstance(msg, Heartbeat):
            self.last_heartbeat = time.monotonic()
        elif isinstance(msg, Ready):
            self.ready.add(msg.process)
            self.last_heartbeat = time.monotonic()
            if msg.process == "scheduler":
                self.info = ModelInfo(self.served_name, msg.info["max_model_len"],
                                      self.defaults)
        elif isinstance(msg, Stats):
            fut = self.stats_waiters.pop(msg.qid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, Fatal):
            self.fail(f"the {msg.process} process failed: {msg.message}")

    def submit(self, req: GenerateReq, queue: asyncio.Queue[Any]) -> None:
        self.queues[req.rid] = queue
        self.push.send(encode(req))

    def done(self, rid: str, abort: bool) -> None:
        """Forget ``rid``; tell the scheduler to stop it if it may still run."""
        self.queues.pop(rid, None)
        if abort and self.dead is None and not self.push.closed:
            self.push.send(encode(Abort(rid=rid)))

    async def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        qid = uuid.uuid4().hex
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.stats_waiters[qid] = fut
        self.push.send(encode(StatsQuery(qid=qid)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.stats_waiters.pop(qid, None)

    def close(self) -> None:
        self._stop_reading()
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()

    def fail(self, reason: str) -> None:
        """The deployment is broken: every request in flight ends with a 503 error."""
        if self.dead is None:
            self.dead = reason
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(Error(rid=rid, status=503, message=reason))

    def abort_all(self) -> None:
        """Shutting down: every request in flight ends now with finish_reason "abort"."""
        self.closing = True
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(TextOut(rid=rid, text="", token_ids=[], finish_reason="abort"))
            self.done(rid, abort=True)


# -- HTTP plumbing -------------------------------------------------------------------------------
def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_json(request: Request, limit: int) -> Any:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None


_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    """One server-sent event: compact UTF-8 JSON (msgspec; ~10x faster than ``json.dumps`` here)."""
    return b"data: " + _json.encode(obj) + b"\n\n"


@dataclass
class _Choice:
    """The state of one choice (sub-request) of an HTTP request."""

    rid: str
    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    text_len: int = 0  # characters in ``text``
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False  # streaming: the role delta was sent
    echo: str = ""  # the prompt's text (echo), from the first TextOut

    def absorb(self, out: TextOut) -> None:
        if out.echo is not None:
            self.echo = out.echo
        self.text.append(out.text)
        self.text_len += len(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.finish_reason = out.finish_reason
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)


def usage(choices: list[_Choice]) -> dict[str, Any]:
    firsts = {c.prompt_index: c for c in reversed(choices)}  # a prompt counts once, whatever n
    prompt = sum(c.prompt_tokens for c in firsts.values())
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts.values())}}


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    def one(tok: str, lp: float, raw: list[int]) -> dict[str, Any]:
        return {"token": tok, "logprob": lp, "bytes": raw}
    return {"content": [dict(one(e.token, e.logprob, e.bytes),
                             top_logprobs=[one(*t) for t in e.top]) for e in entries]}


def completion_logprobs(entries: list[Any], offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += 0 if e.hidden else len(e.token)  # a hidden special token is not in the text
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, v, _ in e.top} for e in entries], "text_offset": offsets}


class Generation:
    """One HTTP generation request fanned out into prompts x n sub-requests."""

    def __init__(self, pipe: Pipeline, parsed: Parsed, kind: str) -> None:
        self.pipe, self.parsed, self.kind = pipe, parsed, kind
        self.id = {"chat": "chatcmpl-", "completion": "cmpl-", "generate": ""}[kind] + uuid.uuid4().hex
        self.created = int(time.time())
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.choices: dict[str, _Choice] = {}
        seed = parsed.params.seed
        for p, prompt in enumerate(parsed.prompts):
            for i in range(parsed.n):
                rid = f"{self.id}-{p}-{i}"
                params = parsed.params
                if seed is not None and i > 0:  # n seeded samples must still differ
                    params = msgspec.structs.replace(params, seed=seed + i)
                self.choices[rid] = _Choice(rid, p * parsed.n + i, p)
                pipe.submit(GenerateReq(rid=rid, params=params, stop=parsed.stop,
                                        skip_special_tokens=parsed.skip_special_tokens,
                                        echo=parsed.echo, **prompt), self.queue)

    @property
    def unfinished(self) -> list[_Choice]:
        return [c for c in self.choices.values() if c.finish_reason is None]

    async def next_event(self) -> TextOut:
        msg = await self.queue.get()
        if isinstance(msg, Error):
            name = self.parsed.max_tokens_name  # the scheduler calls it max_tokens
            if msg.param == "max_tokens" and name != "max_tokens":
                msg.param, msg.message = name, name + msg.message[len("max_tokens"):]
            raise APIError(msg.status, msg.message, msg.param)
        choice = self.choices[msg.rid]
        choice.absorb(msg)
        if msg.finish_reason is not None:
            self.pipe.done(msg.rid, abort=False)
        return msg

    def cancel(self) -> None:
        for c in self.unfinished:
            self.pipe.done(c.rid, abort=True)

    # -- non-streaming -----------------------------------------------------------------------
    async def collect(self, request: Request) -> dict[str, Any] | None:
        """The whole answer; None if the client disconnected first (its work is stopped)."""
        async def watch_disconnect() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        async def absorb_all() -> None:
            while self.unfinished:
                await self.next_event()

        # one task for all the events, not one per event (a task and a wait per token)
        watcher = asyncio.ensure_future(watch_disconnect())
        events = asyncio.ensure_future(absorb_all())
        try:
            await asyncio.wait({events, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not events.done():
                events.cancel()
                return None
            events.result()  # an APIError from the pipeline
        finally:
            watcher.cancel()
            self.cancel()
        return self.final_body()

    def final_body(self) -> dict[str, Any]:
        choices = sorted(self.choices.values(), key=lambda c: c.index)
        if self.kind == "generate":
            c = choices[0]
            return {"text": "".join(c.text), "output_ids": c.token_ids,
                    "meta_info": self.meta(c, c.logprobs)}
        out = []
        for c in choices:
            text = "".join(c.text)
            if self.kind == "chat":
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": chat_logprobs(c.logprobs) if self.parsed.logprobs else None,
                            "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": c.echo + text,
                            "logprobs": completion_logprobs(c.logprobs, len(c.echo))
                            if self.parsed.logprobs else None,
                            "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.pipe.served_name, "choices": out, "usage": usage(choices)}

    def meta(self, c: _Choice, entries: list[Any]) -> dict[str, Any]:
        """/generate's meta_info; logprobs as [token, logprob, [[token, logprob], ...]]."""
        meta: dict[str, Any] = {"finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                                "completion_tokens": c.completion_tokens,
                                "cached_tokens": c.cached_tokens}
        if self.parsed.logprobs:
            meta["logprobs"] = [[e.token, e.logprob, [[t, v] for t, v, _ in e.top]] for e in entries]
        return meta

    # -- streaming ---------------------------------------------------------------------------
    async def first_events(self) -> list[TextOut]:
        """Wait for every sub-request's first event, so that a request the pipeline rejects is
        answered with a plain 4xx instead of a stream."""
        waiting, early = {c.rid for c in self.choices.values()}, []
        try:
            while waiting:
                msg = await self.next_event()
                waiting.discard(msg.rid)
                early.append(msg)
        except BaseException:
            self.cancel()
            raise
        return early

    async def stream(self, early: list[TextOut]) -> AsyncIterator[bytes]:
        try:
            for msg in early:
                for chunk in self.chunks(msg):
                    yield chunk
            while self.unfinished:
                try:
                    msg = await self.next_event()
                except APIError as e:  # the deployment broke mid-stream
                    yield sse(e.body())
                    return
                for chunk in self.chunks(msg):
                    yield chunk
            if self.parsed.include_usage and self.kind != "generate":
                yield sse(self.chunk_head() | {"choices": [], "usage": usage(list(self.choices.values()))})
            yield b"data: [DONE]\n\n"
        finally:
            self.cancel()  # the client went away (or the server stops): free its KV pages

    def chunk_head(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.pipe.served_name}

    def chunks(self, msg: TextOut) -> list[bytes]:
        c = self.choices[msg.rid]
        if self.kind == "generate":
            return [sse({"text": msg.text, "output_ids": msg.token_ids,
                         "meta_info": self.meta(c, msg.logprobs)})]
        extra = {"usage": None} if self.parsed.include_usage else {}
        out = []
        if self.kind == "chat":
            if not c.started:
                c.started = True
                out.append(sse(self.chunk_head() | {"choices": [{
                    "index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]} | extra))
            if msg.text or msg.finish_reason or msg.logprobs:
                out.append(sse(self.chunk_head() | {"choices": [{
                    "index": c.index, "delta": {"content": msg.text} if msg.text else {},
                    "logprobs": chat_logprobs(msg.logprobs) if self.parsed.logprobs else None,
                    "finish_reason": msg.finish_reason}]} | extra))
            return out
        text = msg.text
        if not c.started:
            c.started = True
            text = c.echo + text
        if text or msg.finish_reason or msg.logprobs:
            offset = len(c.echo) + c.text_len - len(msg.text)
            out.append(sse(self.chunk_head() | {"choices": [{
                "index": c.index, "text": text,
                "logprobs": completion_logprobs(msg.logprobs, offset) if self.parsed.logprobs
                else None, "finish_reason": msg.finish_reason}]} | extra))
        return out


# -- the app -------------------------------------------------------------------------------------
def build_app(pipe: Pipeline, api_key: str | None = None,
              max_body_bytes: int = 8 * 1024 * 1024) -> Starlette:
    def check(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        if pipe.dead is not None:
            raise APIError(503, f"the server cannot serve requests: {pipe.dead}")
        if not pipe.healthy:
            raise APIError(503, "the server is starting up (or shutting down); see GET /health")

    async def generation(request: Request, kind: str) -> Response:
        try:
            check(request)
            body = await read_json(request, max_body_bytes)
            assert pipe.info is not None
            parse = {"chat": parse_chat, "completion": parse_completion,
                     "generate": parse_generate}[kind]
            parsed = parse(body, pipe.info)
            gen = Generation(pipe, parsed, kind)
            if not parsed.stream:
                result = await gen.collect(request)
                # 499 (client closed request): nobody reads it, the work was stopped
                return Response(status_code=499) if result is None else JSONResponse(result)
            early = await gen.first_events()
            return StreamingResponse(gen.stream(early), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        except APIError as e:
            return error_response(e)

    async def chat(request: Request) -> Response:
        return await generation(request, "chat")

    async def completions(request: Request) -> Response:
        return await generation(request, "completion")

    async def generate(request: Request) -> Response:
        return await generation(request, "generate")

    async def models(request: Request) -> Response:
        try:
            check(request)
        except APIError as e:
            return error_response(e)
        assert pipe.info is not None
        return JSONResponse({"object": "list", "data": [{
            "id": pipe.served_name, "object": "model", "created": int(time.time()),
            "owned_by": "minisgl", "max_model_len": pipe.info.max_model_len}]})

    async def health(request: Request) -> Response:
        if pipe.healthy:
            return JSONResponse({"status": "ok"})
        reason = pipe.dead or ("shutting down" if pipe.closing else "loading the model")
        return error_response(APIError(503, f"not ready: {reason}"))

    async def stats(request: Request) -> Response:
        """Scheduler counters (pages free / cached / held, queue lengths), for tests and ops."""
        try:
            check(request)
            return JSONResponse(await pipe.stats() | {"pids": pipe.pids})
        except APIError as e:
            return error_response(e)
        except asyncio.TimeoutError:
            return error_response(APIError(503, "the scheduler did not answer within 10 s"))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error_response(APIError(404, f"no route {request.url.path}", code="not_found"))
        if exc.status_code == 405:
            return error_response(APIError(
                405, f"method {request.method} is not allowed on {request.url.path}",
                code="method_not_allowed"))
        return error_response(APIError(exc.status_code, str(exc.detail)))

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
