"""TorchSampler and its helpers against independent float64 / plain-Python references."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from minisgl.core.request import Req
from minisgl.core.sampling import (
    SampleOutput,
    Sampler,
    TorchSampler,
    apply_penalties,
    draw_keys,
    filter_probs,
    race,
    row_argmax,
    sample_from_probs,
    token_counts,
    token_uniforms,
)
from minisgl.core.sampling_params import SamplingParams


def make_req(seed: int | None = None, prompt: list[int] | None = None,
             output: list[int] | None = None, **params: object) -> Req:
    req = Req(prompt_ids=list(prompt or [0]), params=SamplingParams(**params),
              generator=None if seed is None else torch.Generator().manual_seed(seed))
    req.output_ids = list(output or [])
    return req


def sampler(vocab: int) -> TorchSampler:
    return TorchSampler(vocab, torch.device("cpu"))


# -- brute-force references (float64, plain Python) ---------------------------------------------


def softmax64(row: list[float], temperature: float = 1.0) -> list[float]:
    m = max(row)
    e = [math.exp((x - m) / temperature) for x in row]
    s = sum(e)
    return [x / s for x in e]


def ref_top_k(probs: list[float], k: int) -> set[int]:
    return set(sorted(range(len(probs)), key=lambda i: -probs[i])[:k])


def ref_top_p(probs: list[float], p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches p."""
    kept: set[int] = set()
    mass = 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def ref_min_p(probs: list[float], min_p: float) -> set[int]:
    top = max(probs)
    return {i for i, x in enumerate(probs) if x >= min_p * top}


def ref_keep(probs: list[float], k: int, p: float, min_p: float) -> set[int]:
    """top-k, then top-p on the renormalised survivors, then min-p."""
    kept = ref_top_k(probs, k) if k > 0 else set(range(len(probs)))
    total = sum(probs[i] for i in kept)
    renorm = [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]
    kept &= ref_top_p(renorm, p) if p < 1.0 else kept
    return kept & ref_min_p(renorm, min_p)


def kept_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > 0).flatten().tolist())


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser in plain Python integers."""
    h ^= h >> 16
    h = h * 0x85EBCA6B % 2**32
    h ^= h >> 13
    h = h * 0xC2B2AE35 % 2**32
    return h ^ (h >> 16)


def ref_uniform(key: int, token: int) -> float:
    """Token's uniform under a row key, as documented in sampling.token_uniforms."""
    h = fmix32(fmix32((token + key % 2**32) % 2**32) ^ (key >> 32) % 2**32)
    return (h + 0.5) / 2**32


def ref_draw(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float,
             key: int) -> int:
    """The token the sampler should draw, in float64 plain Python: the filters' kept set, then
    the race argmax p_i / q_i, q_i = -log(1 - u_i) (the first maximum)."""
    x = [v / temperature for v in logits]
    probs = softmax64(x)
    kept = ref_keep(probs, top_k, top_p, min_p)
    best, at = -1.0, -1
    for i in sorted(kept):
        r = probs[i] / -math.log1p(-ref_uniform(key, i))
        if r > best:
            best, at = r, i
    return at


# -- interface ----------------------------------------------------------------------------------


def test_interface_and_output_types() -> None:
    with pytest.raises(TypeError):
        Sampler(8, torch.device("cpu"))
    s = sampler(8)
    assert isinstance(s, Sampler)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = s.sample(logits, [make_req(1), make_req(temperature=0.0), make_req(2, top_k=3)])
    assert isinstance(out, SampleOutput)
    assert out.tokens.dtype == torch.int64 and out.tokens.shape == (3,)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3,)
    assert out.tokens.device.type == "cpu" and out.logprobs.device.type == "cpu"
    with pytest.raises(ValueError, match="rows"):
        s.sample(torch.zeros(2, 8), [make_req(1)])


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(4, 12)
    logits[:, 8:] = 100.0  # padding columns past the real vocabulary of 8
    out = sampler(8).sample(logits, [make_req(i) for i in range(3)] + [make_req(temperature=0)])
    assert (out.tokens < 8).all()


# -- top-k / top-p / min-p ----------------------------------------------------------------------


