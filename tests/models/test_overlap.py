"""Overlap scheduling: identical results on and off, no token after finish, no page freed while a
step in flight still writes it (HF greedy is the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minisgl.core import LLM, SamplingParams
from minisgl.core.scheduler import Scheduler

from .reference import DEVICE, assert_all_free, hf_greedy, make_prompts, submit

SPEC = "llama-gqa-untied-llama3"
LENGTHS = [5, 17, 33, 2, 40, 9, 26, 12]


def run(path: Path, backend: str, prompts: list[list[int]], params: list[SamplingParams],
        **kw: Any) -> tuple[list[list[int]], list[str], Scheduler]:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 200)
    llm = LLM(model=str(path), dtype="float32", device=DEVICE, attention_backend=backend, **kw)
    outs = llm.generate(prompts, params)
    llm.scheduler.close()
    assert_all_free(llm.engine, llm.scheduler)
    return [o.token_ids for o in outs], [o.finish_reason for o in outs], llm.scheduler


def params_with_stops(path: Path, prompts: list[list[int]]) -> list[SamplingParams]:
    """Requests that stop at different steps on a stop token (found from the HF reference)."""
    out = []
    for i, p in enumerate(prompts):
        ref = hf_greedy(path, p, 12)
        stop = [ref[i % 6 + 2]] if i % 2 else []
        out.append(SamplingParams(max_tokens=4 + i, temperature=0, ignore_eos=True,
                                  stop_token_ids=stop))
    return out


def expected(path: Path, prompt: list[int], sp: SamplingParams) -> list[int]:
    ref = hf_greedy(path, prompt, sp.max_tokens)
    for i, t in enumerate(ref):
        if t in sp.stop_token_ids:
            return ref[: i + 1]
    return ref


@pytest.mark.parametrize("kw", [
    {},
    {"max_prefill_tokens": 7},  # chunked prefill
    {"num_pages": 13, "max_prefill_tokens": 16},  # tight pool (the least that fits): retraction
    {"cache": "naive", "schedule_policy": "lpm"},
], ids=["roomy", "chunked", "tight", "naive-lpm"])
def test_overlap_on_and_off_give_the_hf_greedy_result(tiny_dirs: dict[str, Path],
                                                      attention_backend: str, kw: dict) -> None:
    path = tiny_dirs[SPEC]
    prompts = make_prompts(LENGTHS, 256, seed=11)
    prompts += [prompts[1][:10] + p for p in make_prompts([3, 8], 256, seed=12)]  # shared prefix
    params = params_with_stops(path, prompts)
    want = [expected(path, p, sp) for p, sp in zip(prompts, params)]
    on, reasons, sched = run(path, attention_backend, prompts, params, overlap=True, **kw)
    off, reasons_off, _ = run(path, attention_backend, prompts, params, overlap=False, **kw)
    assert on == off == want
    assert reasons == reasons_off
    assert all(r == ("stop" if sp.stop_token_ids and t[-1] in sp.stop_token_ids else "length")
               for r, sp, t in zip(reasons, params, want))
    if "num_pages" in kw:
        assert sched.stats.retractions > 0


def test_no_token_after_finish_and_no_page_freed_in_flight(tiny_dirs: dict[str, Path],
                                                           attention_backend: str) -> None:
    """Drive the overlapped scheduler by hand and watch every event and every page free."""
    path = tiny_dirs[SPEC]
    llm = LLM(model=str(path), dtype="float32", device=DEVICE, attention_backend=attention_backend,
              page_size=2, num_pages=27, max_prefill_tokens=16, overlap=True)
    sched = llm.scheduler
    page = sched.config.page_size
    prompts = make_prompts(LENGTHS, 256, seed=5)
    params = params_with_stops(path, prompts)
    free, prepare = sched.engine.allocator.free, sched.engine.prepare
    writes: dict[int, set[int]] = {}  # id(batch) -> pages its step writes K/V into
    with_placeholders = []  # steps whose inputs wait on the step in flight (Engine._forward)

    def recording_prepare(batch: Any) -> Any:
        inputs = prepare(batch)
        writes[id(batch)] = {int(s) // page for s in inputs.layout.out_loc}
        assert inputs.placeholders == bool((inputs.input_ids < 0).any())
        with_placeholders.append(inputs.placeholders)
        return inputs

    def checked_free(pages: list[int]) -> None:
        for batch, _ in sched._inflight:
            clash = writes[id(batch)] & set(pages)
            assert not clash, f"pages {clash} freed while a step in flight writes them"
        free(pages)

    sched.engine.prepare = recording_prepare  # type: ignore[method-assign]
    sched.engine.allocator.free = checked_free  # type: ignore[method-assign]
    reqs = submit(sched, prompts, params)
    finished: set[int] = set()
    for _ in range(500):
        if not sched.has_work():
            break
        for req in sched.step():
            assert req.rid not in finished, "a request emitted a token after it finished"
            assert all(t >= 0 for t in req.output_ids[: len(req.output_ids) - (not req.finished)])
            if req.finished:
                finished.add(req.rid)
        sched.check_integrity()
    assert finished == {r.rid for r in reqs}
    assert any(with_placeholders) and not all(with_placeholders)
    assert sched.stats.retractions > 0  # the pool is tight enough to preempt
    for req, p, sp in zip(reqs, prompts, params):
        assert req.output_ids == expected(path, p, sp)
        assert len(req.output_logprobs) == len(req.output_ids)
    sched.close()
    assert_all_free(sched.engine, sched)
