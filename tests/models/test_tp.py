"""Tensor parallelism offline: ``LLM(tp=N)`` against ``LLM(tp=1)`` and HF transformers.

Every tiny checkpoint of conftest.SPECS splits 2 ways (GQA 4/2 and 6/2 shard the KV heads, MQA 4/1
replicates its one KV head on both ranks; tied and untied vocab-parallel heads; Qwen2's q/k/v
biases split with their heads). They run with
page size 4 and 24-token prefill chunks, so prompts up to 150 tokens are prefilled in pieces.

Measured float32 logits of every sampled row (8 prompts x 32 greedy steps per checkpoint, chunked
prefill, rank 0's full-vocabulary logits after the LM head's all-gather): TP=2 vs TP=1 max abs diff
2.1e-6 .. 4.4e-6, TP=2 vs HF 2.0e-6 .. 5.6e-6 (TP=1 vs HF: 1.8e-6 .. 5.7e-6, the same size: the
split only reorders float32 sums). ATOL = 1e-4, as in test_hf_reference, leaves an 18x margin, and
the greedy references have no top-1 / top-2 gap below 2 * ATOL (checked there for PROMPTS and here
for the prefix-sharing prompts), so a greedy mismatch is a bug, not rounding.

SmolLM2 (slow) at TP=3 vs TP=1: chosen-token log-probs differ by at most 7.6e-6 and top-5
log-probs by 2.8e-5 over 3 chats x 32 tokens; the bound is test_smollm2's 2e-4 (30 layers of
float32 rounding, on logits; a log-prob differs by at most twice the largest logit difference).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import LLM, RequestOutput, SamplingParams
from minisgl.core.config import ModelConfig, check_tp_split
from tests.procs import children

from .conftest import SPECS, VOCAB, TinySpec
from .reference import (
    assert_all_free,
    explain_mismatch,
    greedy,
    hf_greedy,
    hf_logits,
    make_prompts,
    record_logits,
)

ATOL = 1e-4
SMOL_TOL = 2e-4
STEPS = 32
PAGE_SIZE = 4
CHUNK = 24  # max_prefill_tokens: the 40..150-token prompts are prefilled in 2..7 chunks
LENGTHS = [1, 3, 17, 40, 65, 90, 150, 7]
PROMPTS = make_prompts(LENGTHS, VOCAB, seed=1234)  # test_hf_reference's: no near ties there
FAIL_TIMEOUT = 30.0  # seconds within which a dead rank must surface as an error


def tp_llm(path: Path | str, tp: int, **kw: Any) -> LLM:
    kw.setdefault("page_size", PAGE_SIZE)
    kw.setdefault("max_prefill_tokens", CHUNK)
    kw.setdefault("num_pages", 512)  # the default 1 GiB pool per rank is far more than needed
    # a rank that never joins holds rank 0 in the rendezvous for max(dist_timeout, 60) s (see
    # test_rank_that_dies_during_startup_fails_llm_promptly): 60 s, not the default 300 s
    kw.setdefault("dist_timeout", 60.0)
    return LLM(str(path), dtype="float32", tp=tp, **kw)


def close_cleanly(llm: LLM) -> None:
    """close(), then every other rank has exited by itself with status 0."""
    workers = list(llm._workers)
    llm.close()
    assert llm._workers == []
    assert [p.exitcode for p in workers] == [0] * len(workers)


def child_pids() -> set[int]:
    """Live child processes of this process."""
    return children(os.getpid())


def assert_no_new_children(before: tuple[set[int], set[Any]]) -> None:
    """No child process was started since ``before`` (from child_pids() and mp.active_children());
    the module-scoped TP=2 LLM of the last tiny spec may still be running."""
    assert child_pids() <= before[0]
    assert set(mp.active_children()) <= before[1]


def call_with_timeout(fn: Callable[[], Any], timeout: float) -> tuple[Any, BaseException | None]:
    """Run ``fn`` on a daemon thread; fail the test (instead of hanging CI) if it takes longer."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: B036 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {timeout} s (hang)")
    return box.get("result"), box.get("error")


