"""Incremental detokenization of generated tokens, with OpenAI-style stop strings.

Text comes from ``tokenizers.decoders.DecodeStream``, which keeps tokens back until they decode to
whole characters, so a multi-byte character split over several byte-level tokens is sent once,
complete. For byte-level BPE tokenizers (SmolLM2, GPT-2, Llama 3, Qwen) its chunks add up to
exactly ``tokenizer.decode(ids)``, leading spaces and special tokens included (tested in
tests/server/test_detokenize.py). Where they would not, this module steps in or says so:

* A request may end in the middle of a character. DecodeStream then still holds the last tokens;
  ``decode`` renders them as U+FFFD. On ``final=True`` we decode the whole sequence once and send
  what is missing, so the stream ends exactly like ``decode``.
* transformers' ``clean_up_tokenization_spaces`` rewriting (" ." -> ".") is not applied. It is off
  for SmolLM2, and transformers ignores it for BPE tokenizers anyway.

Stop strings: generation stops at the first token after which the text contains a stop string,
and the text is cut right before the earliest occurrence present at that point (one stop string
may span many tokens). While streaming, the end of the text that could still grow into a stop
string is held back; it is sent once it no longer can, or when the request ends (``final``).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def _backend(tokenizer: Any) -> Tokenizer:
    """The Rust tokenizer behind a transformers fast tokenizer (or the tokenizer itself)."""
    return tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer


def token_text(tokenizer: Any, token_id: int) -> str:
    """Text of a single token for logprob entries (special tokens kept, partial bytes -> U+FFFD)."""
    return _backend(tokenizer).decode([token_id], skip_special_tokens=False)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted (byte-level BPE vocabularies spell
    every byte as one of these characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The raw UTF-8 bytes of one token (OpenAI's logprob ``bytes``): a token that holds part of
    a character has bytes that are not valid UTF-8 on their own, which its text cannot show."""
    backend = _backend(tokenizer)
    piece = backend.id_to_token(token_id)
    if piece is None:
        return []
    if "ByteLevel" in type(backend.decoder).__name__ and all(c in _BYTE_LEVEL for c in piece):
        return [_BYTE_LEVEL[c] for c in piece]
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
        return [int(piece[3:5], 16)]
    return list(token_text(tokenizer, token_id).encode())


class TextStream:
    """Incremental detokenization of one request's output tokens, with stop strings."""

    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True) -> None:
        self._tokenizer = _backend(tokenizer)
        self._skip = skip_special_tokens
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = [s for s in dict.fromkeys(stop) if s]  # "" would match before any text
        self._longest = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []  # every token consumed, for the final flush
        self._undecoded = 0  # trailing tokens DecodeStream has not turned into text yet
        self._held = ""  # decoded text not sent yet
        self.stopped = False  # a stop string matched; add() returns "" from then on
        self.num_tokens = 0  # tokens consumed, up to the one that completed a stop string
        self.text = ""  # everything sent so far

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new output tokens; return the new text that is safe to send to the client."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            self._ids.append(token_id)
            self.num_tokens += 1
            piece = self._decoder.step(self._tokenizer, token_id)
            if piece is None:  # an incomplete character, or a skipped special token
                self._undecoded += 1
                continue
            self._undecoded = 0
            if self._append(piece):
                break
        if final and not self.stopped:
            self._append(self._flush())
        cut = len(self._held)
        if not (self.stopped or final):
            cut -= self._partial_stop_len()
        out, self._held = self._held[:cut], self._held[cut:]
        self.text += out
        return out

    def _append(self, piece: str) -> bool:
        """Add decoded text; on a stop string, cut it there and return True."""
        # only occurrences that end inside the new piece are new
        start = max(0, len(self._held) - self._longest + 1)
        self._held += piece
        hits = [i for s in self._stops if (i := self._held.find(s, start)) >= 0]
        if hits:
            self._held = self._held[: min(hits)]
            self.stopped = True
        return self.stopped

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the held text that is a proper prefix of a stop string."""
        for n in range(min(len(self._held), self._longest - 1), 0, -1):
            tail = self._held[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _flush(self) -> str:
        """Text of the tokens DecodeStream still holds at the end: what ``decode`` makes of them."""
        pending, self._undecoded = self._undecoded, 0
        decode = self._tokenizer.decode
        if not pending or not decode(self._ids[-pending:], skip_special_tokens=self._skip):
            return ""  # nothing held back, or only skipped special tokens (an EOS, say)
        full = decode(self._ids, skip_special_tokens=self._skip)
        sent = len(self.text)
        if not full.startswith(self._held, sent):  # never seen; do not contradict sent text
            return ""
        return full[sent + len(self._held):]
