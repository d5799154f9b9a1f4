"""Typed messages between the server's processes (msgspec structs over ZMQ; never pickle).

Flow (one rank)::

    API --GenerateReq/Abort/StatsQuery--> tokenizer --TokenizedReq/Abort/StatsQuery--> scheduler
    scheduler --Accepted/TokenBatch/Error/Ready/Heartbeat/Stats--> detokenizer --(same, as text)--> API
    detokenizer --Abort (a stop string matched)--> scheduler
    tokenizer --Error/Ready--> API;  any process --Fatal--> API (it is about to exit)

Every struct is tagged with its class name; ``VERSION`` is checked on decode so that processes of
different minisgl versions never misread each other.
"""

from __future__ import annotations

from typing import Any

import msgspec

VERSION = 1


class Msg(msgspec.Struct, tag=True, kw_only=True):
    v: int = VERSION


class Params(msgspec.Struct, kw_only=True):
    """SamplingParams fields (minisgl.core.sampling_params), already validated by the API."""

    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    top_logprobs: int = 0
    logprobs: bool = False  # send per-token log-probs back at all


class GenerateReq(Msg, kw_only=True):
    """API -> tokenizer. Exactly one of text / messages / input_ids is set."""

    rid: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None  # chat: {"role", "content": str} each
    input_ids: list[int] | None = None
    params: Params
    stop: list[str] = []  # stop strings, cut from the text (detokenizer)
    skip_special_tokens: bool = True
    field: str = "prompt"  # request field named in errors about the prompt
    echo: bool = False  # completions' echo: the prompt's text comes back with the first output


class TokenizedReq(Msg, kw_only=True):
    """tokenizer -> scheduler."""

    rid: str
    input_ids: list[int]
    params: Params
    stop: list[str] = []
    skip_special_tokens: bool = True
    field: str = "prompt"
    echo: str | None = None  # the prompt's text, to send back (GenerateReq.echo)


class Abort(Msg, kw_only=True):
    """Stop a request and free its KV pages (client gone, stop string matched, shutdown)."""

    rid: str


class StatsQuery(Msg, kw_only=True):
    qid: str


class Accepted(Msg, kw_only=True):
    """scheduler -> detokenizer: a request passed validation; its outputs follow."""

    rid: str
    prompt_tokens: int
    stop: list[str] = []
    skip_special_tokens: bool = True
    logprobs: bool = False
    echo: str | None = None


class TokenOut(msgspec.Struct, array_like=True):
    rid: str
    token_ids: list[int]  # new tokens since the last TokenOut of this request
    logprobs: list[float]  # one per token (empty unless asked)
    top_logprobs: list[list[tuple[int, float]]]  # per token (empty unless asked)
    finish_reason: str | None  # "stop" | "length" | "abort" on the last message of a request
    cached_tokens: int


class TokenBatch(Msg, kw_only=True):
    """scheduler -> detokenizer: the outputs of one scheduler step."""

    items: list[TokenOut]


class LogprobEntry(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int]  # the token's raw bytes (may be part of a UTF-8 character)
    top: list[tuple[str, float, list[int]]]  # (token, logprob, bytes), most likely first
    hidden: bool = False  # a special token the text leaves out (skip_special_tokens)


class TextOut(Msg, kw_only=True):
    """detokenizer -> API: text ready for the client (never a broken UTF-8 sequence)."""

    rid: str
    text: str  # new text since the last TextOut
    token_ids: list[int]  # new tokens since the last TextOut
    logprobs: list[LogprobEntry] = []
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    cached_tokens: int = 0
    echo: str | None = None  # the prompt's text, on a request's first TextOut when asked


class TextBatch(Msg, kw_only=True):
    """detokenizer -> API: the TextOuts of one scheduler step, in one message."""

    items: list[TextOut]


class Error(Msg, kw_only=True):
    """A request that cannot run: the API answers it with ``status`` and OpenAI's error body."""

    rid: str
    status: int
    message: str
    param: str | None = None


class Ready(Msg, kw_only=True):
    """A process finished loading. ``info`` describes the engine (from the scheduler)."""

    process: str
    info: dict[str, Any] = {}


class Heartbeat(Msg, kw_only=True):
    """scheduler -> detokenizer -> API, about once a second between steps: the engine is alive
    (a hung one stops sending; the launcher then fails the deployment after --engine-timeout)."""


class Stats(Msg, kw_only=True):
    qid: str
    stats: dict[str, Any]


class Fatal(Msg, kw_only=True):
    """A process hit an error it cannot recover from and is about to exit."""

    process: str
    message: str


AnyMsg = (GenerateReq | TokenizedReq | Abort | StatsQuery | Accepted | TokenBatch | TextOut
          | TextBatch | Error | Ready | Heartbeat | Stats | Fatal)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AnyMsg)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Any:
    msg = _decoder.decode(data)
    if msg.v != VERSION:
        raise ValueError(f"message {type(msg).__name__} has version {msg.v}, expected {VERSION}")
    return msg