def assert_no_near_ties(path: Path, prompt: list[int], ref: list[int]) -> None:
    """HF's greedy picks for ``prompt`` each win by more than 2 * ATOL."""
    rows = hf_logits(path, prompt + ref[:-1])[len(prompt) - 1:]
    top2 = rows.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == ref
    gap = float((top2.values[:, 0] - top2.values[:, 1]).min())
    assert gap > 2 * ATOL, f"near tie (gap {gap}) in the greedy reference of a test prompt"


def check_logits(path: Path, records: list[tuple[list[int], torch.Tensor]],
                 ref_records: list[tuple[list[int], torch.Tensor]], what: str) -> float:
    """Every recorded TP row within ATOL of HF and of the TP=1 row for the same sequence; returns
    the largest difference seen."""
    ref = {tuple(seq): row for seq, row in ref_records}
    assert len(records) == len(ref_records) and set(ref) == {tuple(s) for s, _ in records}
    worst = 0.0
    for seq, row in records:
        assert row.shape == (VOCAB,) and row.dtype == torch.float32
        d_tp1 = float((row - ref[tuple(seq)]).abs().max())
        d_hf = float((row - hf_logits(path, seq)[-1]).abs().max())
        assert max(d_tp1, d_hf) <= ATOL, (
            f"{what}: logits after {len(seq)} tokens: {d_tp1} from TP=1, {d_hf} from HF")
        worst = max(worst, d_tp1, d_hf)
    return worst


def assert_idle_and_consistent(llm: LLM) -> None:
    """Nothing runs; every KV page of rank 0 is free or owned by the prefix cache."""
    s, e = llm.scheduler, llm.engine
    assert not s.has_work()
    s.check_integrity()
    assert e.allocator.num_free + s.cache.total_pages == e.allocator.capacity


# -- the tiny checkpoints, each at TP=1 and TP=2 ---------------------------------------------


@dataclass
class Pair:
    spec: TinySpec
    path: Path
    tp1: LLM
    tp2: LLM


