"""The tokenizer process: prompt text / chat messages -> token ids, in front of the scheduler."""

from __future__ import annotations

from typing import Any

from minisgl.core.tokenizer import chat_token_ids, hide_torch, load_tokenizer
from minisgl.server.ipc import POLL_MS, Endpoints, Sockets, child_main, parent_alive
from minisgl.server.messages import Abort, Error, GenerateReq, Ready, StatsQuery, TokenizedReq


def tokenize(tokenizer: Any, req: GenerateReq) -> list[int]:
    """Raise ValueError("<field>: ...") when the prompt cannot be tokenized."""
    if req.input_ids is not None:
        return req.input_ids
    if tokenizer is None:
        raise ValueError(f"{req.field}: this model has no tokenizer; send token ids")
    if req.messages is not None:
        try:
            return chat_token_ids(tokenizer, req.messages)
        except Exception as e:  # the template itself may reject a conversation (jinja raise)
            raise ValueError(f"messages: the chat template rejected them: {e}") from e
    return list(tokenizer.encode(req.text or ""))


def echo_text(tokenizer: Any, req: GenerateReq, ids: list[int]) -> str | None:
    """The prompt as text for ``echo``: as sent, or token ids decoded (special tokens as the
    request's skip_special_tokens says, like its output)."""
    if not req.echo:
        return None
    if req.text is not None:
        return req.text
    if tokenizer is None:
        raise ValueError("echo: this model has no tokenizer to turn the prompt's ids into text")
    return str(tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens))


def run(ep: Endpoints, model_path: str) -> None:
    def body() -> None:
        hide_torch()  # ids in, ids out: no torch in this process (minisgl.core.tokenizer)
        tokenizer = load_tokenizer(model_path)
        socks = Sockets(ep.tokenizer, scheduler=ep.scheduler, api=ep.api)
        socks.send("api", Ready(process="tokenizer"))
        while parent_alive():
            msg = socks.recv(POLL_MS)
            if isinstance(msg, GenerateReq):
                try:
                    ids = tokenize(tokenizer, msg)
                    echo = echo_text(tokenizer, msg, ids)
                except ValueError as e:
                    field = str(e).split(":", 1)[0]
                    socks.send("api", Error(rid=msg.rid, status=400, message=str(e), param=field))
                    continue
                except Exception as e:  # a tokenizer bug must not take the deployment down
                    socks.send("api", Error(rid=msg.rid, status=500,
                                            message=f"tokenization failed: {e!r}"))
                    continue
                socks.send("scheduler", TokenizedReq(
                    rid=msg.rid, input_ids=ids, params=msg.params, stop=msg.stop,
                    skip_special_tokens=msg.skip_special_tokens, field=msg.field, echo=echo))
            elif isinstance(msg, (Abort, StatsQuery)):  # same path as requests: stays in order
                socks.send("scheduler", msg)

    child_main("tokenizer", ep.api, body, plugins=False)
