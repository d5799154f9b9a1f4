"""OpenAI request bodies -> internal requests, with 400s that name the bad field.

Unknown fields (user, metadata, parallel_tool_calls, ...) are ignored, as vLLM and SGLang do; a
known field with a wrong type or value is an :class:`APIError`. Defaults come from the request,
then the model's generation_config.json, then OpenAI's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from minisgl.server.messages import Params

ROLES = ("system", "user", "assistant", "developer")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else
                              "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ModelInfo:
    """What the API needs to know about the served model."""

    name: str  # --served-model-name
    max_model_len: int
    defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json


@dataclass
class Parsed:
    """One HTTP request: ``prompts`` each produce ``n`` choices."""

    prompts: list[dict[str, Any]]  # GenerateReq fields: text | messages | input_ids, + field
    params: Params
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    echo: bool = False
    skip_special_tokens: bool = True
    max_tokens_name: str = "max_tokens"  # the field the client used (max_completion_tokens)


def _bad(name: str, rule: str, value: Any) -> APIError:
    shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
    return APIError(400, f"{name}: {rule} (got {shown})", name)


class _Body:
    """Typed access to the JSON body; ``None`` means "not given" for every field."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def int(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(name, "must be an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise _bad(name, f"must be {rng}", v)
        return v

    def num(self, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _bad(name, "must be a number", v)
        if v < lo or v > hi or (lo_open and v == lo):
            raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}]", v)
        return float(v)

    def bool(self, name: str) -> bool | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, bool):
            raise _bad(name, "must be a boolean", v)
        return v

    def token_ids(self, name: str, v: Any) -> list[int]:
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              and t >= 0 for t in v):
            raise _bad(name, "must be a list of non-negative token ids", v)
        return v


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _common(b: _Body, info: ModelInfo, default_max_tokens: int | None) -> Parsed:
    """Fields shared by chat and completions."""
    model = b.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "must be a string", model)
    if model is not None and model != info.name:
        raise APIError(404, f"model '{model}' does not exist; this server serves '{info.name}'",
                       "model", "model_not_found")
    d = info.defaults
    max_tokens = _first(b.int("max_completion_tokens", 1), b.int("max_tokens", 1))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and max_tokens >= info.max_model_len:
        name = "max_completion_tokens" if b.get("max_completion_tokens") is not None else "max_tokens"
        raise _bad(name, f"must be below the context length of {info.max_model_len} tokens",
                   max_tokens)
    top_k = b.int("top_k", -1)
    if top_k == 0:
        raise _bad("top_k", "must be -1 (disabled) or an integer >= 1", 0)
    stop: Any = b.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 16
                             or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", "must be a non-empty string or a list of at most 16 of them", stop)
    stop_ids = b.get("stop_token_ids")
    if stop_ids is not None:
        stop_ids = b.token_ids("stop_token_ids", stop_ids)
    opts = b.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object", opts)
    include_usage = (opts or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "must be a boolean", include_usage)
    stream = bool(b.bool("stream"))
    if opts is not None and not stream:
        raise _bad("stream_options", "is only allowed when stream is true", opts)
    params = Params(
        max_tokens=max_tokens,
        temperature=_first(b.num("temperature", 0, 2), d.get("temperature"), 1.0),
        top_p=_first(b.num("top_p", 0, 1, lo_open=True), d.get("top_p"), 1.0),
        top_k=_first(top_k, d.get("top_k"), -1),
        min_p=_first(b.num("min_p", 0, 1), d.get("min_p"), 0.0),
        repetition_penalty=_first(b.num("repetition_penalty", 0, 2, lo_open=True),
                                  d.get("repetition_penalty"), 1.0),
        frequency_penalty=_first(b.num("frequency_penalty", -2, 2), 0.0),
        presence_penalty=_first(b.num("presence_penalty", -2, 2), 0.0),
        seed=b.int("seed"),
        stop_token_ids=stop_ids or [],
        ignore_eos=bool(b.bool("ignore_eos")),
    )
    bias = b.get("logit_bias")
    if bias:  # an empty {} (some clients always send it) is fine
        raise _bad("logit_bias", "is not supported", bias)
    skip = b.bool("skip_special_tokens")
    name = "max_completion_tokens" if b.get("max_completion_tokens") is not None else "max_tokens"
    return Parsed([], params, n=_first(b.int("n", 1, 16), 1), stop=stop or [], stream=stream,
                  include_usage=bool(include_usage), skip_special_tokens=skip is not False,
                  max_tokens_name=name)


