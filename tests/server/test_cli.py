"""The `minisgl` command, run as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.procs import busy_loop_pids


def minisgl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MINISGL_STRICT_PLUGINS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "minisgl.server.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plugins_lists_builtin_plugins() -> None:
    res = minisgl("plugins")
    assert res.returncode == 0, res.stderr
    for needle in ("minisgl-core", "minisgl-models", "minisgl-backends", "LlamaForCausalLM",
                   "Qwen3ForCausalLM", "attention_backends: torch", "samplers: default"):
        assert needle in res.stdout


@pytest.mark.slow
def test_generate_chat_on_bundled_model(smollm2_path: str) -> None:
    # (uncompiled: generate's default); "Tell me", not "What is the capital of France?", whose
    # first token is a bf16 near-tie (see test_smollm2's FRANCE); this tests the CLI
    res = minisgl("generate", "--chat", "--max-tokens", "20", "Tell me the capital of France.")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "stop]" in res.stdout  # the answer ends on the chat end-of-turn token


@pytest.mark.slow
def test_generate_on_an_int8_kv_pool(smollm2_path: str) -> None:
    res = minisgl("generate", "--chat", "--kv-cache-dtype", "int8", "--max-tokens", "20",
                  "Tell me the capital of France.")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    bad = minisgl("generate", "--kv-cache-dtype", "fp8", "hi")
    assert bad.returncode == 2 and "--kv-cache-dtype" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_generate_compiles_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-shot ``minisgl generate`` runs eager unless --compile or $MINISGL_COMPILE asks
    (its compile worker cost a 64-token answer ~2 s); serve keeps the engine's default."""
    from minisgl.server.cli import build_parser, engine_kwargs, generate_kwargs

    parse = build_parser().parse_args
    monkeypatch.delenv("MINISGL_COMPILE", raising=False)
    assert generate_kwargs(parse(["generate", "hi"]))["compile"] == "off"
    assert generate_kwargs(parse(["generate", "--compile", "on", "hi"]))["compile"] == "on"
    assert "compile" not in engine_kwargs(parse(["serve"]))
    monkeypatch.setenv("MINISGL_COMPILE", "wait")
    assert "compile" not in generate_kwargs(parse(["generate", "hi"]))  # the config's default


def test_bad_model_path_is_a_clear_error(tmp_path: os.PathLike[str]) -> None:
    res = minisgl("generate", "--model", str(os.path.join(tmp_path, "nope")), "hi")
    assert res.returncode == 2
    assert "not a local directory" in res.stderr and "smollm2" in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_sampling_value_names_the_field(smollm2_path: str) -> None:
    res = minisgl("generate", "--temperature", "-1", "hi")
    assert res.returncode == 2
    assert "temperature" in res.stderr and "Traceback" not in res.stderr


def test_bad_engine_option_names_the_field(smollm2_path: str) -> None:
    res = minisgl("generate", "--threads", "0", "hi")
    assert res.returncode == 2
    assert "threads" in res.stderr and "Traceback" not in res.stderr


def test_engine_flags_round_trip_threads() -> None:
    """A server started by another command (bench, shell) gets the same --threads."""
    import argparse

    from minisgl.server.cli import add_engine_args, engine_flags, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--threads", "3"])
    assert engine_kwargs(args)["threads"] == 3
    again = p.parse_args(engine_flags(args))
    assert engine_kwargs(again) == engine_kwargs(args)
    assert engine_kwargs(p.parse_args([]))["threads"] is None
    fixed = p.parse_args(["--no-adapt-threads"])
    assert engine_kwargs(fixed)["adapt_threads"] is False
    assert engine_kwargs(p.parse_args(engine_flags(fixed)))["adapt_threads"] is False
    assert engine_kwargs(p.parse_args([]))["adapt_threads"] is True
    kv8 = p.parse_args(["--kv-cache-dtype", "int8"])
    assert engine_kwargs(p.parse_args(engine_flags(kv8)))["kv_cache_dtype"] == "int8"
    assert engine_kwargs(p.parse_args([]))["kv_cache_dtype"] == "auto"
    spec = p.parse_args(["--speculative-tokens", "4"])
    assert engine_kwargs(p.parse_args(engine_flags(spec)))["speculative_tokens"] == 4
    assert engine_kwargs(p.parse_args([]))["speculative_tokens"] == 0