@pytest.fixture(scope="module", params=SPECS, ids=str)
def pair(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> Iterator[Pair]:
    spec: TinySpec = request.param
    path = tiny_dirs[spec.name]
    tp1 = tp_llm(path, 1)
    tp2 = tp_llm(path, 2)
    assert len(tp2._workers) == 1 and tp2._workers[0].is_alive()
    try:
        yield Pair(spec, path, tp1, tp2)
    finally:
        tp1.close()
        close_cleanly(tp2)


def test_every_tiny_spec_splits_two_ways(tiny_dirs: dict[str, Path]) -> None:
    kv_heads = set()
    for spec in SPECS:
        mc = ModelConfig.from_pretrained(str(tiny_dirs[spec.name]))
        check_tp_split(mc, 2)
        kv_heads.add(mc.num_kv_heads)
    assert 1 in kv_heads and 2 in kv_heads  # KV-head replication and KV-head sharding both run


def generate_recorded(llm: LLM, prompts: list[list[int]], params: SamplingParams
                      ) -> tuple[list[RequestOutput], list[tuple[list[int], torch.Tensor]]]:
    with record_logits(llm.engine) as records:
        outs = llm.generate(prompts, params)
    return outs, records


def test_greedy_and_logits_match_tp1_and_hf(pair: Pair) -> None:
    """8 prompts (1..150 tokens, chunked prefill) x 32 greedy tokens in one generate: TP=2 picks
    HF's tokens and TP=1's, and every sampled row's logits are within ATOL of both."""
    path = pair.path
    ref_outs, ref_records = generate_recorded(pair.tp1, PROMPTS, greedy(STEPS))
    outs, records = generate_recorded(pair.tp2, PROMPTS, greedy(STEPS))
    for p, out, ref in zip(PROMPTS, outs, ref_outs):
        want = hf_greedy(path, p, STEPS)
        assert out.token_ids == want, f"{pair.spec}: {explain_mismatch(path, p, out.token_ids, want)}"
        assert ref.token_ids == want
        assert out.finish_reason == "length" and out.prompt_token_ids == p
    check_logits(path, records, ref_records, str(pair.spec))
    assert len(records) == len(PROMPTS) * STEPS
    assert_all_free(pair.tp2.engine, pair.tp2.scheduler)
    assert_all_free(pair.tp1.engine, pair.tp1.scheduler)


def prefix_prompts(first: list[list[int]], first_out: list[list[int]]) -> list[list[int]]:
    """Prompts that share long prefixes with the first batch: part of a prompt, a whole prompt
    plus part of its generated tokens, and a prompt extended by its full output."""
    tails = make_prompts([5, 9, 3, 12, 1], VOCAB, seed=77)
    return [
        first[3][:30] + tails[0],  # 30 of 40 prompt tokens
        first[5] + first_out[5][:10] + tails[1],  # the prompt and 10 generated tokens
        first[6][:120] + tails[2],  # 120 of 150
        first[4] + first_out[4] + tails[3],  # prompt + all 32 generated tokens
        first[2] + tails[4],  # the whole 17-token prompt
    ]


def test_prefix_reuse_keeps_tokens_and_logits(pair: Pair) -> None:
    """A second generate whose prompts share long prefixes with the first: the prefix comes from
    the cache (cached_tokens > 0, on rank 0 and, by lockstep, on the other rank), the results
    are still TP=1's and HF's."""
    path = pair.path
    first = list(PROMPTS)
    ref_first = pair.tp1.generate(first, greedy(STEPS))
    out_first = pair.tp2.generate(first, greedy(STEPS))
    assert [o.token_ids for o in out_first] == [o.token_ids for o in ref_first]
    assert_idle_and_consistent(pair.tp2)
    assert pair.tp2.scheduler.cache.total_pages > 0

    second = prefix_prompts(first, [o.token_ids for o in out_first])
    for p in second:
        assert_no_near_ties(path, p, hf_greedy(path, p, STEPS))
    ref_outs, ref_records = generate_recorded(pair.tp1, second, greedy(STEPS))
    outs, records = generate_recorded(pair.tp2, second, greedy(STEPS))
    for p, out, ref in zip(second, outs, ref_outs):
        want = hf_greedy(path, p, STEPS)
        assert out.token_ids == want, f"{pair.spec}: {explain_mismatch(path, p, out.token_ids, want)}"
        assert ref.token_ids == want
        assert out.cached_tokens > 0, f"{pair.spec}: no prefix reuse for a {len(p)}-token prompt"
        assert out.cached_tokens == ref.cached_tokens  # same scheduler decisions as TP=1
    check_logits(path, records, ref_records, f"{pair.spec} (prefix reuse)")
    assert_all_free(pair.tp2.engine, pair.tp2.scheduler)
    assert_all_free(pair.tp1.engine, pair.tp1.scheduler)


def test_seeded_sampling_matches_tp1(pair: Pair) -> None:
    """Rank 0 samples and broadcasts: temperature 1 + seed gives TP=1's tokens (also through
    top-k/top-p and a repetition penalty, which reads the request's previous tokens)."""
    prompts = [PROMPTS[i] for i in (1, 3, 4, 7)]
    params = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=3,
                       ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, repetition_penalty=1.3, seed=4,
                       ignore_eos=True, top_logprobs=3),
    ]
    ref = pair.tp1.generate(prompts, params)
    outs = pair.tp2.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    greedy_ids = [hf_greedy(pair.path, p, STEPS)[:24] for p in prompts]
    assert [o.token_ids for o in outs] != greedy_ids  # it really sampled
    for out, r in zip(outs, ref):
        assert max(abs(a - b) for a, b in zip(out.logprobs, r.logprobs)) <= 2 * ATOL
    assert [[i for i, _ in step] for step in outs[3].top_logprobs] == [
        [i for i, _ in step] for step in ref[3].top_logprobs]
    # the same seed again at TP=2: the same tokens
    again = pair.tp2.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert_all_free(pair.tp2.engine, pair.tp2.scheduler)
    assert_all_free(pair.tp1.engine, pair.tp1.scheduler)


def test_overlap_scheduling_at_tp2(tiny_dirs: dict[str, Path]) -> None:
    """The forward worker thread (overlap) at TP=2: the sample broadcast runs on that thread
    while the control channel is used on the scheduler thread; greedy tokens are still HF's."""
    path = tiny_dirs["llama-tied-mqa-bias"]
    llm = tp_llm(path, 2, overlap=True)
    try:
        outs = llm.generate(PROMPTS, greedy(STEPS))
        for p, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_greedy(path, p, STEPS)
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        close_cleanly(llm)