def _message_text(i: int, msg: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _bad(where, "must be an object with role and content", msg)
    role = msg.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}", role)
    content = msg.get("content")
    if isinstance(content, list):  # content parts: only text parts can be served
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]", "must be a text part "
                           "{\"type\": \"text\", \"text\": ...}", part)
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _bad(f"{where}.content", "must be a string or a list of text parts", content)
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: Any, info: ModelInfo) -> Parsed:
    b = _Body(body)
    messages = b.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of messages", messages)
    out = _common(b, info, default_max_tokens=None)
    out.prompts = [{"messages": [_message_text(i, m) for i, m in enumerate(messages)],
                    "field": "messages"}]
    out.logprobs = bool(b.bool("logprobs"))
    top = b.int("top_logprobs", 0, 20)
    if top and not out.logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true", top)
    out.params.top_logprobs = top or 0
    out.params.logprobs = out.logprobs
    return out


def parse_completion(body: Any, info: ModelInfo) -> Parsed:
    b = _Body(body)
    prompt = b.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]  # one prompt: a string or a list of token ids
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", "must be a string, a list of strings or a list of token ids", prompt)
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            prompts.append({"text": p, "field": "prompt"})
        else:
            prompts.append({"input_ids": b.token_ids("prompt", p), "field": "prompt"})
    out = _common(b, info, default_max_tokens=16)  # OpenAI's default for completions
    out.prompts = prompts
    top = b.int("logprobs", 0, 20)  # completions: logprobs is the number of top tokens
    out.logprobs = top is not None
    out.params.top_logprobs = top or 0
    out.params.logprobs = out.logprobs
    out.echo = bool(b.bool("echo"))
    if b.get("suffix") is not None:
        raise _bad("suffix", "is not supported", b.get("suffix"))
    best_of = b.int("best_of", 1)
    if best_of is not None and best_of != out.n:
        raise _bad("best_of", "must equal n (best-of ranking is not supported)", best_of)
    return out


def parse_generate(body: Any, info: ModelInfo) -> Parsed:
    """The native /generate: {"text" | "input_ids", "sampling_params": {...}, "stream"}."""
    b = _Body(body)
    sp = b.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _bad("sampling_params", "must be an object", sp)
    fields = {k: v for k, v in sp.items() if k not in ("model", "stream", "stream_options")}
    alias = "max_new_tokens" in fields  # SGLang's name for max_tokens on its native /generate
    if alias:
        if fields.get("max_tokens", fields["max_new_tokens"]) != fields["max_new_tokens"]:
            raise _bad("sampling_params.max_new_tokens", "must equal max_tokens where both are "
                       "given", fields["max_new_tokens"])
        fields["max_tokens"] = fields.pop("max_new_tokens")
    inner = _Body(fields)
    try:  # the sampling fields are OpenAI's, one level down
        out = _common(inner, info, default_max_tokens=None)
        if out.n != 1:
            raise _bad("n", "must be 1 on /generate", out.n)
        top = inner.int("top_logprobs", 0, 20)
        out.logprobs = bool(inner.bool("logprobs")) or bool(top)
    except APIError as e:
        if alias and e.param == "max_tokens":
            e.message, e.param = "max_new_tokens" + e.message[len("max_tokens"):], "max_new_tokens"
        if e.param is not None:
            e.message, e.param = f"sampling_params.{e.message}", f"sampling_params.{e.param}"
        raise
    if alias:
        out.max_tokens_name = "max_new_tokens"
    out.params.top_logprobs, out.params.logprobs = top or 0, out.logprobs
    out.stream = bool(b.bool("stream"))
    text, ids = b.get("text"), b.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError(400, "exactly one of text and input_ids must be given", "text")
    if text is not None and not isinstance(text, str):
        raise _bad("text", "must be a string", text)
    out.prompts = [{"text": text, "field": "text"} if text is not None
                   else {"input_ids": b.token_ids("input_ids", ids), "field": "input_ids"}]
    return out
