"""The online workload of benchmarks.md: the HTTP server under 1, 8 and 32 concurrent clients.

Each client streams offline-mixed requests (token-id prompts, greedy, ignore_eos) through the
native /generate route, whose events carry token ids, so every token's arrival is timed exactly.
Metrics (as in SGLang's and vLLM's serving benchmarks): request throughput, output tokens/s,
TTFT, TPOT (decode time per token after the first), ITL (gap between token-bearing events) and
end-to-end latency, p50 and p99. The offline engine runs the c=32 request set in this process
first, twice: as configured (up to ``max_running_requests``, 64 by default, at once) and capped at
32 running requests, the concurrency the clients allow the server. Server throughput over the
first is the target's ratio; over the second it isolates the serving overhead (HTTP, ZMQ,
detokenizing, streaming) from the smaller batches 32 clients make.

Each concurrency level gets its own prompts (a fresh seed), so the server's prefix cache never
turns one level's prompts into cache hits for the next.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from minisgl.server.bench import Row, Workload, bench_engine_kwargs, log, offline_mixed


@dataclass
class _Trace:
    start: float
    token_times: list[float] = field(default_factory=list)  # one per token
    gaps: list[float] = field(default_factory=list)  # between token-bearing events

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], n_out: int) -> _Trace:
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_tokens": n_out, "temperature": 0, "ignore_eos": True}}
    trace = _Trace(time.perf_counter())
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            n = len(event["output_ids"])
            if n:
                now = time.perf_counter()
                if trace.token_times:
                    trace.gaps.append(now - trace.token_times[-1])
                trace.token_times += [now] * n
    return trace


async def _run_clients(url: str, wl: Workload, concurrency: int) -> tuple[list[_Trace], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def guarded(p: list[int], n: int) -> _Trace:
            async with sem:
                return await _one(client, url, p, n)

        t0 = time.perf_counter()
        traces = await asyncio.gather(*(guarded(p, n) for p, n in zip(wl.prompts, wl.output_lens)))
        return list(traces), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(traces: list[_Trace], wall: float) -> dict[str, float]:
    tokens = sum(len(t.token_times) for t in traces)
    ttft = [t.ttft * 1e3 for t in traces]
    tpot = [x * 1e3 for t in traces if (x := t.tpot) is not None]
    itl = [g * 1e3 for t in traces for g in t.gaps]
    e2e = [t.e2e * 1e3 for t in traces]
    out = {"requests": len(traces), "output_tokens": tokens, "seconds": wall,
           "req/s": len(traces) / wall, "output tok/s": tokens / wall}
    for name, vals in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)):
        if vals:
            out[f"{name} p50 ms"], out[f"{name} p99 ms"] = _pct(vals, 0.5), _pct(vals, 0.99)
    return out


def _offline_capped(args: Any, wl: Workload, running: int) -> float | None:
    """Offline tok/s of ``wl`` with at most ``running`` requests at once (a second engine in this
    process, closed after); None when the configured engine is not larger than that."""
    from minisgl.core import LLM
    from minisgl.server.bench import MinisglSystem

    kw = bench_engine_kwargs(args)
    if kw["max_running_requests"] <= running:
        return None
    log(f"online: offline engine again with max_running_requests={running}")
    llm = LLM(model=args.model, **dict(kw, max_running_requests=running))
    try:
        tokens, secs = MinisglSystem(llm).run_offline(wl)
    finally:
        llm.close()
    log(f"online: offline (max {running} running) {tokens} tokens in {secs:.2f} s = "
        f"{tokens / secs:.1f} tok/s")
    return tokens / secs


def bench_online(args: Any, system: Any, ids: list[int]) -> list[Row]:
    """``system`` is the in-process minisgl (MinisglSystem) for the offline reference."""
    from minisgl.server.cli import engine_flags
    from minisgl.server.shell import start_server

    levels = [int(c) for c in str(args.concurrency).split(",")]
    top = max(levels)
    wl_top = offline_mixed(ids, args.num_requests, args.scale, args.data_seed)
    log(f"online: offline engine on the c={top} request set ({len(wl_top.prompts)} requests)")
    tokens, secs = system.run_offline(wl_top)
    offline_tok_s = tokens / secs
    log(f"online: offline {tokens} tokens in {secs:.2f} s = {offline_tok_s:.1f} tok/s")
    capped_tok_s = _offline_capped(args, wl_top, top)
    proc, url = None, args.url
    if url is None:
        log("online: starting the server")
        proc, url = start_server(engine_flags(args, bench_engine_kwargs(args)))
    rows: list[Row] = []
    try:
        warm = offline_mixed(ids, 2, args.scale * 0.25, args.data_seed + 1000)
        asyncio.run(_run_clients(url, warm, 2))
        for c in levels:
            if c == top:
                wl = wl_top
            else:  # fewer requests at low concurrency: each level takes similar time
                full = offline_mixed(ids, args.num_requests, args.scale, args.data_seed + 1 + c)
                n = min(len(full.prompts), max(8, 2 * c))
                wl = Workload(full.name, full.prompts[:n], full.output_lens[:n])
            log(f"online: {c} concurrent clients, {len(wl.prompts)} requests")
            traces, wall = asyncio.run(_run_clients(url, wl, c))
            m = summarize(traces, wall)
            log(f"online: c={c}: {m['output tok/s']:.1f} tok/s, TTFT p50 {m['TTFT p50 ms']:.0f} ms, "
                f"TPOT p50 {m.get('TPOT p50 ms', 0):.1f} ms")
            for key, value in m.items():
                if key in ("requests", "output_tokens", "seconds"):
                    continue
                higher = key in ("req/s", "output tok/s")
                rows.append(Row("online", "minisgl-server", f"c={c} {key}", value, higher,
                                details={k: m[k] for k in ("requests", "output_tokens", "seconds")}))
            if c == top:
                rows.append(Row("online", "minisgl-offline", f"c={c} output tok/s", offline_tok_s,
                                True, details={"tokens": tokens, "seconds": secs}))
                rows.append(Row("online", "server/offline", f"c={c} throughput ratio",
                                m["output tok/s"] / offline_tok_s, True))
                if capped_tok_s is not None:
                    rows.append(Row("online", f"minisgl-offline-max{c}", f"c={c} output tok/s",
                                    capped_tok_s, True))
                    rows.append(Row("online", f"server/offline-max{c}", f"c={c} throughput ratio",
                                    m["output tok/s"] / capped_tok_s, True))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return rows