def test_top_k_samples_only_from_true_top_k() -> None:
    vocab, n = 50, 300
    gen = torch.Generator().manual_seed(0)
    s = sampler(vocab)
    for k in (2, 5, 17):
        row = torch.randn(vocab, generator=gen) * 2
        reqs = [make_req(1000 * k + i, top_k=k) for i in range(n)]
        tokens = s.sample(row.expand(n, vocab).clone(), reqs).tokens.tolist()
        allowed = ref_top_k(row.tolist(), k)
        assert set(tokens) <= allowed
        assert len(set(tokens)) > 1  # really sampling, not argmax


def test_top_k_mixed_per_row_in_one_batch() -> None:
    vocab = 40
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(1)) * 3
    ks = [(-1, 1, 2, 3, 7, 40)[i % 6] for i in range(64)]
    out = sampler(vocab).sample(logits, [make_req(i, top_k=k) for i, k in enumerate(ks)])
    for row, k, t in zip(logits.tolist(), ks, out.tokens.tolist()):
        if k > 0:
            assert t in ref_top_k(row, k)
        if k == 1:
            assert t == max(range(vocab), key=lambda i: row[i])


def test_filter_probs_top_p_matches_reference() -> None:
    batch, vocab = 32, 40
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(batch, vocab, generator=gen) * 2
    top_p = torch.rand(batch, generator=gen) * 0.9 + 0.05
    probs = torch.softmax(logits, dim=-1)
    out = filter_probs(probs, torch.full((batch,), -1), top_p, torch.zeros(batch))
    for b in range(batch):
        ref = ref_top_p(probs[b].double().tolist(), float(top_p[b]))
        assert kept_set(out[b]) == ref
        # the survivors keep their relative weights, renormalised
        kept = sorted(ref)
        expect = probs[b, kept].double() / probs[b, kept].double().sum()
        torch.testing.assert_close(out[b, kept].double(), expect, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.sum(-1), torch.ones(batch))


def test_top_p_always_keeps_top_token_and_one_disables() -> None:
    probs = torch.softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0]] * 2), dim=-1)
    out = filter_probs(probs, torch.tensor([-1, -1]), torch.tensor([1e-6, 1.0]),
                       torch.zeros(2))
    assert kept_set(out[0]) == {0}
    assert kept_set(out[1]) == {0, 1, 2, 3}
    # top_p=1 keeps everything, even a token too small to move the cumulative mass
    tiny = torch.tensor([[1.0, 1e-30]])
    out = filter_probs(tiny, torch.tensor([-1]), torch.tensor([1.0]), torch.zeros(1))
    assert kept_set(out[0]) == {0, 1}
    flat = torch.full((1, 100_000), 1e-5)
    out = filter_probs(flat, torch.tensor([-1]), torch.tensor([1.0]), torch.zeros(1))
    assert bool((out > 0).all())


def test_top_p_boundary_exact_mass() -> None:
    # dyadic probabilities are exact in float: mass 0.75 is reached by {0, 1} exactly
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3)
    out = filter_probs(probs, torch.full((3,), -1), torch.tensor([0.75, 0.7501, 0.5]),
                       torch.zeros(3))
    assert [kept_set(r) for r in out] == [{0, 1}, {0, 1, 2}, {0}]
    assert [ref_top_p(r, p) for r, p in zip(probs.double().tolist(), (0.75, 0.7501, 0.5))] \
        == [{0, 1}, {0, 1, 2}, {0}]


def test_sampled_tokens_stay_in_top_p_set() -> None:
    vocab, n = 30, 200
    gen = torch.Generator().manual_seed(3)
    s = sampler(vocab)
    for p, temp in ((0.3, 1.0), (0.6, 0.7), (0.9, 1.5)):
        row = torch.randn(vocab, generator=gen) * 2
        reqs = [make_req(i, top_p=p, temperature=temp) for i in range(n)]
        tokens = s.sample(row.expand(n, vocab).clone(), reqs).tokens.tolist()
        allowed = ref_top_p(softmax64(row.tolist(), temp), p)
        assert set(tokens) <= allowed
        if len(allowed) > 1:
            assert len(set(tokens)) > 1


def test_filter_probs_min_p_matches_reference() -> None:
    batch, vocab = 32, 40
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 2, dim=-1)
    min_p = torch.rand(batch, generator=gen) * 0.5
    out = filter_probs(probs, torch.full((batch,), -1), torch.ones(batch), min_p)
    for b in range(batch):
        assert kept_set(out[b]) == ref_min_p(probs[b].double().tolist(), float(min_p[b]))


