"""The CPU backend's one-call decoder layer (minisgl_cpu::decoder_layer) in a real engine: decode
steps through it give the tokens and (but for the order of float32 sums) the logits of the
model's own modules, for SmolLM2 in bf16 and int8 and for the family's variants (biases, q/k
norms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.backends import cpu_kernels
from minisgl.core import LLM

from .conftest import SPEC_BY_NAME, VOCAB, save_tiny
from .reference import greedy, make_prompts, record_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.load(),
                                reason="no CPU attention kernel on this machine")


def _run(path: str, fused: bool, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch,
         compile: str = "off", **kw: Any
         ) -> tuple[list[list[int]], list[tuple[list[int], torch.Tensor]], int]:
    """(token ids, recorded logits, decoder_layer calls: compiled, those while tracing) of one
    engine; compiled, every decode step ran on a graph."""
    calls = [0]
    op = cpu_kernels.decoder_layer

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return op(*args)

    monkeypatch.setenv("MINISGL_FUSED_LAYER", "on" if fused else "off")
    monkeypatch.setattr(cpu_kernels, "decoder_layer", counted)
    llm = LLM(path, dtype="bfloat16", compile=compile, **kw)
    with record_logits(llm.engine) as rec:
        ids = [o.token_ids for o in llm.generate(prompts, greedy(24))]
    graphs = llm.engine.graphs
    if compile == "wait":
        assert graphs is not None and not graphs.failed, graphs.describe()
        decode_steps = sum(n for k, n in graphs.steps.items() if k[0] == "decode")
        assert decode_steps >= 24 - 1, graphs.steps
    llm.close()
    monkeypatch.setattr(cpu_kernels, "decoder_layer", op)
    return ids, rec, calls[0]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_fused_decode_gives_the_modules_logits(smollm2_path: str, quantization: str | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 in bf16, three requests at once (one sharing another's 30-token prefix), every
    step's logits against the modules', bf16 and int8 weights: both round every
    intermediate to bf16 at the same points, so they are equal up to the order of float32
    sums."""
    prompts = make_prompts([40, 7, 130], 49152, seed=5)
    prompts[1] = prompts[0][:30] + prompts[1]
    runs = {f: _run(smollm2_path, f, prompts, monkeypatch, quantization=quantization)
            for f in (False, True)}
    (ids0, rec0, calls0), (ids1, rec1, calls1) = runs[False], runs[True]
    assert calls0 == 0 and calls1 >= 30 * (24 - 1)  # every layer of every decode step
    assert ids1 == ids0
    assert len(rec0) == len(rec1)
    diffs = []
    for (c0, l0), (c1, l1) in zip(rec0, rec1):
        assert c0 == c1
        diffs.append((l1 - l0).abs())
    # Measured: bf16 61-67 of 72 rows bit-identical, int8 58 (AVX2 and AVX-512 vectors); once
    # a float32 sum taken in another order (the norms' sums of squares, the SiLU's exp) rounds
    # the other way, that request's later rows differ by a few bf16 steps of logits of ~20
    # (bf16 at most 0.34, int8 0.625; means 0.01-0.2). Where that first flip comes is luck:
    # on AMX tiles, over prompt seeds 5-11, the first difference came at rows 6, 7, 17, 18 and
    # 45 of 72, or never (36-62 rows exact), and with the prefill attention's previous exp
    # polynomial (other prefill values, the same decode code) at rows 10, 27, 42 and 44; on
    # seeds 7 and 10 a flip met a near tie and the greedy tokens parted (so the ids check holds
    # for this seed, not for every prompt). Each engine repeats itself bit for bit. So the check
    # is the first step (3 rows: the prefill, the same path in both engines), a floor on the
    # exact rows, and the size of the differences.
    exact = sum(bool((d == 0).all()) for d in diffs)
    assert all(bool((d == 0).all()) for d in diffs[:3]), [d.max().item() for d in diffs[:3]]
    assert exact >= 0.4 * len(diffs), [round(d.max().item(), 3) for d in diffs]
    assert max(d.max().item() for d in diffs) <= 1.0


@pytest.mark.parametrize(("name", "overrides"), [
    ("llama-tied-mqa-bias", {"attention_bias": False}),
    ("llama-tied-mqa-bias", {"attention_bias": True}),  # biases on q, k, v and o
    ("qwen3-tied", {}),  # RMSNorm on each head of q and k
])
def test_fused_layer_variants(tmp_path: Path, name: str, overrides: dict[str, Any],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny bf16 models of the family (head_dim 32, the kernel's smallest): every decode step's
    layers in one call, with the modules' tokens and (but for rounding order) logits."""
    path = save_tiny(SPEC_BY_NAME[name], tmp_path / "m", head_dim=32, **overrides)
    prompts = make_prompts([9, 20, 33], VOCAB, seed=1)
    kw = {"num_pages": 64, "page_size": 4}
    ids0, rec0, _ = _run(str(path), False, prompts, monkeypatch, **kw)
    ids1, rec1, calls = _run(str(path), True, prompts, monkeypatch, **kw)
    assert calls > 0
    assert ids1 == ids0
    exact = sum(bool(torch.equal(l0, l1)) for (_, l0), (_, l1) in zip(rec0, rec1))
    assert exact >= 0.75 * len(rec0)


def test_fused_layer_in_compiled_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode graphs trace the one call (a mutating op on the pool, a None residual in the
    first layer) and give the eager engine's logits, and its tokens but where eager's logits
    of the two tokens are a rounding apart."""
    path = save_tiny(SPEC_BY_NAME["llama-gqa-untied-llama3"], tmp_path / "m", head_dim=32)
    prompts = make_prompts([9, 40, 21], VOCAB, seed=2)
    kw = {"num_pages": 64, "page_size": 4, "max_running_requests": 4}
    ids0, rec0, calls0 = _run(str(path), True, prompts, monkeypatch, **kw)
    ids1, rec1, calls1 = _run(str(path), True, prompts, monkeypatch, compile="wait", **kw)
    assert calls0 > 0 and calls1 > 0
    # The graph's own ops (embedding, final norm, LM head) round apart from eager's by a few
    # bf16 steps: measured at most 0.08 on logits up to 3.4. That can flip a near tie of this
    # random model (on AMD Zen 3: 3.375 vs 3.375, 3.125 vs 3.094), after which the request's
    # contexts part ways; every row conditioned on the same ids is compared.
    eager = {tuple(c): logits for c, logits in rec0}
    shared = 0
    for c1, l1 in rec1:
        if (l0 := eager.get(tuple(c1))) is not None:
            shared += 1
            torch.testing.assert_close(l1, l0, atol=0.1, rtol=0.02)
    assert shared >= len(prompts)  # at least each request's prefill row
    for prompt, a, b in zip(prompts, ids0, ids1):
        assert len(a) == len(b)
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:  # the graphs picked another token: a near tie in eager's logits
            l0 = eager[tuple(prompt + a[:j])]
            assert (l0[a[j]] - l0[b[j]]).abs().item() <= 0.1, (j, a[j], b[j])

