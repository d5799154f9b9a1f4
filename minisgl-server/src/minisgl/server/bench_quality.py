"""``minisgl bench quality``: what int8 costs in accuracy, against the unquantized model.

What is compared: the engine flags given (``--quantization int8`` for weight-only int8,
``--kv-cache-dtype int8`` for an int8 KV pool, or both), or int8 weights where neither is given,
against bf16 weights and KV. Perplexity of a fixed text (by default this project's README and docs/architecture.md, found from
the working directory; ``--text`` names other files), teacher-forced in 512-token windows, and the
greedy answers (40 tokens) to a fixed set of chat prompts, side by side. The CPU-performance
issue's bound: int8 perplexity within 2% of the unquantized model's (a test holds it too:
tests/models/test_quantization.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from minisgl.server.bench import log

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
]
DEFAULT_TEXTS = ("README.md", "docs/architecture.md")


def read_text(paths: list[str] | None) -> tuple[str, list[str]]:
    names = paths or list(DEFAULT_TEXTS)
    missing = [p for p in names if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"--text: no such file {missing[0]!r} (the default texts are the "
                                f"project's {', '.join(DEFAULT_TEXTS)}: run from a checkout)")
    return "\n\n".join(Path(p).read_text() for p in names), names


def variant(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The configuration measured against the unquantized one: its name and engine flags."""
    kw = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if kw == {"quantization": None, "kv_cache_dtype": "auto"}:
        kw["quantization"] = "int8"
    parts = [*(["int8 weights"] if kw["quantization"] else []),
             *(["int8 KV"] if kw["kv_cache_dtype"] == "int8" else [])]
    return " + ".join(parts), kw


def measure(args: argparse.Namespace, flags: dict[str, Any], name: str, text: str
            ) -> dict[str, Any]:
    from minisgl.core import LLM, SamplingParams
    from minisgl.server.bench import bench_engine_kwargs, settle_compile

    kw = {**bench_engine_kwargs(args), **flags}
    log(f"loading minisgl ({args.model}, {name})")
    with LLM(model=args.model, **kw) as llm:
        settle_compile(args, llm)
        log(f"{name}: perplexity")
        ppl = llm.perplexity(text, window=512)
        log(f"{name}: {len(PROMPTS)} chat prompts")
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(max_tokens=40, temperature=0))
        return {"perplexity": ppl, "tokens": len(llm.tokenizer.encode(text)),
                "answers": [o.text for o in outs]}


def cmd_quality(args: argparse.Namespace) -> int:
    text, names = read_text(args.text)
    name, flags = variant(args)
    base = measure(args, {"quantization": None, "kv_cache_dtype": "auto"}, "unquantized", text)
    int8 = measure(args, flags, name, text)
    ratio = int8["perplexity"] / base["perplexity"]
    print(f"perplexity of {' + '.join(names)} ({base['tokens']:,} tokens, 512-token windows): "
          f"unquantized {base['perplexity']:.3f}, {name} {int8['perplexity']:.3f} "
          f"({ratio - 1:+.2%}; bound +2%)")
    same, width = 0, max(len(name), len("unquantized")) + 1
    for prompt, a, b in zip(PROMPTS, base["answers"], int8["answers"]):
        same += a == b
        print(f"\n> {prompt}\n  {'unquantized:':<{width}} {a!r}\n  {name + ':':<{width}} {b!r}")
    print(f"\n{same} of {len(PROMPTS)} answers identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": names, "prompts": PROMPTS, "variant": name, "unquantized": base,
                       "int8": int8, "perplexity_ratio": ratio}, f, indent=2)
        log(f"wrote {args.json}")
    return 0
