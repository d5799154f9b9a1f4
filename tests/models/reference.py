"""HF transformers as the independent reference, and small helpers to drive the engine.

Everything here runs in float32. The HF models use the eager attention implementation so the
reference does not share the engine's scaled_dot_product_attention path. HF always runs on the
CPU; the engine runs on ``MINISGL_TEST_DEVICE`` (default cpu; tests/gpu/run.sh sets cuda).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from minisgl.core.config import EngineConfig
from minisgl.core.engine import Engine
from minisgl.core.request import Batch, Req
from minisgl.core.sampling_params import SamplingParams
from minisgl.core.scheduler import Scheduler

DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")  # where the engines under test run


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# -- HF side ----------------------------------------------------------------------------------

_HF_MODELS: dict[str, Any] = {}
_HF_GREEDY: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_model(path: str | Path) -> Any:
    """The checkpoint loaded by transformers (float32, eager attention), cached per session."""
    key = str(path)
    if key not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32,
                                                     attn_implementation="eager")
        # the reference never stops at EOS (the engine runs with ignore_eos=True); a None in the
        # generation config passed to generate() would fall back to this default
        model.generation_config.eos_token_id = None
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| (a may live on the engine's device, b is HF's, on the CPU)."""
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs HF {tuple(b.shape)}"
    return float((a.float().cpu() - b.float()).abs().max())


@torch.no_grad()
def hf_logits(path: str | Path, ids: list[int]) -> torch.Tensor:
    """HF float32 logits [len(ids), vocab] of one unpadded sequence."""
    out = hf_model(path)(torch.tensor([ids])).logits[0]
    return out.float()


@torch.no_grad()
def hf_greedy(path: str | Path, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from HF ``generate`` (batch of one, no padding, no EOS stop)."""
    key = (str(path), tuple(prompt), n)
    if key not in _HF_GREEDY:
        from transformers import GenerationConfig

        gen = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0,
                               eos_token_id=None, pad_token_id=0, bos_token_id=None)
        out = hf_model(path).generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), generation_config=gen)
        tokens = out[0, len(prompt):].tolist()
        assert len(tokens) == n, f"HF generate stopped early: {len(tokens)} of {n} tokens"
        _HF_GREEDY[key] = tokens
    return _HF_GREEDY[key]


def explain_mismatch(path: str | Path, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where two greedy continuations diverge, and how close HF's top two logits were there."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i >= min(len(got), len(want)):
        return f"lengths differ: got {len(got)}, want {len(want)}"
    row = hf_logits(path, prompt + want[:i])[-1]
    top = row.topk(2)
    return (f"first divergence at step {i}: got {got[i]}, HF {want[i]} (HF top-2 logits "
            f"{top.values.tolist()} for {top.indices.tolist()}, engine's pick scores "
            f"{row[got[i]].item():.6f}); prompt length {len(prompt)}")


# -- prompts ----------------------------------------------------------------------------------


def make_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts of the given lengths (ids 3.. avoid specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# -- engine side ------------------------------------------------------------------------------


def make_engine(path: str | Path, backend: str, **kw: Any) -> Engine:
    kw.setdefault("page_size", 16)
    kw.setdefault("num_pages", 4096 // kw["page_size"] + 1)
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEVICE)
    return Engine(EngineConfig(model=str(path), attention_backend=backend, **kw))


def assert_all_free(engine: Engine, scheduler: Scheduler | None = None) -> None:
    """Every KV page and every table row is back in its free list (after clearing the cache)."""
    if scheduler is not None:
        assert not scheduler.has_work()
        scheduler.check_integrity()  # the only pages in use are the ones the cache owns
        assert engine.allocator.num_free + scheduler.cache.total_pages == engine.allocator.capacity
        scheduler.clear_cache()
    assert engine.allocator.num_free == engine.allocator.capacity, (
        f"{engine.allocator.capacity - engine.allocator.num_free} KV pages still allocated")
    assert engine.table.num_free == engine.config.max_running_requests, (
        f"{engine.config.max_running_requests - engine.table.num_free} table rows still held")


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_work():
            return
        scheduler.step()
    raise AssertionError(f"scheduler still busy after {max_steps} steps")


@contextlib.contextmanager
def record_logits(engine: Engine) -> Iterator[list[tuple[list[int], torch.Tensor]]]:
    """Record (token ids the logits condition on, logits row) for every sampled row of every step
    the scheduler runs (prefill, chunked prefill and decode alike; with or without overlap)."""
    records: list[tuple[list[int], torch.Tensor]] = []
    pending: dict[int, list[list[int]]] = {}  # id(ForwardInputs) -> conditioning ids per row
    orig_prepare, orig_forward = engine.prepare, engine.forward

    def prepare(batch: Batch) -> Any:
        inputs = orig_prepare(batch)
        pending[id(inputs)] = [r.all_ids[: r.num_computed + n]
                               for r, n, s in zip(batch.reqs, batch.extend_lens, batch.sample) if s]
        return inputs

    def forward(inputs: Any) -> torch.Tensor:
        logits = orig_forward(inputs)
        rows = pending.pop(id(inputs))
        assert logits.shape[0] == len(rows), "logits rows != sampled requests of the batch"
        # overlap scheduling: tokens of the previous step are placeholders until it is collected
        rows = [[t if t >= 0 else engine.resolve(t) for t in ids] for ids in rows]
        records.extend(zip(rows, logits.detach().to("cpu", copy=True)))
        return logits

    engine.prepare, engine.forward = prepare, forward  # type: ignore[method-assign]
    try:
        yield records
    finally:
        del engine.prepare, engine.forward  # back to the class methods


def submit(scheduler: Scheduler, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
           ) -> list[Req]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [Req(list(p), dataclasses.replace(sp)) for p, sp in zip(prompts, plist)]
    for r in reqs:
        scheduler.add(r)
    return reqs