def test_sampled_tokens_stay_in_min_p_set() -> None:
    vocab, n = 30, 200
    gen = torch.Generator().manual_seed(5)
    s = sampler(vocab)
    for mp in (0.05, 0.2, 0.5):
        row = torch.randn(vocab, generator=gen) * 2
        tokens = s.sample(row.expand(n, vocab).clone(),
                          [make_req(i, min_p=mp) for i in range(n)]).tokens.tolist()
        allowed = ref_min_p(softmax64(row.tolist()), mp)
        assert set(tokens) <= allowed
        if len(allowed) > 1:
            assert len(set(tokens)) > 1


def test_filter_probs_combined_matches_reference() -> None:
    batch, vocab = 48, 25
    gen = torch.Generator().manual_seed(6)
    probs = torch.softmax(torch.randn(batch, vocab, generator=gen) * 2, dim=-1)
    top_k = torch.randint(1, vocab + 1, (batch,), generator=gen)
    top_k[::4] = -1
    top_p = torch.rand(batch, generator=gen) * 0.9 + 0.05
    top_p[1::4] = 1.0
    min_p = torch.rand(batch, generator=gen) * 0.3
    min_p[2::4] = 0.0
    out = filter_probs(probs, top_k, top_p, min_p)
    for b in range(batch):
        ref = ref_keep(probs[b].double().tolist(), int(top_k[b]), float(top_p[b]),
                       float(min_p[b]))
        assert kept_set(out[b]) == ref


def _wide_rows(vocab: int) -> tuple[torch.Tensor, list[tuple[int, float, float]]]:
    """Rows of a real vocabulary and (top_k, top_p, min_p) per row: random spreads (bf16 ties in
    some), a top token over a tail holding a third of the mass, steps of tokens whose ratios to
    the top are powers of two (band edges), zeros with top_p near 1, mixed filters."""
    g = torch.Generator().manual_seed(41)
    rows, params = [], []
    for i, (scale, p) in enumerate([(0.5, 0.9), (1.5, 0.95), (3.0, 0.9), (6.0, 0.5),
                                    (1.0, 0.999), (2.0, 0.7)]):
        x = torch.randn(vocab, generator=g) * scale
        rows.append(x.bfloat16().float() if i % 2 else x)
        params.append((-1, p, 0.0))
    tail = torch.full((vocab,), -7.5)
    tail[vocab // 3] = 0.0
    rows += [tail, tail]
    params += [(-1, 0.9, 0.0), (-1, 0.4, 0.0)]
    steps = torch.zeros(vocab)  # weight 2^-j for the tokens of step j
    for j, n in ((3, 40), (10, 700), (11, 900), (17, 9000)):
        steps[torch.randperm(vocab, generator=g)[:n]] = -j * math.log(2.0)
    steps[5] = 2.0
    for p in (0.2, 0.6, 0.9, 0.97):
        rows.append(steps)
        params.append((-1, p, 0.0))
    zeros = torch.randn(vocab, generator=g) * 2
    zeros[::3] = -math.inf
    rows.append(zeros)
    params.append((-1, 0.99999, 0.0))
    for k, p, mp in ((20, 0.95, 0.0), (5000, 0.9, 0.0), (-1, 0.9, 0.02), (-1, 1.0, 0.1),
                     (40, 1.0, 0.0), (-1, 1.0, 0.0)):
        rows.append((torch.randn(vocab, generator=g) * 2).bfloat16().float())
        params.append((k, p, mp))
    return torch.stack(rows), params


def test_filter_probs_real_vocabulary_matches_reference() -> None:
    """Rows of 49,152 tokens (a few hundred candidates sorted, not the row): the kept set of
    each as the plain-Python sort and sums find it."""
    logits, params = _wide_rows(49152)
    probs = torch.softmax(logits, dim=-1)
    k, p, mp = (torch.tensor(c) for c in zip(*params))
    out = filter_probs(probs, k, p.double(), mp.float())
    for b, (kb, pb, mpb) in enumerate(params):
        ref = ref_keep(probs[b].double().tolist(), kb, pb, float(torch.tensor(mpb)))
        assert kept_set(out[b]) == ref, (b, len(ref))
    torch.testing.assert_close(out.sum(-1), torch.ones(len(params)))


# -- greedy / temperature -----------------------------------------------------------------------


def test_near_zero_temperature_is_greedy_argmax() -> None:
    batch, vocab = 16, 100
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(7))
    expect = [max(range(vocab), key=lambda i: row[i]) for row in logits.tolist()]
    s = sampler(vocab)
    for params in ({"temperature": 1e-6}, {"temperature": 0.0}, {"top_k": 1}):
        out = s.sample(logits, [make_req(i, **params) for i in range(batch)])
        assert out.tokens.tolist() == expect


