"""``minisgl bench speculative``: prompt-lookup drafts against none, on answers about real text.

The other workloads prompt with random token ids, whose greedy answers repeat themselves far
more than any real answer (a draft from the previous two tokens is right for ~90% of them,
docs/benchmarks.md, forty-ninth sitting), so they would flatter drafts. This one asks chat
questions about paragraphs of a real text (by default this project's README and
docs/architecture.md; ``--text``): for each of ``--num-requests`` paragraphs (default 8),
"repeat it with its typos fixed" (an answer that quotes), "summarize it" and "ask a question
about it" (answers that quote less); answers end at EOS or 128 tokens (``--scale``), greedy.
Two engines with the engine flags given, one without drafts and one with
``--speculative-tokens`` (4 where not given), run the same requests, alternating ``--repeats``
times (default 3): one request at a time (what ``minisgl shell`` feels) and all of a kind at once.
Reported per kind: output tokens per second (wall time with the prefills, the prefix cache
cleared before each run; the median run's) and the ratio, the tokens a request kept per step,
drafted tokens kept, and how many answers are identical (bf16 rounding differs between a step
of one token and a step of several, so a near tie can go the other way, as it can between
batch sizes without drafts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from minisgl.server.bench import log
from minisgl.server.bench_quality import read_text

TASKS = {
    "quote": "Repeat this text with its typos fixed:\n\n{}",
    "summarize": "Summarize this text:\n\n{}",
    "question": "Ask one question about this text:\n\n{}",
}


def paragraphs(text: str, n: int) -> list[str]:
    """``n`` paragraphs of 300-1,200 characters, spread evenly over the text."""
    paras = [p.strip() for p in text.split("\n\n") if 300 <= len(p.strip()) <= 1200]
    if len(paras) < n:
        raise ValueError(f"num_requests: the text has {len(paras)} paragraphs of 300-1,200 "
                         f"characters, fewer than {n}")
    return [paras[i * len(paras) // n] for i in range(n)]


def run(llm: Any, prompts: list[list[int]], max_tokens: int, at_once: bool
        ) -> tuple[float, list[list[int]]]:
    """Wall seconds (prefills included, none from the prefix cache) and the answers."""
    from minisgl.core import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.scheduler.clear_cache()  # every run computes its prompts (the same ones each run)
    t0 = time.perf_counter()
    if at_once:
        outs = llm.generate(prompts, sp)
    else:
        outs = [llm.generate([p], sp)[0] for p in prompts]
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def cmd_speculative(args: argparse.Namespace) -> int:
    from minisgl.core import LLM
    from minisgl.core.tokenizer import chat_token_ids
    from minisgl.server.bench import bench_engine_kwargs, settle_compile

    text, names = read_text(args.text)
    k = args.speculative_tokens or 4
    n = args.num_requests
    max_tokens = max(1, round(128 * args.scale))
    repeats = args.repeats or 3
    paras = paragraphs(text, n)
    kw = bench_engine_kwargs(args)
    log(f"loading minisgl ({args.model}) without drafts and with {k}")
    base = LLM(model=args.model, **{**kw, "speculative_tokens": 0})
    settle_compile(args, base)
    spec = LLM(model=args.model, **{**bench_engine_kwargs(args), "speculative_tokens": k})
    tok = base.tokenizer
    engines = {"minisgl": base, f"minisgl-spec{k}": spec}
    results: dict[str, Any] = {}
    try:
        for name in engines:  # warm both on an unmeasured answer
            engines[name].chat([[{"role": "user", "content": "Hello!"}]])
        for kind, template in TASKS.items():
            prompts = [chat_token_ids(tok, [{"role": "user", "content": template.format(p)}])
                       for p in paras]
            for at_once in (False, True):
                mode = f"{kind}, {'all at once' if at_once else 'one at a time'}"
                runs: dict[str, list[tuple[float, list[list[int]], int, int]]] = {}
                for r in range(repeats):
                    for name, llm in engines.items():
                        log(f"{mode}: {name}, run {r + 1} of {repeats}")
                        st = llm.scheduler.stats
                        s0 = (st.draft_tokens, st.accepted_tokens)
                        secs, outs = run(llm, prompts, max_tokens, at_once)
                        runs.setdefault(name, []).append(
                            (secs, outs, st.draft_tokens - s0[0], st.accepted_tokens - s0[1]))
                results[mode] = summarize(runs)
    finally:
        for llm in engines.values():
            llm.close()
    print(f"prompt-lookup drafts (up to {k} tokens a request) on answers about "
          f"{' + '.join(names)}: {n} paragraphs, greedy, up to {max_tokens} tokens, median of "
          f"{repeats} alternating runs")
    head = (f"{'requests':<28} {'tok/s, none':>12} {'with drafts':>12} {'ratio':>6} "
            f"{'tokens/step':>12} {'drafts kept':>12} {'identical':>10}")
    print(head + "\n" + "-" * len(head))
    for mode, r in results.items():
        print(f"{mode:<28} {r['tok_s'][0]:>12.1f} {r['tok_s'][1]:>12.1f} {r['ratio']:>6.2f} "
              f"{r['tokens_per_step']:>12.2f} {r['kept']:>11.0%} "
              f"{r['identical']:>4} of {r['answers']:<3}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": names, "speculative_tokens": k, "paragraphs": n,
                       "max_tokens": max_tokens, "repeats": repeats, "results": results}, f,
                      indent=2)
        log(f"wrote {args.json}")
    return 0


def summarize(runs: dict[str, list[tuple[float, list[list[int]], int, int]]]) -> dict[str, Any]:
    """The median run's tok/s of each engine, and of the last run with drafts: tokens a request
    kept per step after its first (each step keeps one token and the draft tokens accepted),
    the share of drafted tokens kept, answers identical to the last run without drafts'."""
    (_, plain), (_, drafted) = runs.items()
    rates = [[sum(map(len, outs)) / secs for secs, outs, *_ in rs] for rs in (plain, drafted)]
    tok_s = [statistics.median(r) for r in rates]
    _, outs, drafts, kept = drafted[-1]
    after_first = sum(map(len, outs)) - len(outs)
    return {"tok_s": tok_s, "runs_tok_s": rates, "ratio": tok_s[1] / tok_s[0],
            "tokens_per_step": after_first / max(1, after_first - kept),
            "kept": kept / max(1, drafts),
            "identical": sum(a == b for a, b in zip(plain[-1][1], outs)), "answers": len(outs),
            "output_tokens": [sum(map(len, plain[-1][1])), after_first + len(outs)]}
