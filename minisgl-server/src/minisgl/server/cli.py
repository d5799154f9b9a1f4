"""The ``minisgl`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options as flags; names match LLM(...) keyword arguments."""
    from minisgl.core.config import COMPILE_MODES, EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    p.add_argument("--model", default="smollm2", help="HF directory or bundled alias (smollm2)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CPU), bfloat16, float32")
    p.add_argument("--device", default=defaults["device"])
    p.add_argument("--attention-backend", default=defaults["attention_backend"])
    p.add_argument("--sampler", default=defaults["sampler"])
    p.add_argument("--schedule-policy", default=defaults["schedule_policy"],
                   help="batching policy plugin: fcfs, lpm (longest cached prefix first), ...")
    p.add_argument("--cache", default=defaults["cache"], choices=["radix", "naive"],
                   help="prefix cache: radix (reuse shared prefixes) or naive (no reuse)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="build the next step on the host while the current one runs "
                        "(default: on for GPUs unless --speculative-tokens, off on CPU)")
    p.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill steps also compute a token of every decoding request "
                        "(default: on for CPU, off for GPUs)")
    p.add_argument("--page-size", type=int, default=defaults["page_size"])
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=defaults["kv_cache_memory"],
                   help="bytes for the KV pool (ignored with --num-pages)")
    p.add_argument("--max-running-requests", type=int, default=defaults["max_running_requests"])
    p.add_argument("--max-prefill-tokens", type=int, default=defaults["max_prefill_tokens"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=defaults["seed"])
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: weight-only int8 linear layers and LM head (faster CPU decode)")
    p.add_argument("--kv-cache-dtype", default=defaults["kv_cache_dtype"], choices=["auto", "int8"],
                   help="the KV pool's element type: auto (the model's dtype) or int8 (a scale "
                        "per head and token: half the memory of bf16, less for attention to read)")
    p.add_argument("--speculative-tokens", type=int, default=defaults["speculative_tokens"],
                   help="prompt-lookup speculative decoding: up to N tokens per decoding request "
                        "guessed from its own earlier tokens and checked in the same step "
                        "(default 0: off; needs --no-overlap where overlap is on)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per rank (default: the physical cores, split among "
                        "the ranks; OMP_NUM_THREADS)")
    p.add_argument("--adapt-threads", action=argparse.BooleanOptionalAction,
                   default=defaults["adapt_threads"],
                   help="while other processes keep cores busy, time CPU steps with fewer "
                        "threads too and run the faster count (default on; one rank only)")
    p.add_argument("--dist-timeout", type=float, default=defaults["dist_timeout"],
                   help="seconds a TP collective may wait before the deployment fails")
    p.add_argument("--compile", default=None, choices=COMPILE_MODES,
                   help="torch.compile of the decode and prefill steps: on = in the "
                        "background, eager until ready; wait = before serving; auto (default, "
                        "$MINISGL_COMPILE overrides) = on for CPU ranks whose decoder layers run "
                        "as modules (every TP rank), off where the CPU kernels run them in one "
                        "call (as fast eager) and on GPUs; minisgl generate: off unless asked "
                        "for")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = ["dtype", "device", "attention_backend", "sampler", "schedule_policy", "cache",
            "overlap", "mixed_steps", "page_size",
            "num_pages", "kv_cache_memory", "max_running_requests", "max_prefill_tokens",
            "max_model_len", "seed", "tp", "threads", "adapt_threads", "dist_timeout",
            "quantization", "kv_cache_dtype", "speculative_tokens"]
    kw = {k: getattr(args, k) for k in keys}
    if args.compile is not None:  # else EngineConfig's default ($MINISGL_COMPILE or auto)
        kw["compile"] = args.compile
    return kw


def generate_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``engine_kwargs`` with compilation off unless asked for (``--compile`` or
    $MINISGL_COMPILE): a one-shot run ends before the graphs pay for their compile worker (a
    64-token answer took 6.2-6.6 s with it against 3.8-4.7 s without on 2 cores)."""
    kw = engine_kwargs(args)
    if "compile" not in kw and "MINISGL_COMPILE" not in os.environ:
        kw["compile"] = "off"
    return kw


def cmd_plugins(args: argparse.Namespace) -> int:
    from minisgl.core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    print(json.dumps(pm.as_dict(), indent=2) if args.json else pm.describe())
    return 0


def _sampling(args: argparse.Namespace) -> Any:
    from minisgl.core import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from minisgl.core import LLM

    sp = _sampling(args)  # bad values fail before the model loads
    llm = LLM(model=args.model, **generate_kwargs(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], sp)
    else:
        outs = llm.generate(list(args.prompt), sp)
    for prompt, out in zip(args.prompt, outs):
        print(f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, {out.finish_reason}]")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from minisgl.server.launcher import ServerArgs, serve

    return serve(ServerArgs(model=args.model, engine=engine_kwargs(args), host=args.host,
                            port=args.port, api_key=args.api_key,
                            served_model_name=args.served_model_name,
                            max_body_bytes=args.max_body_bytes, log_level=args.log_level,
                            nnodes=args.nnodes, node_rank=args.node_rank,
                            dist_init_addr=args.dist_init_addr,
                            engine_timeout=args.engine_timeout))


def engine_flags(args: argparse.Namespace, kwargs: dict[str, Any] | None = None) -> list[str]:
    """The engine flags of ``args`` (or ``kwargs``) again, for a ``minisgl serve`` started by
    another command."""
    argv = ["--model", args.model]
    for key, value in (kwargs or engine_kwargs(args)).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def cmd_shell(args: argparse.Namespace) -> int:
    from minisgl.server import shell

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return shell.run(args.url, engine_flags(args), params, args.api_key)


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every API route but /health")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models reports (default: --model)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger request bodies are answered with 413")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    p.add_argument("--engine-timeout", type=float, default=300.0,
                   help="seconds the scheduler may go without a heartbeat (a hung engine) before "
                        "the server fails its requests and exits")
    p.add_argument("--nnodes", type=int, default=1, help="machines the --tp ranks are spread over")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index; node 0 serves HTTP, the others only run ranks")
    p.add_argument("--dist-init-addr", default=None,
                   help="host:port where node 0's rank 0 meets the others (required with --nnodes > 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minisgl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed plugins and what they register")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("generate", help="run the offline engine on some prompts")
    add_engine_args(p)
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("shell", help="chat interactively (with a server at --url, or one it starts)")
    add_engine_args(p)
    p.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:1919 "
                   "(default: start one in the background with the engine flags)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=cmd_shell)

    from minisgl.server import bench

    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as e:  # user-facing errors: one line, no traceback
        print(f"minisgl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