def test_small_but_sampled_temperature_concentrates_on_argmax() -> None:
    # temperature 1e-3 is above the greedy cutoff; logit gaps of >= 0.1 make it one-hot
    logits = torch.tensor([[0.0, 0.5, 2.0, 1.9, -1.0]] * 50)
    out = sampler(5).sample(logits, [make_req(i, temperature=1e-3) for i in range(50)])
    assert out.tokens.tolist() == [2] * 50


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, 0.0, 0.0]])
    out = sampler(4).sample(logits, [make_req(temperature=0.0) for _ in range(3)])
    assert out.tokens.tolist() == [1, 0, 2]


@pytest.mark.parametrize("cols", [7, 64, 256, 320, 1000, 49152])  # no block width, one, several
def test_row_argmax_is_the_first_maximum(cols: int) -> None:
    """The two-level argmax against a plain-Python scan: first maximum, ties to the lowest id,
    a NaN counts as the maximum (as torch.argmax), rows of one value."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols, generator=g)
    x[1, cols // 3] = x[1, cols - 1] = 50.0  # a tie across blocks
    x[2] = 1.5  # every column ties
    x[3, cols // 2], x[3, 0] = float("nan"), 99.0  # NaN beats the largest number
    x[4, cols - 1] = float("nan")
    x[4, cols // 4] = float("nan")
    x[5] = float("-inf")
    x[6, : cols // 2] = float("inf")

    def first_max(row: list[float]) -> int:
        for i, v in enumerate(row):
            if math.isnan(v):
                return i
        return row.index(max(row))

    want = [first_max(r) for r in x.tolist()]
    assert row_argmax(x).tolist() == want
    assert x.argmax(dim=-1).tolist() == want  # the reference agrees with torch


# -- seeds --------------------------------------------------------------------------------------


def _run_seeded(seed: int, steps: list[torch.Tensor], position: int,
                companions: list[Req]) -> list[int]:
    """Tokens of one seeded request over several steps, placed at ``position`` in the batch."""
    s = sampler(steps[0].shape[-1])
    req = make_req(seed, top_p=0.95, temperature=0.9)
    tokens = []
    for step_logits in steps:
        reqs = companions[:position] + [req] + companions[position:]
        batch = step_logits.expand(len(reqs), -1).clone()
        out = s.sample(batch, reqs)
        tokens.append(int(out.tokens[position]))
        req.output_ids.append(tokens[-1])
    return tokens


def test_seed_reproducible_across_calls_positions_and_companions() -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(8)
    steps = [torch.randn(vocab, generator=gen) * 0.5 for _ in range(12)]
    alone = _run_seeded(42, steps, 0, [])
    assert alone == _run_seeded(42, steps, 0, [])
    companions = [make_req(7), make_req(None), make_req(temperature=0.0), make_req(9, top_k=3),
                  make_req(None, repetition_penalty=1.5, output=[1, 2])]
    assert alone == _run_seeded(42, steps, 3, companions)
    assert alone == _run_seeded(42, steps, 5, companions[::-1])
    assert len(set(alone)) > 1


def test_different_seeds_differ() -> None:
    vocab = 1000
    steps = [torch.zeros(vocab) for _ in range(10)]  # flat distribution
    assert _run_seeded(1, steps, 0, []) != _run_seeded(2, steps, 0, [])


def test_unseeded_requests_use_sampler_generator() -> None:
    logits = torch.zeros(200, 1000)
    torch.manual_seed(0)
    a = sampler(1000).sample(logits, [make_req(None) for _ in range(200)]).tokens
    torch.manual_seed(0)  # sampler-owned generator derives from the global seed
    b = sampler(1000).sample(logits, [make_req(None) for _ in range(200)]).tokens
    assert torch.equal(a, b)
    assert len(set(a.tolist())) > 100


def test_token_uniforms_match_the_documented_hash() -> None:
    keys = [0, 1, 2**32 - 1, 2**32, 123456789 * 2**32 + 987654321, 2**62 - 1]
    vocab = 70_000
    got = token_uniforms(torch.tensor(keys), vocab, torch.device("cpu"))
    assert got.dtype == torch.float64 and got.shape == (len(keys), vocab)
    for b, key in enumerate(keys):
        for token in (0, 1, 2, 255, 49_151, vocab - 1):
            assert float(got[b, token]) == ref_uniform(key, token), (key, token)


def test_token_uniforms_look_uniform_and_independent() -> None:
    """Within a row and across rows of random keys: bin counts within 5 sigma of uniform, the
    mean of -log(1 - u) near 1 (Exp(1)), neighbouring tokens and rows uncorrelated."""
    keys = draw_keys([torch.Generator().manual_seed(s) for s in range(8)])
    assert keys.dtype == torch.int64 and len(set(keys.tolist())) == 8
    assert bool(((keys >= 0) & (keys < 2**62)).all())
    u = token_uniforms(keys, 50_000, torch.device("cpu"))
    assert bool(((u > 0) & (u < 1)).all())
    n = u.numel()
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    assert bool(((counts - n / 20).abs() <= 5 * math.sqrt(n / 20)).all()), counts
    q = -torch.log1p(-u)
    assert abs(float(q.mean()) - 1.0) <= 5 / math.sqrt(n)
    c = u - 0.5
    along = float((c[:, 1:] * c[:, :-1]).mean()) / float((c * c).mean())
    across = float((c[1:] * c[:-1]).mean()) / float((c * c).mean())
    assert abs(along) <= 5 / math.sqrt(n) and abs(across) <= 5 / math.sqrt(n)


def test_race_matches_plain_python_draw() -> None:
    """race over filter_probs is the plain-Python draw: the filters' kept set, then argmax
    p_i / q_i with the documented uniforms (ties in the logits included)."""
    gen = torch.Generator().manual_seed(31)
    vocab, rows = 300, 40
    logits = (torch.randn(rows, vocab, generator=gen) * 2).bfloat16().float()  # ties
    params = [(0.7, -1, 1.0, 0.0), (1.3, 20, 1.0, 0.0), (0.9, -1, 0.8, 0.0), (1.0, -1, 1.0, 0.1),
              (0.6, 50, 0.5, 0.05)]
    keys = torch.randint(0, 2**62, (rows,), generator=gen)
    t, k, p, mp = (torch.tensor([params[i % 5][j] for i in range(rows)]) for j in range(4))
    probs = filter_probs(torch.softmax(logits / t.float()[:, None], -1), k.long(), p.double(),
                         mp.float())
    # the rows without top-k or top-p (dense: every token hashed), the rest (sparse: a quarter
    # of the entries or fewer, only the kept ones hashed)
    dense = [i for i in range(rows) if params[i % 5][1:3] == (-1, 1.0)]
    sparse = [i for i in range(rows) if i not in dense]
    assert int((probs[dense] > 0).sum()) * 4 > probs[dense].numel()
    assert int((probs[sparse] > 0).sum()) * 4 <= probs[sparse].numel()
    for idx in (dense, sparse):
        got = race(probs[idx], keys[idx]).tolist()
        for j, i in enumerate(idx):
            want = ref_draw(logits[i].tolist(), *params[i % 5], int(keys[i]))
            assert got[j] == want, (i, len(idx))


def test_race_wide_batch_matches_plain_python() -> None:
    """A batch of 49,152-token rows at temperature alone (the logs taken only for the tokens
    that can beat the top one's draw) draws the plain-Python race's tokens."""
    logits, _ = _wide_rows(49152)
    rows = logits.shape[0]
    assert rows * 49152 >= 2**19  # the prefiltered path
    keys = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(43))
    probs = torch.softmax(logits / 0.8, dim=-1)
    got = race(probs, keys).tolist()
    for b in range(rows):
        best, at = -1.0, -1
        for i, pi in enumerate(probs[b].double().tolist()):
            if pi > 0.0:
                r = pi / -math.log1p(-ref_uniform(int(keys[b]), i))
                if r > best:
                    best, at = r, i
        assert got[b] == at, b


# -- penalties ----------------------------------------------------------------------------------


def hand_penalties(logits: list[float], prompt: list[int], output: list[int], rep: float,
                   freq: float, pres: float) -> list[float]:
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        count = 0
        for o in output:
            if o == tok:
                count += 1
        x -= freq * count
        if count > 0:
            x -= pres
        out.append(x)
    return out


def test_apply_penalties_matches_hand_computation() -> None:
    vocab = 8
    rows = [
        [2.0, -1.5, 0.5, -0.25, 0.0, 3.0, -2.0, 1.0],
        [-1.0, 2.5, -0.5, 0.75, 1.5, -3.0, 0.0, 0.25],
        [0.3, 0.2, 0.1, 0.0, -0.1, -0.2, -0.3, -0.4],
        [1.0, 1.0, -1.0, -1.0, 2.0, 2.0, -2.0, -2.0],
    ]
    cases = [  # prompt, output, repetition, frequency, presence
        ([1, 2, 2], [2, 3, 3, 5], 1.3, 0.5, 0.25),
        ([0, 7], [1, 1, 1, 6], 0.8, -0.4, 0.6),  # penalties < 1 / < 0 encourage repeats
        ([4, 5], [], 2.0, 1.0, 1.0),  # nothing generated: only the prompt-based repetition
        ([0, 1], [2, 3], 1.0, 0.0, 0.0),  # no penalties: row must be untouched
    ]
    reqs = [make_req(None, prompt=p, output=o, repetition_penalty=r, frequency_penalty=f,
                     presence_penalty=pr) for p, o, r, f, pr in cases]
    logits = torch.tensor(rows)
    before = logits.clone()
    got = apply_penalties(logits, reqs)
    assert torch.equal(logits, before)  # input not modified
    assert got.dtype == torch.float32
    for b, (p, o, r, f, pr) in enumerate(cases):
        expect = torch.tensor(hand_penalties(rows[b], p, o, r, f, pr))
        torch.testing.assert_close(got[b], expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])
    assert got.shape == (4, vocab)


@pytest.mark.parametrize("mixed", [False, True])
def test_apply_penalties_on_long_histories_matches_hand_computation(mixed: bool) -> None:
    """Every row penalised (computed in place) or some rows not (computed apart): repeated ids,
    the first and last id of the vocabulary, an empty output, prompt and output overlapping."""
    vocab, batch = 300, 12
    gen = torch.Generator().manual_seed(40)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    reqs, cases = [], []
    for b in range(batch):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 200, (1,), generator=gen)),),
                               generator=gen).tolist() + [0, vocab - 1]
        output = torch.randint(0, 40, (int(torch.randint(0, 150, (1,), generator=gen)),),
                               generator=gen).tolist()
        case = (1.0, 0.0, 0.0) if mixed and b % 3 == 0 else (1.0 + 0.1 * (b % 4),
                                                              0.3 * (b % 3), 0.2 * (b % 2))
        if not mixed and case == (1.0, 0.0, 0.0):
            case = (1.2, 0.0, 0.0)
        cases.append((prompt, output, *case))
        reqs.append(make_req(None, prompt=prompt, output=output, repetition_penalty=case[0],
                             frequency_penalty=case[1], presence_penalty=case[2]))
    got = apply_penalties(logits, reqs)
    for b, (prompt, output, rep, freq, pres) in enumerate(cases):
        want = torch.tensor(hand_penalties(logits[b].tolist(), prompt, output, rep, freq, pres))
        torch.testing.assert_close(got[b], want, rtol=1e-6, atol=1e-6)
        if (rep, freq, pres) == (1.0, 0.0, 0.0):
            assert torch.equal(got[b], logits[b])


def test_token_counts() -> None:
    counts = token_counts([[0, 2, 2], [], [3, 3, 3, 1]], 4)
    assert counts.tolist() == [[1, 0, 2, 0], [0, 0, 0, 0], [0, 1, 0, 3]]


def test_greedy_uses_penalised_logits_and_logprobs_use_raw() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]] * 3)
    reqs = [make_req(temperature=0.0, output=[0], repetition_penalty=1.2),  # 1.67 < 1.9
            make_req(temperature=0.0, output=[0], frequency_penalty=0.5),  # 1.5 < 1.9
            make_req(temperature=0.0, output=[0, 0, 1], frequency_penalty=0.5)]  # 1.0 < 1.4
    out = sampler(4).sample(logits, reqs)
    assert out.tokens.tolist() == [1, 1, 1]  # token 0 penalised below token 1
    raw = torch.log_softmax(logits.double(), dim=-1)[:, 1].float()
    torch.testing.assert_close(out.logprobs, raw)  # even where token 1 itself was penalised


# -- distribution and logprobs ------------------------------------------------------------------


def _assert_frequencies(tokens: list[int], probs: list[float]) -> None:
    n = len(tokens)
    counts = Counter(tokens)
    for tok, p in enumerate(probs):
        freq = counts.get(tok, 0) / n
        assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / n) + 2e-3, (tok, freq, p)


def test_empirical_distribution_matches_softmax() -> None:
    n = 20_000
    row = [1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -0.5, 0.25]
    logits = torch.tensor(row).expand(n, 8).clone()
    gen = torch.Generator().manual_seed(9)  # one generator shared by all rows: sequential draws
    reqs = [Req(prompt_ids=[0], params=SamplingParams(), generator=gen) for _ in range(n)]
    _assert_frequencies(sampler(8).sample(logits, reqs).tokens.tolist(), softmax64(row))


def test_empirical_distribution_with_temperature_and_top_k() -> None:
    n = 20_000
    row = [1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -0.5, 0.25]
    logits = torch.tensor(row).expand(n, 8).clone()
    gen = torch.Generator().manual_seed(10)
    params = SamplingParams(temperature=0.7, top_k=4)
    reqs = [Req(prompt_ids=[0], params=params, generator=gen) for _ in range(n)]
    p = softmax64(row, 0.7)
    top = ref_top_k(p, 4)
    mass = sum(p[i] for i in top)
    expect = [p[i] / mass if i in top else 0.0 for i in range(8)]
    _assert_frequencies(sampler(8).sample(logits, reqs).tokens.tolist(), expect)


@pytest.mark.parametrize("cols", [640, 1000])  # row_argmax in 256-wide blocks; in one piece
def test_sample_from_probs_frequencies_and_zeros(cols: int) -> None:
    """Draws against the exact probabilities (mass spread along the row, long runs of tokens at
    0, the first and last token carrying mass); a token of probability 0 is never drawn."""
    n = 20_000
    weights = [0.0] * cols
    for tok, w in [(0, 1.0), (63, 2.0), (64, 0.5), (200, 3.0), (201, 1.0), (cols - 1, 1.5),
                   (cols // 2, 0.25)]:
        weights[tok] = w
    total = sum(weights)
    expect = [w / total for w in weights]
    probs = torch.tensor(expect, dtype=torch.float32).expand(n, cols).contiguous()
    gen = torch.Generator().manual_seed(21)
    tokens = sample_from_probs(probs, [gen] * n).tolist()
    assert all(weights[t] > 0 for t in tokens)
    _assert_frequencies(tokens, expect)


def test_sample_from_probs_row_draw_uses_only_its_generator() -> None:
    """Row i's token depends on generators[i] and its own row alone."""
    probs = torch.softmax(torch.randn(3, 256, generator=torch.Generator().manual_seed(3)), -1)
    alone = sample_from_probs(probs[1:2], [torch.Generator().manual_seed(5)])
    gens = [torch.Generator().manual_seed(s) for s in (1, 5, 9)]
    assert int(sample_from_probs(probs, gens)[1]) == int(alone[0])


def test_logprobs_are_raw_log_softmax_at_chosen_token() -> None:
    batch, vocab = 24, 50
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(11)) * 3
    kinds: list[dict[str, Any]] = [
        {}, {"temperature": 0.0}, {"temperature": 0.5, "top_k": 5}, {"top_p": 0.5},
        {"min_p": 0.1, "temperature": 1.3}, {"repetition_penalty": 1.5, "presence_penalty": 1.0},
    ]
    reqs = [make_req(i, output=[1, 2, 3], **kinds[i % len(kinds)]) for i in range(batch)]
    out = sampler(vocab).sample(logits, reqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    expect = ref[torch.arange(batch), out.tokens].float()
    torch.testing.assert_close(out.logprobs, expect, rtol=1e-5, atol=1e-5)


# -- top_logprobs -------------------------------------------------------------------------------


def ref_top_logprobs(row: list[float], k: int) -> list[tuple[int, float]]:
    """The k most likely (id, log-prob) pairs of a raw logit row, in float64 plain Python."""
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    return [(i, row[i] - lse) for i in order]


def test_top_logprobs_mixed_k_match_float64_reference() -> None:
    batch, vocab = 12, 64
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(12)) * 4
    asks = [(0, 2, 5)[i % 3] for i in range(batch)]
    kinds: list[dict[str, Any]] = [
        {}, {"temperature": 0.0}, {"temperature": 0.5, "top_k": 3}, {"top_p": 0.3},
        {"repetition_penalty": 1.8, "frequency_penalty": 1.0},  # top list still from raw logits
        {"min_p": 0.2, "temperature": 1.5},
    ]
    reqs = [make_req(i, output=[int(logits[i].argmax()), 1], top_logprobs=k, **kinds[i % 6])
            for i, k in enumerate(asks)]
    out = sampler(vocab).sample(logits, reqs)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == out.top_logprobs.shape == (batch, 5)  # K = max asked
    assert out.top_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32
    assert out.top_ids.device.type == "cpu" and out.top_logprobs.device.type == "cpu"
    for b, k in enumerate(asks):
        got = list(zip(out.top_ids[b].tolist(), out.top_logprobs[b].tolist()))
        # every row carries K entries; the scheduler keeps the first top_logprobs of them
        ref = ref_top_logprobs(logits[b].tolist(), 5)
        for (gi, gl), (ri, rl) in zip(got[:k] if k else got, ref):
            assert gi == ri
            assert abs(gl - rl) <= 1e-5 * max(1.0, abs(rl)), (b, gi, gl, rl)
        assert out.top_logprobs[b].tolist() == sorted(out.top_logprobs[b].tolist(), reverse=True)