def test_bench_runs_on_a_checkpoint_without_a_tokenizer(tmp_path: os.PathLike[str]) -> None:
    """``bench_tp --make-random`` and benchmarks.md's GPU workload use random checkpoints with no
    tokenizer: prompts are token ids from the model's vocabulary, none of them end-of-sequence."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from minisgl.server.bench import normal_token_ids

    assert normal_token_ids(None, 10, (2, 7)) == [0, 1, 3, 4, 5, 6, 8, 9]
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model_dir = os.path.join(tmp_path, "random")
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    assert not any("token" in name for name in os.listdir(model_dir))
    out = os.path.join(tmp_path, "burst.json")
    res = minisgl("bench", "burst", "--model", model_dir, "--compile", "off", "--scale", "0.1",
                  "--repeats", "1", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    rows = report["results"]
    assert [(r["workload"], r["system"]) for r in rows] == [("burst", "minisgl")]
    assert rows[0]["value"] > 0
    # the CPU by name and family (a VM's bare "AMD EPYC" is two generations), as lscpu says
    cpu = report["machine"]["cpu"]
    assert f"machine: {cpu}, " in res.stdout
    if shutil.which("lscpu"):
        lscpu = dict(line.split(":", 1) for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"},
            check=True).stdout.splitlines() if ":" in line)
        assert cpu.startswith(lscpu["Model name"].strip()), (cpu, lscpu["Model name"])
        assert f"family {lscpu['CPU family'].strip()}, model {lscpu['Model'].strip()})" in cpu

    # a longer prefill (max_position_embeddings 512): its length in the metric, its FLOPs in the
    # ceiling; past the model's length or not positive, a clear error naming the flag
    # and a decode after a longer prompt (--decode-context), its context in the metric
    res = minisgl("bench", "latency", "--model", model_dir, "--compile", "off", "--scale", "0.1",
                  "--repeats", "1", "--prefill-tokens", "4000", "--decode-context", "3000",
                  "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        rows = {r["metric"]: r for r in json.load(f)["results"]}
    assert rows["prefill tok/s (400 tok)"]["value"] > 0
    assert rows["decode ms/token (300-tok context)"]["details"]["context_tokens"] == 300
    assert rows["TTFT ms (300-tok prompt)"]["value"] > 0
    for flag, bad, words in (
            ("--prefill-tokens", "6000",
             "prefill_tokens: 600 tokens is more than the model takes (512)"),
            ("--prefill-tokens", "0", "--prefill-tokens: must be at least 1"),
            ("--decode-context", "5000",  # 500 + 13 decoded
             "decode_context: 513 tokens is more than the model takes (512)"),
            ("--decode-context", "0", "--decode-context: must be at least 1")):
        res = minisgl("bench", "latency", "--model", model_dir, "--compile", "off", "--scale",
                      "0.1", flag, bad)
        assert res.returncode == 2 and words in res.stderr, res.stderr[-2000:]
        assert "Traceback" not in res.stderr

    # beside a busy process, against the engine that keeps its threads; the process is gone after
    res = minisgl("bench", "burst", "--model", model_dir, "--compile", "off", "--scale", "0.1",
                  "--repeats", "1", "--busy", "1", "--vs-fixed-threads", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    assert report["machine"]["busy_processes"] == 1
    assert [r["system"] for r in report["results"]] == ["minisgl", "minisgl-fixed"]
    assert "beside 1 busy processes" in res.stdout and "minisgl vs minisgl-fixed" in res.stdout
    assert not busy_loop_pids()



@pytest.mark.slow
def test_bench_speculative_runs_and_counts(smollm2_path: str, tmp_path: os.PathLike[str]) -> None:
    """`minisgl bench speculative` end to end on a small run: a table row per task and mode,
    JSON whose counts add up (each request keeps at least one token per step)."""
    import json

    text = os.path.join(tmp_path, "text.md")
    para = ("The scheduler keeps a radix tree of every cached prefix, so that a request sharing "
            "a prefix with an earlier one reuses its pages and computes only its new tokens. ")
    with open(text, "w") as f:
        f.write("\n\n".join(para * (2 + i % 3) for i in range(4)))
    out = os.path.join(tmp_path, "spec.json")
    res = minisgl("bench", "speculative", "--text", text, "--num-requests", "2", "--scale",
                  "0.125", "--repeats", "1", "--speculative-tokens", "3", "--json", out)
    assert res.returncode == 0, res.stderr
    with open(out) as f:
        report = json.load(f)
    assert report["speculative_tokens"] == 3 and report["max_tokens"] == 16
    assert set(report["results"]) == {f"{k}, {m}" for k in ("quote", "summarize", "question")
                                      for m in ("one at a time", "all at once")}
    for mode, r in report["results"].items():
        assert mode in res.stdout
        assert r["answers"] == 2 and 0 <= r["identical"] <= 2 and 0 <= r["kept"] <= 1
        assert r["tokens_per_step"] >= 1 and all(v > 0 for v in r["tok_s"])
    bad = minisgl("bench", "speculative", "--text", text, "--num-requests", "9")
    assert bad.returncode != 0 and "num_requests" in bad.stderr and "Traceback" not in bad.stderr
