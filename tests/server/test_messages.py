"""The inter-process messages: msgpack round trips, tags, versions, and no pickle."""

from __future__ import annotations

import msgspec
import pytest

from minisgl.server import messages as m


def examples() -> list[m.Msg]:
    params = m.Params(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop_token_ids=[2],
                      top_logprobs=2, logprobs=True)
    out = m.TextOut(rid="r", text="é", token_ids=[1, 2],
                    logprobs=[m.LogprobEntry("a", -0.5, [97], [("a", -0.5, [97]), ("b", -1.0, [98])])],
                    finish_reason="stop", prompt_tokens=3, completion_tokens=2, cached_tokens=1,
                    echo="a b")
    return [
        m.GenerateReq(rid="r", messages=[{"role": "user", "content": "hi"}], params=params,
                      stop=["\n"], field="messages"),
        m.TokenizedReq(rid="r", input_ids=[1, 2, 3], params=params, echo="a b"),
        m.GenerateReq(rid="r", input_ids=[1, 2], params=params, echo=True),
        m.Abort(rid="r"), m.StatsQuery(qid="q"),
        m.Accepted(rid="r", prompt_tokens=3, stop=["x"], logprobs=True, echo=""),
        m.TokenBatch(items=[m.TokenOut("r", [5], [-0.1], [[(5, -0.1), (6, -2.0)]], None, 0)]),
        out, m.TextBatch(items=[out]),
        m.Error(rid="r", status=400, message="temperature: must be >= 0", param="temperature"),
        m.Ready(process="scheduler", info={"max_model_len": 512}), m.Stats(qid="q", stats={"a": 1}),
        m.Fatal(process="tokenizer", message="boom"),
    ]


@pytest.mark.parametrize("msg", examples(), ids=lambda msg: type(msg).__name__)
def test_round_trip(msg: m.Msg) -> None:
    data = m.encode(msg)
    assert b"\x80\x04" not in data[:2]  # not a pickle stream
    back = m.decode(data)
    assert type(back) is type(msg) and back == msg


def test_tag_names_the_type() -> None:
    raw = msgspec.msgpack.decode(m.encode(m.Abort(rid="x")))
    assert raw == {"type": "Abort", "v": m.VERSION, "rid": "x"}


def test_other_version_is_refused() -> None:
    data = msgspec.msgpack.encode({"type": "Abort", "v": m.VERSION + 1, "rid": "x"})
    with pytest.raises(ValueError, match="version"):
        m.decode(data)


def test_wrong_field_type_is_refused() -> None:
    data = msgspec.msgpack.encode({"type": "Abort", "v": m.VERSION, "rid": 5})
    with pytest.raises(msgspec.ValidationError):
        m.decode(data)


def test_params_carry_exactly_the_sampling_fields() -> None:
    """The wire struct is SamplingParams' fields plus the logprobs flag: the scheduler builds
    SamplingParams from it field by field, so the two must not drift apart."""
    import dataclasses

    from minisgl.core.sampling_params import SamplingParams

    wire = set(msgspec.structs.asdict(m.Params())) - {"logprobs"}
    assert wire == {f.name for f in dataclasses.fields(SamplingParams)}


def test_echo_needs_a_tokenizer_for_token_ids() -> None:
    """The tokenizer process turns echo's prompt into text: a string as sent, ids decoded; ids
    on a model without a tokenizer fail with an error that names echo (the 400's param)."""
    from minisgl.server.tokenizer_proc import echo_text

    class Decoder:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"{ids}{skip_special_tokens}"

    req = m.GenerateReq(rid="r", input_ids=[4, 5], params=m.Params(), echo=True)
    assert echo_text(Decoder(), req, [4, 5]) == "[4, 5]True"
    assert echo_text(Decoder(), m.GenerateReq(rid="r", text="hi", params=m.Params(), echo=True),
                     [9]) == "hi"
    assert echo_text(None, m.GenerateReq(rid="r", input_ids=[4], params=m.Params()), [4]) is None
    with pytest.raises(ValueError, match=r"^echo: this model has no tokenizer"):
        echo_text(None, req, [4, 5])
