"""``minisgl serve --tp N`` as real processes: answers, two "nodes" on loopback, failures.

The model is a tiny random Llama (hidden 64, 4 heads, 2 KV heads, 2 layers) with SmolLM2's
tokenizer and chat template, so chat requests work and every server starts in seconds. The
expected texts come from the offline engine at TP=1 in this process (float32, greedy): the split
changes logits by ~1e-6 only (tests/models/test_tp.py), so the greedy tokens must be identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from minisgl.core import LLM, SamplingParams
from tests.procs import descendants

from .conftest import BASE_ARGS, Server, alive, free_port, start_server, wait_dead

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
MAX_TOKENS = 16
NUM_PAGES = ("--num-pages", "256")  # the default 1 GiB KV pool per rank is far more than needed
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three colours, please."}],
]


# -- helpers -----------------------------------------------------------------------------------


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout)
    return None


@contextlib.contextmanager
def stopped_at_end(*servers: Server) -> Iterator[None]:
    """Whatever the test did: kill what is left of the servers and their children."""
    try:
        yield
    finally:
        for s in servers:
            s.stop(check=False, timeout=10)


def launch_node(model: str, node_rank: int, nnodes: int, addr: str, *args: str
                ) -> tuple[subprocess.Popen[bytes], str]:
    """A launcher for a node other than 0 (no HTTP): its process and its log directory."""
    log_dir = tempfile.mkdtemp(prefix="minisgl-test-node-")
    cmd = [sys.executable, "-m", "minisgl.server.cli", "serve", "--model", model,
           "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", addr, *args]
    with open(os.path.join(log_dir, "stdout"), "wb") as out, \
            open(os.path.join(log_dir, "stderr"), "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    return proc, log_dir


def read_logs(log_dir: str) -> str:
    parts = []
    for name in ("stdout", "stderr"):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            parts.append(f"--- {name} ---\n{f.read()[-10000:]}")
    return "\n".join(parts)


# -- the model and the expected answers ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """A random 2-layer Llama with SmolLM2's tokenizer, vocabulary and special token ids."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.models.conftest import _redraw_weights
    from tests.models.reference import torch_threads

    src = Path(smollm2_path)
    ref = json.loads((src / "config.json").read_text())
    path = tmp_path_factory.mktemp("tiny-smollm2-tokenizer")
    cfg = LlamaConfig(
        vocab_size=ref["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=ref["bos_token_id"], eos_token_id=ref["eos_token_id"],
        pad_token_id=ref["pad_token_id"])
    with torch_threads(1):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        _redraw_weights(model, seed=7)  # unit-scale activations: no near ties in greedy picks
        model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == ref["vocab_size"] == 49152
    assert tok.convert_tokens_to_ids(tok.eos_token) in (ref["eos_token_id"], 0, 2)
    return str(path)


@pytest.fixture(scope="module")
def expected(tiny_chat_model: str) -> list[str]:
    """The offline TP=1 greedy answer text of each of CHATS."""
    llm = LLM(tiny_chat_model, dtype="float32", num_pages=256)
    try:
        outs = llm.chat(list(CHATS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    finally:
        llm.close()
    assert all(o.text for o in outs) and len({o.text for o in outs}) == len(outs)
    return [o.text for o in outs]


def chat(client: openai.OpenAI, messages: list[dict[str, str]], stream: bool) -> str:
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=MAX_TOKENS)
        return r.choices[0].message.content or ""
    s = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                       temperature=0, max_tokens=MAX_TOKENS, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in s if c.choices)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


# -- tests -------------------------------------------------------------------------------------


def test_tp2_server_answers_like_offline_tp1(tiny_chat_model: str, expected: list[str]) -> None:
    server = start_server("--model", tiny_chat_model, "--served-model-name", "tiny",
                          "--tp", "2", *BASE_ARGS, *NUM_PAGES)
    with stopped_at_end(server):
        pids = server.stats()["pids"]
        assert set(pids) >= {"scheduler", "rank1", "tokenizer", "detokenizer"}
        assert "rank2" not in pids
        client = client_of(server)
        for messages, want in zip(CHATS, expected):
            for stream in (False, True):
                assert chat(client, messages, stream) == want, f"stream={stream}"
        server.wait_idle()
        server.stop()  # SIGTERM: exit status 0, no child left (rank 1 included)


def test_two_nodes_on_loopback(tiny_chat_model: str, expected: list[str]) -> None:
    """Node 0 (HTTP, rank 0) and node 1 (rank 1 only) as separate launchers; SIGTERM to node 0
    ends node 1 too: its rank is told to exit by rank 0 (or loses it), and its launcher follows."""
    addr = f"127.0.0.1:{free_port()}"
    engine = ("--tp", "2", *BASE_ARGS, *NUM_PAGES)
    node1, node1_logs = launch_node(tiny_chat_model, 1, 2, addr, *engine)
    node1_kids: list[int] = []
    try:
        node0 = start_server("--model", tiny_chat_model, "--served-model-name", "tiny",
                             "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr,
                             *engine, wait=False)
        with stopped_at_end(node0):
            try:
                node0.wait_healthy()
            except BaseException:
                print(f"node 1:\n{read_logs(node1_logs)}")
                raise
            assert node1.poll() is None, read_logs(node1_logs)
            node1_kids = descendants(node1.pid)
            assert node1_kids, "node 1 runs no rank process"
            pids = node0.stats()["pids"]
            assert "rank1" not in pids  # rank 1 lives on node 1
            client = client_of(node0)
            assert chat(client, CHATS[0], stream=False) == expected[0]
            assert chat(client, CHATS[1], stream=True) == expected[1]

            t0 = time.monotonic()
            node0.proc.send_signal(signal.SIGTERM)
            rc0 = wait_exit(node0.proc, 20)
            rc1 = wait_exit(node1, max(1.0, 20 - (time.monotonic() - t0)))
            took = time.monotonic() - t0
            assert rc0 is not None, f"node 0 still running 20 s after SIGTERM:\n{node0.output()}"
            assert rc1 is not None, (f"node 1 still running {took:.1f} s after node 0's SIGTERM:"
                                     f"\n{read_logs(node1_logs)}")
            assert rc0 == 0, node0.output()
            assert rc1 == 0, read_logs(node1_logs)
            left = wait_dead(node0.child_pids + node1_kids, 10)
            assert not left, f"children {left} outlived their launchers"
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
        kill_all([p for p in node1_kids if alive(p)])


def test_killed_rank_fails_the_server(tiny_chat_model: str) -> None:
    """SIGKILL rank 1: /health turns 503 (or the port closes as the launcher goes), the launcher
    exits non-zero within seconds, and no child is left."""
    server = start_server("--model", tiny_chat_model, "--tp", "2", *BASE_ARGS, *NUM_PAGES)
    with stopped_at_end(server):
        rank1 = server.stats()["pids"]["rank1"]
        assert alive(rank1)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        # /health is 503 from when the launcher notices until it stops serving (~0.2 s): poll
        # back to back over one keep-alive connection so that window is not missed
        statuses: list[int | str] = []
        with httpx.Client(timeout=2) as http:
            while server.proc.poll() is None and time.monotonic() - t0 < 15:
                try:
                    statuses.append(http.get(server.url + "/health").status_code)
                except httpx.HTTPError as e:
                    statuses.append(type(e).__name__)
                    time.sleep(0.02)
        rc = wait_exit(server.proc, max(0.1, 15 - (time.monotonic() - t0)))
        took = time.monotonic() - t0
        assert rc is not None, f"the launcher still runs {took:.1f} s after rank 1 died"
        assert rc != 0, server.output()
        assert 503 in statuses, f"/health never answered 503 (saw {statuses[-10:]})"
        assert 200 not in statuses[statuses.index(503):], statuses  # never healthy again
        assert "rank1" in server.output() or "rank 1" in server.output()
        left = wait_dead(server.child_pids, 10)
        assert not left, f"children {left} outlived the launcher:\n{server.output()}"


def test_smollm2_two_ways_fails_at_start(smollm2_path: str) -> None:
    before = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "minisgl.server.cli", "serve", "--model",
                          "smollm2", "--tp", "2", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert res.returncode != 0
    assert "num_attention_heads (9)" in res.stderr and "tp (2)" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert time.monotonic() - before < 60  # no model was loaded
