"""``minisgl bench tp``: what tensor parallelism costs and saves on this machine.

For TP=1 and TP=``--tp``, each in a fresh process (so peak memory is that configuration's alone):
peak resident memory of every rank after loading and a warm-up (VmHWM, includes the loading
peak), the parameter bytes a rank holds, batch-1 decode ms/token and the throughput of 16
requests x 64 tokens decoded together. On a CPU the ranks share the same cores, so TP cannot be
faster; the step-time ratio is the price of the collectives (all-reduce per layer, the LM head's
all-gather, the control broadcast).

``python -m minisgl.server.bench_tp --make-random DIR`` writes a random-weight checkpoint with
Qwen3-0.6B's shapes (16 heads, 8 KV heads: splittable 2, 4 or 8 ways), since SmolLM2 (9 heads)
only splits 3 or 9 ways.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

from minisgl.server.bench import Row, log


def _status_mib(pid: int, key: str) -> float:
    """A memory line of /proc/<pid>/status in MiB: VmHWM (peak resident, file-backed pages of
    the mmapped checkpoint included) or RssAnon (private memory now: weights, KV, runtime)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a rank holds: parameters plus the converted copies the linear layers
    compute with (prepacked bf16, int8 + scales), which are not parameters."""
    tensors = list(model.parameters())
    for m in model.modules():
        tensors += [t for name in ("packed", "qweight", "qscale")
                    if (t := getattr(m, name, None)) is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def child(model: str, tp: int, dtype: str, threads: int | None, compile_mode: str
          ) -> dict[str, Any]:
    """Runs in a fresh process: load at ``tp`` ranks (graphs compiled before timing, where
    compilation is on), warm up, measure."""
    import torch

    from minisgl.core import LLM, SamplingParams
    if threads:
        torch.set_num_threads(threads)
    # graphs compiled before timing where compilation is on; auto's choice is the engine's at
    # one rank (off where the decoder layers run in one call), on with more (TP ranks run the
    # layers as modules: core/layers/fused.py)
    if compile_mode == "on" or (compile_mode == "auto" and tp > 1):
        compile_mode = "wait"
    t0 = time.perf_counter()
    # The KV pool holds the same tokens at every TP size, all of the 16 x (64 + 64) batch below
    # (sized in bytes, 32 MiB held 3 of those requests at TP=1 and 6 at TP=2, which made TP=2
    # look faster); its bytes per rank shrink with TP like the weights'. 16 running requests at
    # most (that batch): fewer graphs to compile.
    page = 16
    llm = LLM(model=model, dtype=dtype, tp=tp, page_size=page, num_pages=16 * 128 // page + 16,
              compile=compile_mode, max_running_requests=16)
    if llm.engine.graphs is not None:
        llm.engine.graphs.join()  # auto's "on" at one rank
    load_s = time.perf_counter() - t0
    graphs = llm.engine.graphs.describe() if llm.engine.graphs is not None else "eager"
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    llm.generate([prompt(32), prompt(48)], params(8))  # warm-up
    weights = weight_bytes(llm.engine.model)
    pids = [os.getpid()] + [p.pid for p in llm._workers]
    rss = [_status_mib(pid, "VmHWM") for pid in pids]
    anon = [_status_mib(pid, "RssAnon") for pid in pids]
    # batch-1 decode: time 1 and 65 tokens after the same 128-token prompt; the difference is
    # 64 decode steps (prefill cost cancels out)
    p = prompt(128)
    t0 = time.perf_counter()
    llm.generate([p], params(1))
    t1 = time.perf_counter()
    llm.generate([p + [5]], params(65))  # a different prompt end: the cache cannot skip prefill
    t2 = time.perf_counter()
    decode_ms = ((t2 - t1) - (t1 - t0)) / 64 * 1e3
    batch = [prompt(64) for _ in range(16)]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params(64))
    batch_tok_s = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    llm.close()
    return {"tp": tp, "load_s": load_s, "graphs": graphs, "weights_mib_per_rank": weights / 2**20,
            "peak_rss_mib": rss, "anon_rss_mib": anon, "decode_ms": decode_ms, "batch16_tok_s": batch_tok_s}


def bench_tp(args: Any) -> list[Row]:
    from minisgl.core.bundled import resolve_model
    from minisgl.core.config import default_mode

    model = resolve_model(args.model)
    results = {}
    for tp in sorted({1, args.tp}):
        log(f"tp: measuring tp={tp} in a fresh process")
        cmd = [sys.executable, "-m", "minisgl.server.bench_tp", "--child", "--model", model,
               "--tp", str(tp), "--dtype", args.dtype, "--compile", args.compile or default_mode()]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[tp] = json.loads(out.strip().splitlines()[-1])
        log(f"tp={tp}: {results[tp]}")
    rows = []
    for tp, r in results.items():
        name = f"tp={tp}"
        rows.append(Row("tp", name, "weights MiB per rank", r["weights_mib_per_rank"], False))
        for rank, (peak, anon) in enumerate(zip(r["peak_rss_mib"], r["anon_rss_mib"])):
            rows.append(Row("tp", name, f"rank {rank} peak RSS MiB", peak, False))
            rows.append(Row("tp", name, f"rank {rank} private RSS MiB", anon, False))
        rows.append(Row("tp", name, "decode ms/token (batch 1)", r["decode_ms"], False))
        rows.append(Row("tp", name, "16x64 decode tok/s", r["batch16_tok_s"], True))
    if args.tp != 1:
        one, n = results[1], results[args.tp]
        rows.append(Row("tp", f"tp={args.tp} / tp=1", "decode step time ratio",
                        n["decode_ms"] / one["decode_ms"], False))
        rows.append(Row("tp", f"tp={args.tp} / tp=1", "16x64 throughput ratio",
                        n["batch16_tok_s"] / one["batch16_tok_s"], True))
        rows.append(Row("tp", f"tp={args.tp} / tp=1", "rank 0 peak RSS ratio",
                        n["peak_rss_mib"][0] / one["peak_rss_mib"][0], False))
        rows.append(Row("tp", f"tp={args.tp} / tp=1", "rank 0 private RSS ratio",
                        n["anon_rss_mib"][0] / one["anon_rss_mib"][0], False))
    return rows


def make_random(path: str) -> None:
    """A random Qwen3-0.6B-shaped checkpoint (bf16 safetensors) with a byte-level tokenizer-free
    config; prompts are token ids."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                      num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
                      torch_dtype="bfloat16", eos_token_id=151645, bos_token_id=151643)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--make-random", metavar="DIR")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", default="auto")
    a = p.parse_args()
    if a.make_random:
        make_random(a.make_random)
    elif a.child:
        print(json.dumps(child(a.model, a.tp, a.dtype, a.threads, a.compile)), flush=True)


if __name__ == "__main__":
    main()