def test_speculative_drafts_at_tp2(tiny_dirs: dict[str, Path]) -> None:
    """Prompt-lookup drafts at TP=2: every rank drafts from the same (broadcast) tokens and
    keeps the same ones, so the ranks stay in step; greedy tokens are still HF's."""
    path = tiny_dirs["llama-tied-mqa-bias"]
    llm = tp_llm(path, 2, speculative_tokens=4)
    try:
        outs = llm.generate(PROMPTS, greedy(STEPS))
        for p, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_greedy(path, p, STEPS)
        assert llm.scheduler.stats.accepted_tokens > 0, "no draft was kept"
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        close_cleanly(llm)


def test_int8_kv_pool_at_tp2_matches_tp1(tiny_dirs: dict[str, Path]) -> None:
    """kv_cache_dtype="int8" at TP=2: each rank quantizes its own KV heads' rows, as one rank
    quantizes all of them: TP=1's greedy tokens, log-probs within float32 noise."""
    path = tiny_dirs["llama-gqa-untied-llama3"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref_llm = tp_llm(path, 1, kv_cache_dtype="int8")
    try:
        ref = ref_llm.generate(PROMPTS, sp)
    finally:
        ref_llm.close()
    llm = tp_llm(path, 2, kv_cache_dtype="int8")
    try:
        assert llm.engine.kv.quantized
        for out, r in zip(llm.generate(PROMPTS, sp), ref):
            assert out.token_ids == r.token_ids
            assert max(abs(a - b) for a, b in zip(out.logprobs, r.logprobs)) <= 1e-3
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        close_cleanly(llm)


def test_compiled_steps_at_tp2_match_tp1_and_hf(tiny_dirs: dict[str, Path]) -> None:
    """compile='wait' at TP=2: each rank compiles its decode graphs alone (collectives act as if
    alone on the dummy warm-up step), then steps run on the graphs with the real collectives
    (all-reduces, the LM head's all-gather) as ops in them: HF's greedy tokens, logits within
    ATOL of TP=1 eager, and both graphs really ran on rank 0."""
    path = tiny_dirs["qwen3-untied"]  # 6 heads and 2 KV heads: both sharded
    tp1 = tp_llm(path, 1, compile="off")
    llm = tp_llm(path, 2, compile="wait", max_running_requests=8)
    try:
        graphs = llm.engine.graphs
        assert graphs is not None and graphs.ready == {("decode", 1, 1), ("decode", 2, 8)}, (
            graphs.describe())
        ref_outs, ref_records = generate_recorded(tp1, PROMPTS, greedy(STEPS))
        outs, records = generate_recorded(llm, PROMPTS, greedy(STEPS))
        for p, out, ref in zip(PROMPTS, outs, ref_outs):
            assert out.token_ids == ref.token_ids == hf_greedy(path, p, STEPS)
        check_logits(path, records, ref_records, "qwen3-untied compiled at TP=2")
        single = llm.generate(PROMPTS[:1], greedy(8))[0]
        assert single.token_ids == hf_greedy(path, PROMPTS[0], 8)
        assert graphs.steps[("decode", 2, 8)] > 0 and graphs.steps[("decode", 1, 1)] >= 7, (
            graphs.steps)
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        tp1.close()
        close_cleanly(llm)


def test_eager_steps_while_compiling_elsewhere_in_the_process(
        tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """While any thread of a process compiles, torch.compiler.is_compiling() reads True in all
    of them, so a rank's eager steps send their collectives down the graph path (the custom ops
    on the bound communicator). Held True on rank 0 for whole requests, eager steps at TP=2
    still all-reduce with rank 1 and give HF's tokens (unbound, the op raised and rank 1 was left
    waiting: the hang seen with background compilation)."""
    path = tiny_dirs["llama-gqa-untied-llama3"]
    llm = tp_llm(path, 2, compile="off")
    try:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        outs = llm.generate(PROMPTS[:4], greedy(12))
        monkeypatch.undo()
        for p, out in zip(PROMPTS[:4], outs):
            assert out.token_ids == hf_greedy(path, p, 12)
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        monkeypatch.undo()
        close_cleanly(llm)


def test_background_compile_at_tp2(tiny_dirs: dict[str, Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """compile='on' (what auto means on CPUs) at TP=2: each rank starts its own compile worker
    (which has no group to talk to: its warm-up runs the collectives as if alone), answers
    requests eager meanwhile, then loads its graphs from the worker's cache in a background
    thread while steps go on; the answers stay HF's before, during and after the switch."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # ranks inherit it
    path = tiny_dirs["llama-gqa-untied-llama3"]
    llm = tp_llm(path, 2, compile="on", max_running_requests=1)
    try:
        graphs = llm.engine.graphs
        assert graphs is not None
        want = hf_greedy(path, PROMPTS[3], 16)
        # requests keep coming while the ranks compile and switch, each on its own clock
        while graphs._thread is not None and graphs._thread.is_alive():
            assert llm.generate(PROMPTS[3:4], greedy(16))[0].token_ids == want
        graphs.join()
        assert graphs.ready == {("decode", 1, 1)}, graphs.describe()
        before = graphs.steps[("decode", 1, 1)]
        assert llm.generate(PROMPTS[3:4], greedy(16))[0].token_ids == want
        assert graphs.steps[("decode", 1, 1)] >= before + 15
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        close_cleanly(llm)


def test_compiled_prefill_at_tp2_matches_eager(tiny_dirs: dict[str, Path]) -> None:
    """bf16 on the CPU attention kernel at TP=2: the prefill graphs (symbolic token and row
    counts around the embedding's all-reduce and the head's all-gather) and the decode graphs
    run, and their logits are as close to float32 TP=1 as bf16 TP=2 eager ones are."""
    from minisgl.backends import cpu_kernels

    if not cpu_kernels.supports(torch.bfloat16, 2, 1, 32):
        pytest.skip(f"no CPU attention kernel here: {cpu_kernels.load_error}")
    path = tiny_dirs["qwen3-tied"]  # head_dim 32; 4 heads / 2 KV heads: 2 / 1 per rank
    prompts = [PROMPTS[i] for i in (2, 3, 5)]  # 17, 40, 90 tokens: chunked (24 a step)
    results = {}
    for tp, dtype, mode in ((1, "float32", "off"), (2, "bfloat16", "off"), (2, "bfloat16", "wait")):
        llm = LLM(str(path), dtype=dtype, tp=tp, compile=mode,
                  max_running_requests=4, num_pages=128, page_size=PAGE_SIZE,
                  max_prefill_tokens=CHUNK, dist_timeout=60.0)
        try:
            with record_logits(llm.engine) as rec:
                llm.generate(prompts, greedy(4))
            if mode == "wait":
                graphs = llm.engine.graphs
                assert graphs is not None and graphs.steps[("prefill", 2, 4)] > 0, graphs.steps
                assert graphs.steps[("decode", 1, 1)] > 0, graphs.steps
        finally:
            close_cleanly(llm)
        results[(tp, mode)] = {tuple(seq): row.float() for seq, row in rec}
    ref, eager, compiled = results.values()
    assert ref.keys() == eager.keys() == compiled.keys() and len(ref) == 12
    for seq, want in ref.items():
        err_eager = float((eager[seq] - want).abs().max())
        err_compiled = float((compiled[seq] - want).abs().max())
        assert err_compiled <= 2 * err_eager + 0.02, (len(seq), err_compiled, err_eager)


# -- splits that cannot work -------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "tp", "needles"), [
    ("llama-gqa-untied-llama3", 3, ["num_attention_heads (4)", "tp (3)"]),
    ("qwen3-untied", 3, ["tp (3)", "num_key_value_heads (2)"]),  # 6 heads split; 2 KV heads don't
    ("llama-tied-mqa-bias", 0, ["tp", "0"]),
])
def test_unsupported_tiny_split_fails_at_start(tiny_dirs: dict[str, Path], spec: str, tp: int,
                                               needles: list[str]) -> None:
    before = child_pids(), set(mp.active_children())
    with pytest.raises(ValueError) as exc:
        tp_llm(tiny_dirs[spec], tp)
    msg = str(exc.value)
    assert all(n in msg for n in needles), msg
    if tp == 0:
        assert re.search(r"\btp\w*\b.*\b0\b", msg), msg
    assert_no_new_children(before)


def test_smollm2_two_ways_fails_at_start(smollm2_path: str) -> None:
    """9 attention heads and 3 KV heads do not split 2 ways; the check reads only config.json."""
    before = child_pids(), set(mp.active_children())
    t0 = time.monotonic()
    with pytest.raises(ValueError) as exc:
        LLM("smollm2", dtype="float32", tp=2)
    msg = str(exc.value)
    assert "num_attention_heads (9)" in msg and "tp (2)" in msg, msg
    assert "num_key_value_heads (3)" in msg, msg
    assert time.monotonic() - t0 < 10.0
    assert_no_new_children(before)


# -- a rank that dies --------------------------------------------------------------------------


def test_killed_rank_fails_generate_and_close_returns(tiny_dirs: dict[str, Path]) -> None:
    """SIGKILL the other rank: the next generate raises (no hang), and close() returns."""
    path = tiny_dirs["llama-gqa-untied-llama3"]
    llm = tp_llm(path, 2)
    worker = llm._workers[0]
    try:
        assert llm.generate(PROMPTS[:2], greedy(4))[0].token_ids == hf_greedy(path, PROMPTS[0],
                                                                               STEPS)[:4]
        worker.kill()
        worker.join(10)
        assert worker.exitcode == -9

        t0 = time.monotonic()
        result, error = call_with_timeout(lambda: llm.generate(PROMPTS[2:5], greedy(8)),
                                          FAIL_TIMEOUT)
        elapsed = time.monotonic() - t0
        assert result is None and error is not None, "generate succeeded without the other rank"
        assert isinstance(error, (RuntimeError, OSError, ConnectionError)), repr(error)
        assert elapsed < FAIL_TIMEOUT
    finally:
        # close() must return (the dead rank cannot be told to exit); it currently re-raises the
        # collective's error, which is tolerated here (see the report)
        _, close_error = call_with_timeout(llm.close, FAIL_TIMEOUT)
        assert close_error is None or isinstance(close_error, RuntimeError), repr(close_error)
        for p in [worker, *llm._workers]:
            p.join(10)
            assert not p.is_alive()


def _rank_fails_to_start(config: Any, *args: Any) -> None:
    """Stands in for minisgl.core.tp.run_rank in a spawned rank (imported there by name): the
    rank fails before it joins the group, as when its model files are missing or it runs out of
    memory."""
    raise RuntimeError(f"rank {config.tp_rank} failed to start (test)")


def test_rank_that_dies_during_startup_fails_llm_promptly(tiny_dirs: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import minisgl.core.llm

    monkeypatch.setattr(minisgl.core.llm, "run_rank", _rank_fails_to_start)
    before = set(mp.active_children())
    _, error = call_with_timeout(
        lambda: tp_llm(tiny_dirs["llama-tied-mqa-bias"], 2, dist_timeout=5.0), 10.0)
    assert isinstance(error, (RuntimeError, ValueError)), repr(error)
    assert "rank1" in str(error) or "rank 1" in str(error), str(error)
    assert set(mp.active_children()) <= before


# -- SmolLM2, real weights ---------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
]


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2_path: str) -> None:
    """9 heads / 3 KV heads / 1536 MLP / 49152 vocab: 3 heads and 1 KV head per rank."""
    sp = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, top_logprobs=5)
    ref_llm = LLM("smollm2", dtype="float32", num_pages=64)
    try:
        ref = ref_llm.chat(CHATS, sp)
    finally:
        ref_llm.close()
    llm = LLM("smollm2", dtype="float32", tp=3, num_pages=64)
    try:
        assert len(llm._workers) == 2
        outs = llm.chat(CHATS, sp)
        assert "Paris" in outs[0].text, outs[0].text
        for out, r in zip(outs, ref):
            assert out.token_ids == r.token_ids and len(out.token_ids) == STEPS
            assert max(abs(a - b) for a, b in zip(out.logprobs, r.logprobs)) <= SMOL_TOL
            for step, ref_step in zip(out.top_logprobs, r.top_logprobs):
                want = dict(ref_step)
                common = [(i, lp) for i, lp in step if i in want]
                assert len(common) >= len(step) - 1  # a near tie may swap the 5th and 6th
                assert all(abs(lp - want[i]) <= SMOL_TOL for i, lp in common)
        assert_all_free(llm.engine, llm.scheduler)
    finally:
        close_cleanly(llm)
