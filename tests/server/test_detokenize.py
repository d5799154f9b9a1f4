"""TextStream (incremental detokenization + stop strings) against the real SmolLM2 tokenizer.

The reference is always ``tokenizer.decode`` of the whole sequence (or of its prefixes), never
DecodeStream, which is what the implementation builds on.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from minisgl.server.detokenize import TextStream, token_text

FFFD = "\ufffd"
TEXTS = [
    "Hello, world! This is plain ASCII.",
    "  two leading spaces, and   runs of   spaces ",
    "你好，世界。今天天气很好。",
    "Emoji: 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "Café, naïve, façade, Ångström, crème brûlée; e\u0301 (combining)",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    " mixed: ASCII 漢字 ελληνικά русский 🙂 עברית\n",
]


@pytest.fixture(scope="module")
def tok(smollm2_path: str):
    return AutoTokenizer.from_pretrained(smollm2_path)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """Split ids into chunks of 0..5 tokens (empty chunks included: add([]) must work)."""
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 5)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def feed(tok, chunks: list[list[int]], expect: str, stop: list[str] | tuple[str, ...] = (),
         skip: bool = True, final: bool = True) -> tuple[TextStream, list[str]]:
    """Feed chunks (final on the last one), checking the invariants after every add()."""
    stream = TextStream(tok, list(stop), skip_special_tokens=skip)
    outs: list[str] = []
    for i, chunk in enumerate(chunks):
        outs.append(stream.add(chunk, final=final and i == len(chunks) - 1))
        assert stream.text == "".join(outs)
        assert expect.startswith(stream.text), (stream.text, expect)
        assert not any(s and s in stream.text for s in stop)
        if FFFD not in expect:
            assert FFFD not in outs[-1]
    return stream, outs


def ref_stop(tok, ids: list[int], stop: list[str], skip: bool = True) -> tuple[str, int]:
    """(text, tokens used) by brute force: decode every prefix of ids; at the first prefix whose
    complete text contains a stop string, cut before the earliest occurrence."""
    for k in range(1, len(ids) + 1):
        # a prefix may end inside a character: decode renders that as U+FFFD, drop it
        text = tok.decode(ids[:k], skip_special_tokens=skip).rstrip(FFFD)
        hits = [text.find(s) for s in stop if s and s in text]
        if hits:
            return text[: min(hits)], k
    return tok.decode(ids, skip_special_tokens=skip), len(ids)


# -- plain detokenization -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_decode(tok, text: str) -> None:
    ids = encode(tok, text)
    expect = tok.decode(ids, skip_special_tokens=True)
    assert expect == text and FFFD not in expect
    stream, outs = feed(tok, [[i] for i in ids], expect)
    assert "".join(outs) == expect and stream.num_tokens == len(ids) and not stream.stopped


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_match_decode(tok, text: str, seed: int) -> None:
    ids = encode(tok, text)
    expect = tok.decode(ids)
    stream, outs = feed(tok, random_chunks(ids, random.Random(seed)), expect)
    assert "".join(outs) == expect and stream.num_tokens == len(ids)


def test_split_characters_are_held_until_complete(tok) -> None:
    ids = encode(tok, "a👨‍👩‍👧b")
    assert any(FFFD in tok.decode([i]) for i in ids)  # the case under test really happens
    stream = TextStream(tok, [])
    outs = [stream.add([i]) for i in ids]
    assert "" in outs  # some tokens produced no text yet
    assert all(FFFD not in o for o in outs) and "".join(outs) == "a👨‍👩‍👧b"


def test_final_flushes_an_incomplete_character_like_decode(tok) -> None:
    ids = encode(tok, "ok 🎉")[:-1]  # the emoji's last byte never comes
    expect = tok.decode(ids)
    assert expect.endswith(FFFD)
    stream = TextStream(tok, [])
    streamed = stream.add(ids)
    assert FFFD not in streamed  # never sent while it might still complete
    assert streamed + stream.add([], final=True) == expect


def test_final_with_trailing_skipped_special_token(tok) -> None:
    ids = encode(tok, "Bye.") + [tok.convert_tokens_to_ids("<|im_end|>")]
    stream, outs = feed(tok, [ids], "Bye.")
    assert "".join(outs) == "Bye." == tok.decode(ids, skip_special_tokens=True)


def test_ill_formed_bytes_match_decode(tok) -> None:
    # U+40000 encodes to lone UTF-8 continuation bytes: its lead byte has no token in SmolLM2
    cont = encode(tok, "\U00040000")[0]
    for ids in ([cont, *encode(tok, "a 🎉")], [*encode(tok, "x"), cont, cont], [cont]):
        expect = tok.decode(ids)
        assert FFFD in expect
        for chunks in ([[i] for i in ids], [ids]):
            stream, outs = feed(tok, chunks, expect)
            assert "".join(outs) == expect


# -- special tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_chat_template_special_tokens(tok, skip: bool) -> None:
    chat = [{"role": "user", "content": "Hi 👋"}, {"role": "assistant", "content": "Hello there!"}]
    ids = encode(tok, tok.apply_chat_template(chat, tokenize=False))
    expect = tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in expect) is not skip and ("<|im_start|>" in expect) is not skip
    for seed in range(3):
        chunks = random_chunks(ids, random.Random(seed)) if seed else [[i] for i in ids]
        stream, outs = feed(tok, chunks, expect, skip=skip)
        assert "".join(outs) == expect and stream.num_tokens == len(ids)


def test_stop_on_special_token_text_only_when_not_skipped(tok) -> None:
    ids = encode(tok, "<|im_start|>assistant\nSure.<|im_end|>\nmore")
    stream, outs = feed(tok, [[i] for i in ids], "<|im_start|>assistant\nSure.",
                        stop=["<|im_end|>"], skip=False)
    assert "".join(outs) == "<|im_start|>assistant\nSure." and stream.stopped
    stream, outs = feed(tok, [[i] for i in ids], "assistant\nSure.\nmore", stop=["<|im_end|>"])
    assert "".join(outs) == "assistant\nSure.\nmore" and not stream.stopped


# -- stop strings ---------------------------------------------------------------------------

FOX = "The quick brown fox jumps over the lazy dog."


def test_stop_string_spanning_tokens(tok) -> None:
    ids = encode(tok, FOX)
    assert not any("brown fox" in tok.decode([i]) for i in ids)  # spans several tokens
    stream, outs = feed(tok, [[i] for i in ids], FOX, stop=["brown fox"])
    assert "".join(outs) == "The quick " and stream.stopped
    assert stream.num_tokens == ref_stop(tok, ids, ["brown fox"])[1] == 4  # up to " fox"
    assert stream.add(encode(tok, " more"), final=True) == "" and stream.num_tokens == 4


def test_stop_string_at_the_very_start(tok) -> None:
    ids = encode(tok, FOX)
    stream, outs = feed(tok, [[i] for i in ids], FOX, stop=["The q"])
    assert stream.text == "" and stream.stopped and stream.num_tokens == 2


def test_stop_strings_earliest_occurrence_wins(tok) -> None:
    ids = encode(tok, FOX)
    for stops in (["lazy", "quick", "over"], ["over", "lazy", "quick"]):
        stream, outs = feed(tok, [ids], FOX, stop=stops)  # one chunk: all tokens at once
        assert "".join(outs) == "The " and stream.num_tokens == 2
    # both complete inside the same token " quick": the one starting first wins, whatever order
    for stops in (["ck", "qui"], ["qui", "ck"]):
        stream, outs = feed(tok, [ids], FOX, stop=stops)
        assert "".join(outs) == "The " and stream.num_tokens == 2


def test_stop_that_completes_first_ends_generation(tok) -> None:
    # "fox" completes (token " fox") before "brown fox jumps" could: generation ends there
    ids = encode(tok, FOX)
    stream, outs = feed(tok, [[i] for i in ids], FOX, stop=["brown fox jumps", "fox"])
    assert "".join(outs) == "The quick brown " and stream.num_tokens == 4


def test_stop_that_never_matches_releases_tail_on_final(tok) -> None:
    ids = encode(tok, "I like the zeb")
    stream, outs = feed(tok, [[i] for i in ids], "I like the zeb", stop=["zebra"], final=False)
    assert stream.text == "I like the "  # "zeb" might still become "zebra"
    assert stream.add([], final=True) == "zeb" and stream.text == "I like the zeb"
    assert not stream.stopped and stream.num_tokens == len(ids)


def test_held_tail_released_once_it_cannot_match(tok) -> None:
    ids = encode(tok, "the zebu is")
    texts = []
    stream = TextStream(tok, ["zebra"])
    for i in ids:
        stream.add([i])
        texts.append(stream.text)
    assert texts == ["the", "the ", "the ", "the zebu", "the zebu is"]


def test_partial_stop_prefix_spanning_chunks(tok) -> None:
    ids = encode(tok, FOX)
    stream, outs = feed(tok, [[i] for i in ids], FOX, stop=["lazy cat", "jumps over the lazy dog!"])
    assert "".join(outs) == FOX and not stream.stopped
    assert outs[-1] == "jumps over the lazy dog."  # held back since " jumps", released at end


@pytest.mark.parametrize("seed", range(4))
def test_num_tokens_when_stop_matches_mid_stream(tok, seed: int) -> None:
    text = "One, two, three. Four 🍀 five, six! Seven 漢字 eight."
    ids = encode(tok, text)
    for stop in (["three"], ["🍀"], ["字 e"], ["six!", "Four"], [", s"]):
        expect, used = ref_stop(tok, ids, stop)
        stream, outs = feed(tok, random_chunks(ids, random.Random(seed)), expect, stop=stop)
        assert "".join(outs) == expect and stream.stopped
        assert stream.num_tokens == used < len(ids)


def test_empty_and_duplicate_stop_strings(tok) -> None:
    ids = encode(tok, FOX)
    stream, outs = feed(tok, [ids], FOX, stop=["", "dog", "dog"])
    assert "".join(outs) == "The quick brown fox jumps over the lazy "


# -- token_text -----------------------------------------------------------------------------


def test_token_text(tok) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_text(tok, im_end) == "<|im_end|>"
    for i in [im_end, *encode(tok, " hello 🎉 é")]:
        assert token_text(tok, i) == tok.decode([i], skip_special_tokens=False)
    assert token_text(tok, encode(tok, " hello")[0]) == " hello"


# -- property -------------------------------------------------------------------------------

PIECES = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=FFFD), max_size=8),
    st.sampled_from(["你好", "👨‍👩‍👧", "🎉", "é", "e\u0301", " the", "\n", "  ", "ab", "ba"]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_matches_decode_cut_at_stop(tok, data: st.DataObject) -> None:
    skip = data.draw(st.booleans(), "skip")
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    ids: list[int] = []
    for piece in data.draw(st.lists(PIECES, min_size=1, max_size=6), "pieces"):
        ids += encode(tok, piece)
        if data.draw(st.integers(0, 4), "special?") == 0:  # between pieces: well-formed
            ids.append(data.draw(st.sampled_from(specials)))
    full = tok.decode(ids, skip_special_tokens=skip)
    # keep well-formed sequences only: SmolLM2 has no token for some UTF-8 lead bytes (0xF1, for
    # planes 4-12), so encode drops them and the rest decodes to U+FFFD
    assume(FFFD not in full)
    stops = []
    for _ in range(data.draw(st.integers(0, 3), "n_stops")):
        if full and data.draw(st.booleans()):
            a = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[a:a + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=3)))
    expect, used = ref_stop(tok, ids, stops, skip)
    seed = data.draw(st.integers(0, 2**16), "chunk seed")
    stream, outs = feed(tok, random_chunks(ids, random.Random(seed)) or [[]], expect,
                        stop=stops, skip=skip)
    assert "".join(outs) == expect
    assert stream.num_tokens == used and stream.stopped == any(s in full for s in stops)
    # where no stop string contains another, this is simply the text cut at the first stop
    if not any(a != b and a in b for a in stops for b in stops):
        hits = [full.find(s) for s in stops if s in full]
        assert expect == full[: min(hits, default=len(full))]
