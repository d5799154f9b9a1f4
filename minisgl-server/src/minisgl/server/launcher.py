"""``minisgl serve``: start the processes, serve HTTP, watch the children, stop everything.

The launcher process is also the API server. Children (tokenizer, scheduler, detokenizer) are
spawned with multiprocessing and die with it. /health answers 503 until the scheduler has loaded
the model. SIGINT/SIGTERM: requests in flight get a final "abort" event, then the children are
stopped. A child that dies turns /health 503, fails the requests in flight, and makes the launcher
exit with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from minisgl.core.config import EngineConfig, ModelConfig
from minisgl.core.gc_pause import paused
from minisgl.server import detokenizer_proc, tokenizer_proc
from minisgl.server.api import Pipeline, build_app
from minisgl.server.ipc import Endpoints


@dataclass
class ServerArgs:
    model: str = "smollm2"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    log_level: str = "warning"
    nnodes: int = 1  # machines the tp ranks are spread over (tp / nnodes each)
    node_rank: int = 0  # this machine: 0 serves HTTP and holds rank 0
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous (needed with nnodes > 1)
    engine_timeout: float = 300.0  # seconds without a scheduler heartbeat before failing


class _Uvicorn(uvicorn.Server):
    """uvicorn, with our shutdown: abort requests in flight first; never re-raise the signal."""

    def __init__(self, config: uvicorn.Config, pipe: Pipeline) -> None:
        super().__init__(config)
        self.pipe = pipe
        self.exit_code = 0
        self.event_loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.event_loop is not None:  # a signal handler: hand the work to the event loop
            self.event_loop.call_soon_threadsafe(self.pipe.abort_all)
        super().handle_exit(sig, frame)


async def _watch(children: list[mp.process.BaseProcess], pipe: Pipeline, server: _Uvicorn,
                 engine_timeout: float) -> None:
    """A child that exits (or a scheduler that stops sending heartbeats for ``engine_timeout``
    seconds: hung) breaks the deployment: fail requests, stop serving, exit 1."""
    while not server.should_exit:
        silent = time.monotonic() - pipe.last_heartbeat
        stuck = pipe.info is not None and silent > engine_timeout
        for p in children:
            if not p.is_alive() or (stuck and p.name == "scheduler"):
                reason = pipe.dead or (
                    f"the scheduler sent no heartbeat for {silent:.0f} s (hung?)" if p.is_alive()
                    else f"the {p.name} process exited with code {p.exitcode}")
                pipe.fail(reason)
                print(f"minisgl: {reason}; shutting down", file=sys.stderr, flush=True)
                server.exit_code = 1
                await asyncio.sleep(0.2)  # let the streams in flight send their error event
                server.should_exit = True
                return
        await asyncio.sleep(0.1)


async def _announce(pipe: Pipeline, args: ServerArgs, started: float) -> None:
    while not pipe.healthy and pipe.dead is None:
        await asyncio.sleep(0.1)
    if pipe.healthy:
        print(f"minisgl: serving {pipe.served_name} on http://{args.host}:{args.port} "
              f"(ready in {time.perf_counter() - started:.1f} s)", flush=True)


def _stop(children: list[mp.process.BaseProcess], timeout: float = 5.0) -> None:
    for p in children:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# The scheduler processes' entry points, by way of functions of this module: the launcher never
# imports scheduler_proc (the engine, torch), only its children do (~130 MB less for the API).
def _run_scheduler(*args: Any) -> None:
    with paused():  # torch and the engine's modules (minisgl.core.gc_pause)
        from minisgl.server import scheduler_proc
    scheduler_proc.run(*args)


def _run_rank(*args: Any) -> None:
    with paused():
        from minisgl.server import scheduler_proc
    scheduler_proc.run_rank(*args)


def rank_configs(args: ServerArgs, path: str) -> tuple[list[EngineConfig], str]:
    """The EngineConfig of every rank on this node, and the rendezvous address."""
    from minisgl.core.child import free_addr
    from minisgl.core.config import check_tp_split

    engine = dict(args.engine)
    tp = int(engine.pop("tp", 1) or 1)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank: must be in [0, nnodes) (got {args.node_rank} of "
                         f"{args.nnodes})")
    if tp % args.nnodes:
        raise ValueError(f"tp: {tp} ranks cannot be spread evenly over {args.nnodes} nodes")
    check_tp_split(ModelConfig.from_pretrained(path), tp)
    if args.dist_init_addr is None and args.nnodes > 1:
        raise ValueError("dist_init_addr: required with nnodes > 1 (host:port of node 0)")
    addr = args.dist_init_addr or free_addr()
    per_node = tp // args.nnodes
    first = args.node_rank * per_node
    return [EngineConfig(model=path, tp_size=tp, tp_rank=r, **engine)
            for r in range(first, first + per_node)], addr


def serve(args: ServerArgs) -> int:
    from minisgl.core.bundled import resolve_model
    from minisgl.core.plugins import get_plugin_manager

    # the tokenizer and detokenizer processes must not start thread pools next to the engine
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine = {k: v for k, v in args.engine.items() if k != "tp"}
    EngineConfig(model=args.model, **engine)  # bad options fail here, before any process
    get_plugin_manager()  # every process loads the plugins itself; a broken one fails here too
    started = time.perf_counter()
    path = resolve_model(args.model)  # the bundled model is converted once, here
    configs, addr = rank_configs(args, path)
    if args.node_rank > 0:
        return _serve_ranks(configs, addr)
    served = args.served_model_name or args.model
    with tempfile.TemporaryDirectory(prefix="minisgl-") as tmp:
        ep = Endpoints.in_dir(tmp)
        return asyncio.run(_serve(args, ep, configs, addr, path, served, started))


def _serve_ranks(configs: list[EngineConfig], addr: str) -> int:
    """A node other than 0: only its ranks; they end when rank 0 ends (or any rank fails)."""
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_run_rank, args=(None, c, addr, len(configs)),
                            name=f"rank{c.tp_rank}") for c in configs]
    for p in children:
        p.start()
    print(f"minisgl: node serving ranks {[c.tp_rank for c in configs]} of {configs[0].tp_size} "
          f"(rendezvous {addr})", flush=True)
    stop = {"sig": 0}

    def on_signal(sig: int, frame: Any) -> None:
        stop["sig"] = sig

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop["sig"] and all(p.is_alive() for p in children):
            time.sleep(0.1)
        failed = [p for p in children if not p.is_alive() and p.exitcode != 0]
    finally:
        _stop(children)
        for s, handler in previous.items():
            signal.signal(s, handler)
    for p in failed:
        print(f"minisgl: {p.name} exited with code {p.exitcode}", file=sys.stderr, flush=True)
    return 1 if failed else 0


async def _serve(args: ServerArgs, ep: Endpoints, configs: list[EngineConfig], addr: str,
                 path: str, served: str, started: float) -> int:
    pipe = Pipeline(ep, served, ModelConfig.from_pretrained(path).generation_defaults)
    ctx = mp.get_context("spawn")
    children = [
        ctx.Process(target=_run_scheduler, args=(ep, configs[0], addr, len(configs)),
                    name="scheduler"),
        *(ctx.Process(target=_run_rank, args=(ep, c, addr, len(configs)),
                      name=f"rank{c.tp_rank}") for c in configs[1:]),
        ctx.Process(target=detokenizer_proc.run, args=(ep, path), name="detokenizer"),
        ctx.Process(target=tokenizer_proc.run, args=(ep, path), name="tokenizer"),
    ]
    for p in children:
        p.start()
        pipe.pids[p.name] = p.pid or 0
    config = uvicorn.Config(build_app(pipe, args.api_key, args.max_body_bytes), host=args.host,
                            port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                            lifespan="off")
    server = _Uvicorn(config, pipe)
    server.event_loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(t) for t in (pipe.receive_forever(),
                                                _watch(children, pipe, server,
                                                       args.engine_timeout),
                                                _announce(pipe, args, started))]
    try:
        await server.serve()
        if not server.started and server.exit_code == 0:
            server.exit_code = 1  # could not bind the port (uvicorn logged why)
    finally:
        for t in tasks:
            t.cancel()
        _stop(children)
        pipe.close()
    return server.exit_code
