"""The detokenizer process: token ids -> text deltas for the API, and stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.core.tokenizer import hide_torch, load_tokenizer
from minisgl.server.detokenize import TextStream, token_bytes, token_text
from minisgl.server.ipc import POLL_MS, Endpoints, Sockets, child_main, parent_alive
from minisgl.server.messages import (
    Abort,
    Accepted,
    Error,
    Fatal,
    Heartbeat,
    LogprobEntry,
    Ready,
    Stats,
    TextBatch,
    TextOut,
    TokenBatch,
    TokenOut,
)


@dataclass
class _State:
    text: TextStream | None  # None: the model has no tokenizer, only ids are sent
    prompt_tokens: int
    logprobs: bool
    skip_special: bool
    echo: str | None  # sent with the first TextOut, then None
    tokens: int = 0  # completion tokens so far


class Detokenizer:
    def __init__(self, tokenizer: Any, socks: Sockets) -> None:
        self.tokenizer = tokenizer
        self.socks = socks
        self.states: dict[str, _State] = {}
        self.special_ids = set(tokenizer.all_special_ids) if tokenizer is not None else set()
        self._texts: dict[int, str] = {}  # token id -> its text, for logprob entries

    def text_of(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = token_text(self.tokenizer, token_id)
        return text

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Accepted):
            text = None if self.tokenizer is None else TextStream(
                self.tokenizer, msg.stop, msg.skip_special_tokens)
            self.states[msg.rid] = _State(text, msg.prompt_tokens, msg.logprobs,
                                          msg.skip_special_tokens, msg.echo)
        elif isinstance(msg, TokenBatch):
            outs = []
            for item in msg.items:
                try:
                    out = self.output(item)
                except Exception as e:  # one request's text went wrong: fail it, keep serving
                    self.states.pop(item.rid, None)
                    self.socks.send("scheduler", Abort(rid=item.rid))
                    self.socks.send("api", Error(rid=item.rid, status=500,
                                                 message=f"detokenization failed: {e!r}"))
                    continue
                if out is not None:
                    outs.append(out)
            if outs:
                self.socks.send("api", TextBatch(items=outs))
        elif isinstance(msg, Error):
            self.states.pop(msg.rid, None)
            self.socks.send("api", msg)
        elif isinstance(msg, (Ready, Heartbeat, Stats, Fatal)):
            self.socks.send("api", msg)

    def output(self, item: TokenOut) -> TextOut | None:
        st = self.states.get(item.rid)
        if st is None:  # finished here already (stop string); the scheduler's last word
            return None
        ids, finish = list(item.token_ids), item.finish_reason
        delta = ""
        if st.text is not None:
            # a stop token (EOS, stop_token_ids) stays in the text unless it is a special token
            # and skip_special_tokens is on, as in the offline LLM and vLLM
            before = st.text.num_tokens
            delta = st.text.add(ids, final=finish is not None)
            if st.text.stopped:  # a stop string matched: cut here and stop the scheduler
                ids = ids[: st.text.num_tokens - before]
                finish = "stop"
                self.socks.send("scheduler", Abort(rid=item.rid))
        entries = []
        if st.logprobs and self.tokenizer is not None:
            shown = ids
            if finish == "stop" and ids and st.skip_special and ids[-1] in self.special_ids:
                shown = ids[:-1]  # the hidden EOS: entries join to the text
            tops = item.top_logprobs or [[] for _ in ids]
            hide = self.special_ids if st.skip_special else set()
            entries = [LogprobEntry(self.text_of(tok), lp, token_bytes(self.tokenizer, tok),
                                    [(self.text_of(t), v, token_bytes(self.tokenizer, t))
                                     for t, v in top], tok in hide)
                       for tok, lp, top in zip(shown, item.logprobs, tops)]
        st.tokens += len(ids)
        if finish is not None:
            del self.states[item.rid]
        echo, st.echo = st.echo, None
        return TextOut(rid=item.rid, text=delta, token_ids=ids, logprobs=entries,
                       finish_reason=finish, prompt_tokens=st.prompt_tokens,
                       completion_tokens=st.tokens, cached_tokens=item.cached_tokens, echo=echo)


def run(ep: Endpoints, model_path: str) -> None:
    def body() -> None:
        hide_torch()  # ids in, text out: no torch in this process (minisgl.core.tokenizer)
        tokenizer = load_tokenizer(model_path)
        socks = Sockets(ep.detokenizer, api=ep.api, scheduler=ep.scheduler)
        detok = Detokenizer(tokenizer, socks)
        while parent_alive():
            msg = socks.recv(POLL_MS)
            if msg is not None:
                detok.handle(msg)

    child_main("detokenizer", ep.api, body, plugins=False)
