"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` over the scheduler."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from minisgl.core.bundled import resolve_model
from minisgl.core.child import free_addr
from minisgl.core.config import EngineConfig, check_tp_split
from minisgl.core.engine import Engine
from minisgl.core.gc_pause import paused
from minisgl.core.request import Req
from minisgl.core.sampling_params import SamplingParams
from minisgl.core.tokenizer import Message, chat_token_ids, load_tokenizer
from minisgl.core.tp import Lockstep, run_rank, start_rank

Prompt = str | list[int]


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # per token, the top_logprobs most likely (token id, log-prob) pairs (SamplingParams.top_logprobs)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class LLM:
    """An engine in this process. Keyword arguments are :class:`EngineConfig` fields.

    >>> llm = LLM(model="smollm2")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str = "smollm2", dtype: str = "auto", tp: int = 1,
                 **kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"tp_rank", "tp_size"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM got unknown options {unknown}; known: {sorted(known | {'tp'})}")
        # (outside the pause: a first run converts the bundled model, whose copies are garbage)
        path = resolve_model(model)
        with paused():  # what is built here lives as long as the engine (gc_pause)
            self._start(path, dtype, tp, kwargs)

    def _start(self, path: str, dtype: str, tp: int, kwargs: dict[str, Any]) -> None:
        self.config = EngineConfig(model=path, dtype=dtype, tp_size=tp, **kwargs)
        self._workers: list[Any] = []
        addr = ""
        if tp > 1:  # ranks 1..tp-1 in child processes; this process is rank 0
            import multiprocessing as mp

            from minisgl.core.config import ModelConfig

            check_tp_split(ModelConfig.from_pretrained(path), tp)
            addr = free_addr()
            ctx = mp.get_context("spawn")
            for rank in range(1, tp):
                cfg = dataclasses.replace(self.config, tp_rank=rank)
                proc = ctx.Process(target=run_rank, args=(cfg, addr, tp),
                                   name=f"minisgl-rank{rank}", daemon=True)
                proc.start()
                self._workers.append(proc)
        self._threads = torch.get_num_threads()  # TP ranks split the cores; restored by close()
        try:
            scheduler, channel = start_rank(
                self.config, addr, local_ranks=tp,
                dead_ranks=lambda: [i + 1 for i, p in enumerate(self._workers) if not p.is_alive()])
        except BaseException:
            self._stop_workers()
            raise
        self.engine: Engine = scheduler.engine
        self.scheduler: Any = Lockstep(scheduler, channel)
        self.tokenizer = load_tokenizer(path)

    # -- helpers -----------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids: list[int] = self._need_tokenizer("prompt").encode(prompt)
            return ids
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt: must be a string or a list of token ids")
        return list(prompt)

    def _need_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{field}: {self.config.model} has no tokenizer; pass token ids")
        return self.tokenizer

    def _make_reqs(self, prompts: Sequence[Prompt],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[Req]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        eos = frozenset(self.engine.model_config.eos_token_ids)
        reqs = [Req(self._tokenize(p), dataclasses.replace(sp), eos) for p, sp in zip(prompts, params)]
        for req in reqs:  # validate all before submitting any, so a bad one leaves no trace
            self.scheduler.validate(req)
        return reqs

    def _run(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.scheduler.add(req)
        pending = {r.rid for r in reqs}
        try:
            while pending:
                for req in self.scheduler.step():
                    if req.finished:
                        pending.discard(req.rid)
                if not self.scheduler.has_work() and pending:
                    raise RuntimeError("scheduler went idle with requests still pending")
            self.scheduler.drain()  # a step may still run for requests that already finished
        except BaseException:
            for rid in pending:  # Ctrl-C or an error: free what the unfinished requests hold
                self.scheduler.abort(rid)
            self.scheduler.drain()
            raise

    def _output(self, req: Req, prompt: Prompt) -> RequestOutput:
        text = "" if self.tokenizer is None else str(self.tokenizer.decode(
            req.output_ids, skip_special_tokens=True))
        return RequestOutput(prompt if isinstance(prompt, str) else None, req.prompt_ids, text,
                             list(req.output_ids), req.finish_reason or "abort",
                             list(req.output_logprobs), req.cached_tokens,
                             list(req.output_top_logprobs))

    # -- public API --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the forward worker thread (overlap scheduling) and the other TP ranks. The LLM
        is unusable after."""
        try:
            self.scheduler.close()
        finally:
            self._stop_workers()
            torch.set_num_threads(self._threads)

    def _stop_workers(self, timeout: float = 10.0) -> None:
        for proc in self._workers:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self._workers = []

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts are strings or lists of token ids."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # a single prompt
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        reqs = self._make_reqs(batch, sampling_params)
        self._run(reqs)
        return [self._output(r, p) for r, p in zip(reqs, batch)]

    def perplexity(self, text: Prompt, window: int = 512) -> float:
        """exp(mean negative log-likelihood) of ``text`` under the model, in non-overlapping
        windows of ``window`` tokens (the first token of each window is context only). Runs
        while no request does; at one rank."""
        if self.config.tp_size > 1:
            raise NotImplementedError("perplexity: only at tp=1")
        if self.scheduler.has_work():
            raise RuntimeError("perplexity: requests are still running")
        ids = self._tokenize(text)
        kv, total, count = self.scheduler.kv, 0.0, 0
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start: start + window]
            if len(chunk) < 2:
                break
            req = Req(chunk, SamplingParams(max_tokens=1))
            row = self.engine.table.alloc()
            assert row is not None, "perplexity: no free request slot"
            req.table_row = row
            try:
                if not kv.grow(req, len(chunk)):
                    raise RuntimeError(f"perplexity: the KV pool cannot hold {len(chunk)} tokens")
                logprobs = self.engine.prompt_logprobs(req)
            finally:
                self.engine.allocator.free(req.pages)
                self.engine.table.free(row)
            total -= float(logprobs.double().sum())
            count += len(chunk) - 1
        if count == 0:
            raise ValueError("text: needs at least 2 tokens")
        return math.exp(total / count)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        convs: Sequence[list[Message]] = [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[list-item,assignment]
        prompts: list[Prompt] = []
        for conv in convs:
            prompts.append(chat_token_ids(self._need_tokenizer("messages"), conv))
        return self.generate(prompts, sampling_params)
