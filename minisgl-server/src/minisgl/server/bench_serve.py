"""The online workload of benchmarks.md: the HTTP server under 1, 8 and 32 concurrent clients.

Each client streams offline-mixed requests (token-id prompts, greedy, ignore_eos) through the
native /generate route, whose events carry token ids, so every token's arrival is timed exactly.
The clients speak plain HTTP/1.1 on asyncio streams, one connection per request: they run on the
server's machine, where their CPU time is the engine's (``_one``). A server the benchmark starts
shares its session, so the kernel's autogroup scheduling gives the clients no CPU share of their
own (``shell.start_server``).
Metrics (as in SGLang's and vLLM's serving benchmarks): request throughput, output tokens/s,
TTFT, TPOT (decode time per token after the first), ITL (gap between token-bearing events) and
end-to-end latency, p50 and p99. Right before the server gets the c=32 request set, the offline
engine runs it in this process, twice: as configured (up to ``max_running_requests``, 64 by
default, at once) and capped at 32 running requests, the concurrency the clients allow the
server. Server throughput over the first is the target's ratio; over the second it isolates the
serving overhead (HTTP, ZMQ, detokenizing, streaming) from the smaller batches 32 clients make.
Each of the three first runs the set once untimed (a fresh engine's first runs fault its KV pool
in). With ``--repeats N`` the triple runs N times on fresh prompts (this machine's throughput
moves +-8% between runs) and the rows are medians.

Each concurrency level gets its own prompts (a fresh seed), so the server's prefix cache never
turns one level's prompts into cache hits for the next.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

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


async def _one(host: str, port: int, path: str, prompt: list[int], n_out: int,
               sampling: dict[str, float] | None = None) -> _Trace:
    """One streamed /generate request over its own connection: plain HTTP/1.1 on asyncio
    streams. The clients share the server's machine, and on a small one every CPU-second they
    spend is taken from the engine's threads (measured: a helper's CPU time comes off the
    engine's wall time about one for one); this client spends about 40% of httpx's."""
    body = json.dumps({"input_ids": prompt, "stream": True, "sampling_params": {
        "max_tokens": n_out, "ignore_eos": True, **(sampling or {"temperature": 0})}}).encode()
    trace = _Trace(time.perf_counter())
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), host.encode(), port, len(body), body))
        status = (await reader.readline()).split(b" ", 2)
        headers = b""
        while (line := await reader.readline()) not in (b"\r\n", b""):
            headers += line.lower()
        if len(status) < 2 or status[1] != b"200":
            raise RuntimeError(f"{path} answered {b' '.join(status[1:]).decode().strip()}: "
                               f"{(await reader.read()).decode(errors='replace')}")
        chunked, buf = b"transfer-encoding: chunked" in headers, b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            elif not (data := await reader.read(65536)):
                break
            buf += data
            *events, buf = buf.split(b"\n\n")
            for raw in events:
                if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if n := len(event["output_ids"]):
                    now = time.perf_counter()
                    if trace.token_times:
                        trace.gaps.append(now - trace.token_times[-1])
                    trace.token_times += [now] * n
    finally:
        writer.close()
    return trace


async def _run_clients(url: str, wl: Workload, concurrency: int,
                       sampling: dict[str, float] | None = None) -> tuple[list[_Trace], float]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"--url: the online benchmark speaks plain http://host:port, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    path = parts.path.rstrip("/") + "/generate"  # the URL's path (a proxy's prefix) comes first
    sem = asyncio.Semaphore(concurrency)

    async def guarded(p: list[int], n: int) -> _Trace:
        async with sem:
            return await _one(host, port, path, p, n, sampling)

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


def _capped_engine(args: Any, running: int, sampling: dict[str, float] | None = None) -> Any:
    """A second offline engine in this process, at most ``running`` requests at once; None
    when the configured engine is not larger than that."""
    from minisgl.core import LLM
    from minisgl.server.bench import MinisglSystem

    kw = bench_engine_kwargs(args)
    if kw["max_running_requests"] <= running:
        return None
    log(f"online: loading an offline engine with max_running_requests={running}")
    return MinisglSystem(LLM(model=args.model, **dict(kw, max_running_requests=running)),
                         f"minisgl-offline-max{running}", sampling)


def _fresh_prompts(wl: Workload, ids: list[int], seed: int) -> Workload:
    """The same lengths with other tokens: a repeat must not hit the prefix caches."""
    rng = random.Random(seed)
    return Workload(wl.name, [[ids[rng.randrange(len(ids))] for _ in p] for p in wl.prompts],
                    list(wl.output_lens))


def _server_rows(c: int, m: dict[str, float], runs: list[dict[str, float]] | None = None
                 ) -> list[Row]:
    rows = []
    for key, value in m.items():
        if key in ("requests", "output_tokens", "seconds"):
            continue
        details: dict[str, Any] = {k: m[k] for k in ("requests", "output_tokens", "seconds")}
        if runs is not None:
            details["runs"] = [r[key] for r in runs]
        rows.append(Row("online", "minisgl-server", f"c={c} {key}", value,
                        key in ("req/s", "output tok/s"), details=details))
    return rows


def bench_online(args: Any, system: Any, ids: list[int]) -> list[Row]:
    """``system`` is the in-process minisgl (MinisglSystem) for the offline reference.

    The lower concurrency levels run once, each after the same requests on an offline engine
    capped at that many running requests (``server/offline-maxC``: the serving overhead there;
    at one client, what ``minisgl shell`` feels). The top level runs ``--repeats`` times (default 1),
    each time with fresh prompts of the same lengths, the offline engine, the capped one and
    the server back to back so that they share the machine's noise; its rows are medians (the
    ratios: medians of each repeat's ratio), every run's value in ``details``."""
    from minisgl.server.cli import engine_flags
    from minisgl.server.shell import start_server

    levels = [int(c) for c in str(args.concurrency).split(",")]
    top = max(levels)
    repeats = args.repeats or 1
    wl_top = offline_mixed(ids, args.num_requests, args.scale, args.data_seed)
    sampling = system.sampling  # --sampling: the server's requests too
    capped = _capped_engine(args, top, sampling)
    proc, url = None, args.url
    if url is None:
        log("online: starting the server")
        proc, url = start_server(engine_flags(args, bench_engine_kwargs(args)))
    rows: list[Row] = []
    try:
        warm = offline_mixed(ids, 2, args.scale * 0.25, args.data_seed + 1000)
        asyncio.run(_run_clients(url, warm, 2, sampling))
        for c in levels:
            if c == top:
                continue
            # fewer requests at low concurrency: each level takes similar time
            full = offline_mixed(ids, args.num_requests, args.scale, args.data_seed + 1 + c)
            n = min(len(full.prompts), max(8, 2 * c))
            wl = Workload(full.name, full.prompts[:n], full.output_lens[:n])
            # the serving overhead at this level: the same requests offline, at most c at once
            low = _capped_engine(args, c, sampling)
            if low is not None:
                try:
                    low_run = low.run_offline(wl)
                finally:
                    low.llm.close()
                log(f"online: offline (max {c} running) {low_run[0] / low_run[1]:.1f} tok/s")
            log(f"online: {c} concurrent clients, {len(wl.prompts)} requests")
            m = summarize(*asyncio.run(_run_clients(url, wl, c, sampling)))
            log(f"online: c={c}: {m['output tok/s']:.1f} tok/s, TTFT p50 {m['TTFT p50 ms']:.0f} ms, "
                f"TPOT p50 {m.get('TPOT p50 ms', 0):.1f} ms")
            rows += _server_rows(c, m)
            if low is not None:
                rows += _ratio_rows(c, f"minisgl-offline-max{c}", f"server/offline-max{c}",
                                    [low_run], [m])
        # A fresh engine's first runs fault its KV pool in (it takes memory as K/V is written and
        # the allocator walks the whole pool: a server's minor faults over three runs of this set
        # 184k / 95k / 1.2k, 356 / 371 / 373 tok/s, measured), so every system runs the set once
        # untimed (fresh prompts, the same lengths) before the repeats.
        log(f"online: warming up every system on the c={top} request set (untimed)")
        warm_top = _fresh_prompts(wl_top, ids, args.data_seed + 4999)
        system.run_offline(warm_top)
        if capped is not None:
            capped.run_offline(warm_top)
        asyncio.run(_run_clients(url, warm_top, top, sampling))
        runs: list[dict[str, float]] = []
        offline: list[tuple[int, float]] = []
        capped_runs: list[tuple[int, float]] = []
        for r in range(repeats):
            wl = wl_top if r == 0 else _fresh_prompts(wl_top, ids, args.data_seed + 7919 * r)
            tag = f" (repeat {r + 1}/{repeats})" if repeats > 1 else ""
            log(f"online: offline engine on the c={top} request set ({len(wl.prompts)} "
                f"requests){tag}")
            offline.append(system.run_offline(wl))
            log(f"online: offline {offline[-1][0]} tokens in {offline[-1][1]:.2f} s = "
                f"{offline[-1][0] / offline[-1][1]:.1f} tok/s")
            if capped is not None:
                capped_runs.append(capped.run_offline(wl))
                log(f"online: offline (max {top} running) {capped_runs[-1][0] / capped_runs[-1][1]:.1f} tok/s")
            log(f"online: {top} concurrent clients, {len(wl.prompts)} requests{tag}")
            runs.append(summarize(*asyncio.run(_run_clients(url, wl, top, sampling))))
            log(f"online: c={top}: {runs[-1]['output tok/s']:.1f} tok/s, TTFT p50 "
                f"{runs[-1]['TTFT p50 ms']:.0f} ms, TPOT p50 {runs[-1].get('TPOT p50 ms', 0):.1f} ms")
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows += _server_rows(top, med, runs if repeats > 1 else None)
        rows += _ratio_rows(top, "minisgl-offline", "server/offline", offline, runs)
        if capped_runs:
            rows += _ratio_rows(top, f"minisgl-offline-max{top}", f"server/offline-max{top}",
                                capped_runs, runs)
    finally:
        if capped is not None:
            capped.llm.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return rows


def _ratio_rows(c: int, name: str, ratio_name: str, offline: list[tuple[int, float]],
                runs: list[dict[str, float]]) -> list[Row]:
    tok_s = [n / secs for n, secs in offline]
    ratios = [r["output tok/s"] / t for r, t in zip(runs, tok_s)]
    many = len(offline) > 1
    return [Row("online", name, f"c={c} output tok/s", statistics.median(tok_s), True,
                details={"runs": tok_s} if many else {"tokens": offline[0][0],
                                                       "seconds": offline[0][1]}),
            Row("online", ratio_name, f"c={c} throughput ratio", statistics.median(ratios), True,
                details={"runs": ratios} if many else {})]