def test_chosen_token_logprob_matches_top_entry() -> None:
    batch, vocab = 16, 100
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(13)) * 3
    greedy = [make_req(temperature=0.0, top_logprobs=3) for _ in range(batch)]
    out = sampler(vocab).sample(logits, greedy)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert torch.equal(out.tokens, out.top_ids[:, 0])  # greedy picks the most likely token
    torch.testing.assert_close(out.logprobs, out.top_logprobs[:, 0], rtol=0, atol=1e-6)
    # sampled rows: wherever the chosen token is in the top list, the two log-probs agree
    sampled = [make_req(i, temperature=2.0, top_logprobs=20) for i in range(batch)]
    out = sampler(vocab).sample(logits, sampled)
    assert out.top_ids is not None and out.top_logprobs is not None
    hits = 0
    for b in range(batch):
        ids = out.top_ids[b].tolist()
        if int(out.tokens[b]) in ids:
            hits += 1
            j = ids.index(int(out.tokens[b]))
            assert abs(float(out.top_logprobs[b, j]) - float(out.logprobs[b])) <= 1e-6
    assert hits > 0


def test_top_logprobs_absent_when_not_asked_and_skip_padding() -> None:
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(14))
    out = sampler(12).sample(logits, [make_req(i) for i in range(3)])
    assert out.top_ids is None and out.top_logprobs is None
    logits[:, 8:] = 100.0  # padding columns past the real vocabulary of 8
    out = sampler(8).sample(logits, [make_req(0, top_logprobs=6), make_req(1), make_req(2)])
    assert out.top_ids is not None and out.top_ids.shape == (3, 6)
    assert bool((out.top_ids < 8).all())
    assert out.top_ids[0].tolist() == [i for i, _ in ref_top_logprobs(logits[0, :8].tolist(), 6)]


def test_top_logprobs_larger_than_vocab_returns_whole_vocab() -> None:
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(15))
    out = sampler(8).sample(logits, [make_req(0, top_logprobs=20), make_req(1)])
    assert out.top_ids is not None and out.top_ids.shape == (2, 8)
    assert set(out.top_ids[0].tolist()) == set(range(8))


def test_top_logprobs_validation() -> None:
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams(top_logprobs=bad)
    assert SamplingParams(top_logprobs=0).top_logprobs == 0
    assert SamplingParams(top_logprobs=20).top_logprobs == 20
