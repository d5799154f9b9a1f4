"""Compiled steps (``compile=...``) and prepacked bf16 weights, against eager/F.linear.

The whole suite also runs with ``MINISGL_COMPILE=wait`` (nox ``tests-compiled`` sessions): then
every HF-reference test checks compiled decode steps too. Here: bucket routing, compiled logits
equal to eager ones step by step, compiled prefill (bf16, CPU attention kernel) as close to
float32 as eager bf16, eager fallback where compilation fails, the background mode (worker
process + cache) and prepacking.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.backends import cpu_kernels
from minisgl.core import LLM
from minisgl.core.compile import StepGraphs, buckets_for, resolve_mode
from minisgl.core.layers.quant import QuantizableLinear, can_prepack

from .conftest import VOCAB
from .reference import greedy, make_prompts, record_logits

CPU = torch.device("cpu")


def test_buckets_cover_every_batch_size_once() -> None:
    assert buckets_for(1) == [(1, 1)]
    assert buckets_for(8) == [(1, 1), (2, 8)]
    assert buckets_for(64) == [(1, 1), (2, 32), (33, 64)]
    for n in (1, 2, 31, 32, 33, 100):
        covered = [b for b in range(1, n + 1) for lo, hi in buckets_for(n) if lo <= b <= hi]
        assert covered == list(range(1, n + 1))


def test_modes() -> None:
    assert resolve_mode("auto", CPU) == "on"  # decoder layers as modules
    assert resolve_mode("auto", CPU, layers_in_one_call=True) == "off"
    assert resolve_mode("auto", torch.device("cuda")) == "off"
    assert resolve_mode("wait", CPU, layers_in_one_call=True) == "wait"
    assert resolve_mode("on", CPU) == "on"
    assert resolve_mode("wait", CPU) == "wait"
    assert resolve_mode("off", CPU) == "off"
    with pytest.raises(ValueError, match="compile"):
        LLM("smollm2", compile="sometimes")


def test_cache_dir_is_minisgls_unless_the_user_chose_one(tmp_path, monkeypatch) -> None:
    """torch pins TORCHINDUCTOR_CACHE_DIR to its temp-dir default when torch._dynamo is
    imported; the engine's persistent cache must still be ~/.cache/minisgl/inductor."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from minisgl.core import compile as compile_mod

    monkeypatch.setenv("HOME", str(tmp_path))
    for pinned in (None, default_cache_dir()):
        if pinned is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", pinned)
        compile_mod._use_persistent_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "minisgl" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compile_mod._use_persistent_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_compiled_decode_matches_eager_every_step(tiny_dirs: dict) -> None:
    """Batches of 1 and of 3 (two buckets), contexts crossing the 64-key padding step: each
    decode step's logits from the graphs equal the eager ones."""
    path = tiny_dirs["llama-gqa-untied-llama3"]
    prompts = make_prompts([5, 61, 30], VOCAB, seed=3)
    results = {}
    for mode in ("off", "wait"):
        llm = LLM(str(path), dtype="float32", compile=mode, max_running_requests=8,
                  num_pages=64, page_size=4)
        if mode == "wait":
            graphs = llm.engine.graphs
            assert graphs is not None and graphs.ready == {("decode", 1, 1), ("decode", 2, 8)}, graphs.describe()
        with record_logits(llm.engine) as rec:
            single = llm.generate(prompts[:1], greedy(12))[0].token_ids
            batch = [o.token_ids for o in llm.generate(prompts, greedy(70))]
        results[mode] = (single, batch, rec)
        llm.close()
    (s0, b0, rec0), (s1, b1, rec1) = results["off"], results["wait"]
    assert s0 == s1 and b0 == b1
    assert len(rec0) == len(rec1) > 70
    for (ids0, l0), (ids1, l1) in zip(rec0, rec1):
        assert ids0 == ids1
        torch.testing.assert_close(l1, l0, atol=2e-5, rtol=1e-5)


def test_failed_compilation_runs_eager(tiny_dirs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails (here: a backend that raises) leaves every bucket eager, with the
    reason recorded, and the answers are the eager ones."""
    from minisgl.core import compile as compile_mod

    def failing_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no graph today")

    real_compile = torch.compile
    monkeypatch.setattr(compile_mod.torch, "compile",
                        lambda fn, **kw: real_compile(fn, backend=failing_backend))
    path = tiny_dirs["llama-gqa-untied-llama3"]
    prompts = make_prompts([7, 20], VOCAB, seed=4)
    llm = LLM(str(path), dtype="float32", compile="wait", max_running_requests=4)
    graphs = llm.engine.graphs
    assert graphs is not None and not graphs.ready
    assert set(graphs.failed) == {("decode", 1, 1), ("decode", 2, 4)}
    assert "no graph today" in graphs.failed[("decode", 1, 1)]
    got = [o.token_ids for o in llm.generate(prompts, greedy(10))]
    llm.close()
    monkeypatch.undo()
    eager = LLM(str(path), dtype="float32", compile="off", max_running_requests=4)
    assert got == [o.token_ids for o in eager.generate(prompts, greedy(10))]


def test_compiled_prefill_matches_eager(tiny_dirs: dict) -> None:
    """bf16 on the CPU attention kernel (its prefill is traceable): one request alone, then
    three sharing a cached prefix (extend), in chunks of 24 tokens, so that one step samples
    one row of two requests (padded to two rows). The prefill graphs run those steps, and their
    logits are as close to a float32 eager run as the bf16 eager ones are."""
    from minisgl.backends import cpu_kernels

    if not cpu_kernels.supports(torch.bfloat16, 4, 2, 32):
        pytest.skip(f"no CPU attention kernel here: {cpu_kernels.load_error}")
    path = tiny_dirs["qwen3-tied"]  # head_dim 32
    shared = make_prompts([40], VOCAB, seed=7)[0]
    tails = make_prompts([3, 30, 9], VOCAB, seed=8)  # chunks: 3 + 21 | 9 + 9 (rows 1 | 2)
    results = {}
    for dtype, mode in (("float32", "off"), ("bfloat16", "off"), ("bfloat16", "wait")):
        llm = LLM(str(path), dtype=dtype, compile=mode, max_running_requests=8,
                  num_pages=64, page_size=4, max_prefill_tokens=24)
        with record_logits(llm.engine) as rec:  # one token each: prefill logits only
            llm.generate([shared], greedy(1))
            llm.generate([shared + t for t in tails], greedy(1))
        if mode == "wait":
            graphs = llm.engine.graphs
            assert graphs is not None
            assert graphs.steps[("prefill", 1, 1)] == 1, graphs.describe()  # 40 = 24 + 16
            assert graphs.steps[("prefill", 2, 8)] == 2, graphs.describe()
        results[(dtype, mode)] = rec
        llm.close()
    ref, eager, compiled = results.values()
    assert len(ref) == len(eager) == len(compiled) == 4
    for (ids, want), (ids_e, got_e), (ids_c, got_c) in zip(ref, eager, compiled):
        assert ids == ids_e == ids_c
        err_eager = (got_e - want).abs().max().item()
        err_compiled = (got_c - want).abs().max().item()
        assert err_compiled <= 2 * err_eager + 0.02, (err_compiled, err_eager)


def test_compiled_int8_decode_matches_eager(tiny_dirs: dict) -> None:
    """bf16 int8 with the CPU kernels loaded (AVX2 or AVX-512; with PyTorch's attention on
    AVX2): the decode graphs (batch 1; 2-8, a symbolic row count), and the prefill graphs where
    the attention kernel runs, call the int8 kernel op, compile, and their logits match eager
    ones to within bf16 rounding of the steps between (Inductor fuses them in float32). Where
    eager bf16 logits tie (or nearly: tiny random models), the two may pick different tokens:
    then only the steps before are compared, and the parting step must be such a tie."""
    from minisgl.backends import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip(f"no CPU kernels here: {cpu_kernels.load_error}")
    path = tiny_dirs["qwen3-tied"]
    prompts = make_prompts([5, 20, 33], VOCAB, seed=9)
    results = {}
    for mode in ("off", "wait"):
        llm = LLM(str(path), dtype="bfloat16", quantization="int8", compile=mode,
                  max_running_requests=8, num_pages=64, page_size=4)
        if mode == "wait":
            graphs = llm.engine.graphs
            assert graphs is not None and graphs.ready >= {("decode", 1, 1), ("decode", 2, 8)}, graphs.describe()
        with record_logits(llm.engine) as rec:
            llm.generate(prompts[:1], greedy(6))
            llm.generate(prompts, greedy(6))
        if mode == "wait":
            assert graphs.steps[("decode", 1, 1)] == 5 and graphs.steps[("decode", 2, 8)] == 5
        results[mode] = rec
        llm.close()
    eager = {tuple(ids): row.float() for ids, row in results["off"]}
    compiled = {tuple(ids): row.float() for ids, row in results["wait"]}
    common = eager.keys() & compiled.keys()
    assert len(common) > 10
    for seq in common:
        torch.testing.assert_close(compiled[seq], eager[seq], atol=0.1, rtol=0.05)
    for seq in eager.keys() - compiled.keys():
        parent = seq[:-1]  # where the two runs parted, if it is in both
        if parent in common:
            top = eager[parent].topk(2).values
            assert int(compiled[parent].argmax()) != int(eager[parent].argmax())
            assert float(top[0] - top[1]) <= 0.1, (len(parent), top)


def test_background_compile_serves_eager_then_compiled(tiny_dirs: dict,
                                                       tmp_path, monkeypatch) -> None:
    """compile='on': requests are answered while the worker compiles (eager), the graph then
    loads from the on-disk cache the worker filled, and answers stay the same."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = tiny_dirs["qwen3-tied"]
    prompts = make_prompts([9], VOCAB, seed=5)
    from torch._dynamo.utils import counters

    hits = counters["inductor"]["fxgraph_cache_hit"]
    llm = LLM(str(path), dtype="float32", compile="on", max_running_requests=1)
    graphs = llm.engine.graphs
    assert graphs is not None
    before = llm.generate(prompts, greedy(16))[0].token_ids  # most likely still eager
    graphs.join(timeout=600)
    assert graphs.ready == {("decode", 1, 1)}, graphs.describe()
    assert any((tmp_path / "inductor").iterdir())
    # this process loaded the worker's graph instead of compiling it again
    assert counters["inductor"]["fxgraph_cache_hit"] > hits
    assert llm.generate(prompts, greedy(16))[0].token_ids == before
    llm.close()


def test_worker_announced_graphs_load_one_by_one(tiny_dirs: dict, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """compile='on': each graph the compile worker announces is loaded while the worker goes on
    (a stand-in worker here: it announces decode 1-1, waits for the test, then dies); a graph it
    never announced stays eager, its exit status and last stderr line as the reason."""
    from minisgl.core import compile as compile_mod

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    go = tmp_path / "go"
    script = (f"import os, sys, time\n"
              f"print('warming up')\n"
              f"print('{compile_mod.READY_LINE} decode 1 1', flush=True)\n"
              f"t = time.time()\n"
              f"while not os.path.exists({str(go)!r}) and time.time() - t < 300:\n"
              f"    time.sleep(0.05)\n"
              f"sys.stderr.write('compiling decode 2-4\\nout of luck\\n')\n"
              f"sys.exit(3)\n")
    real_popen = subprocess.Popen
    argvs: list[list[str]] = []

    def stand_in(argv: list[str], **kw: object) -> subprocess.Popen:  # type: ignore[type-arg]
        if list(argv[1:3]) == ["-m", "minisgl.core.compile"]:  # (Inductor runs processes too)
            argvs.append(argv)
            argv = [sys.executable, "-c", script]
        return real_popen(argv, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(compile_mod.subprocess, "Popen", stand_in)
    path = tiny_dirs["llama-gqa-untied-llama3"]
    prompts = make_prompts([7, 20], VOCAB, seed=4)
    llm = LLM(str(path), dtype="float32", compile="on", max_running_requests=4)
    try:
        graphs = llm.engine.graphs
        assert graphs is not None and graphs._thread is not None
        deadline = time.monotonic() + 300
        while ("decode", 1, 1) not in graphs.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        # in use while the worker still runs (it waits for `go`)
        assert graphs.ready == {("decode", 1, 1)} and graphs._thread.is_alive(), graphs.describe()
        assert len(argvs) == 1
        one = llm.generate(prompts[:1], greedy(10))[0].token_ids
        assert graphs.steps[("decode", 1, 1)] >= 9
        go.touch()
        graphs.join(timeout=60)
        assert not graphs._thread.is_alive()
        assert graphs.ready == {("decode", 1, 1)}
        assert set(graphs.failed) == {("decode", 2, 4)}
        assert graphs.failed[("decode", 2, 4)] == "compile worker exited with 3: out of luck"
        both = [o.token_ids for o in llm.generate(prompts, greedy(10))]  # 2-4: eager
    finally:
        go.touch()
        llm.close()
    monkeypatch.undo()
    eager = LLM(str(path), dtype="float32", compile="off", max_running_requests=4)
    want = [o.token_ids for o in eager.generate(prompts, greedy(10))]
    assert one == want[0] and both == want  # the graph's answers, then eager's, are eager's
    eager.close()


def test_worker_killed_on_the_way_out_is_not_reported(tiny_dirs: dict, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A process that exits kills its compile worker (atexit); the graphs left are not then
    reported as failed with a warning that they run eager (a server printed one on every
    shutdown while its worker still ran). A worker that dies by itself still is (above)."""
    from minisgl.core import compile as compile_mod

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    real_popen = subprocess.Popen
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]

    def stand_in(argv: list[str], **kw: object) -> subprocess.Popen:  # type: ignore[type-arg]
        if list(argv[1:3]) == ["-m", "minisgl.core.compile"]:
            procs.append(real_popen([sys.executable, "-c", "import time; time.sleep(300)"], **kw))
            return procs[-1]
        return real_popen(argv, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(compile_mod.subprocess, "Popen", stand_in)
    llm = LLM(str(tiny_dirs["llama-gqa-untied-llama3"]), dtype="float32", compile="on",
              max_running_requests=4)
    try:
        graphs = llm.engine.graphs
        assert graphs is not None and graphs._thread is not None
        deadline = time.monotonic() + 60
        while not procs and time.monotonic() < deadline:
            time.sleep(0.05)
        with caplog.at_level("WARNING", logger="minisgl"):
            compile_mod._kill(procs[0])  # what atexit does
            graphs.join(timeout=60)
        assert not graphs._thread.is_alive()
        assert graphs.failed == {} and not graphs.ready
        assert "compile worker exited" not in caplog.text
    finally:
        llm.close()


def test_warm_start_loads_graphs_without_a_worker(tiny_dirs: dict, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """compile='on': once a worker has compiled every graph of a config, a later start with that
    config loads them from the cache on the engine's thread and starts no worker; a cache
    emptied behind the marker's back is noticed (the graph was compiled, not loaded), the
    marker goes, the worker runs again and, done, puts it back. Answers equal eager's."""
    from minisgl.core import compile as compile_mod

    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    real_popen = subprocess.Popen
    workers: list[list[str]] = []

    def spy(argv: list[str], **kw: object) -> subprocess.Popen:  # type: ignore[type-arg]
        if list(argv[1:3]) == ["-m", "minisgl.core.compile"]:
            workers.append(argv)
        return real_popen(argv, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(compile_mod.subprocess, "Popen", spy)
    path = tiny_dirs["qwen3-tied"]
    prompts = make_prompts([9], VOCAB, seed=5)

    def start(**kw: object) -> list[int]:
        llm = LLM(str(path), dtype="float32", max_running_requests=1, **kw)  # type: ignore[arg-type]
        graphs = llm.engine.graphs
        if graphs is not None:
            graphs.join(timeout=600)
            assert graphs.ready == {("decode", 1, 1)}, graphs.describe()
        out = llm.generate(prompts, greedy(16))[0].token_ids
        assert graphs is None or graphs.steps[("decode", 1, 1)] >= 15
        llm.close()
        return out

    first = start(compile="on")
    assert len(workers) == 1
    markers = list((cache / compile_mod.WARM_DIR).iterdir())
    assert len(markers) == 1
    compiled = compile_mod._compiled_anew()
    second = start(compile="on")
    assert len(workers) == 1 and compile_mod._compiled_anew() == compiled  # loaded, no worker
    for entry in cache.iterdir():  # the graphs gone, the marker left
        if entry.name != compile_mod.WARM_DIR:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    third = start(compile="on")
    assert compile_mod._compiled_anew() > compiled and len(workers) == 2
    assert markers[0].exists()
    assert first == second == third == start(compile="off")
    # a marker per config, thread count and MINISGL_* setting
    marker = compile_mod.warm_marker
    names = {marker({"a": 1}, 1), marker({"a": 2}, 1), marker({"a": 1}, 2)}
    monkeypatch.setenv("MINISGL_FUSED_LAYER", "off")
    assert len(names | {marker({"a": 1}, 1)}) == 4


def test_engine_is_built_before_dynamo_loads(tiny_dirs: dict, tmp_path: Path) -> None:
    """compile='on': the engine is up (a server reports ready) before Dynamo and Inductor are
    imported (~1 s of a start, ~1.7 s beside a server's other processes): the compile thread
    imports them. A fresh process, its compile thread held back."""
    script = f"""
import sys, threading
from minisgl.core import LLM, compile as compile_mod
gate = threading.Event()  # never set
background = compile_mod.StepGraphs._background
def held(self):
    gate.wait()
    background(self)
compile_mod.StepGraphs._background = held
llm = LLM({str(tiny_dirs["qwen3-tied"])!r}, dtype="float32", compile="on", max_running_requests=1)
assert llm.engine.graphs is not None
print("EARLY", sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
llm.close()  # (the compile thread, a daemon, never started compiling)
"""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EARLY []" in out.stdout, out.stdout


def test_prepacked_linear_equals_f_linear() -> None:
    """Whichever prepacked path this CPU has: the CPU kernels' (registered by load()), else
    oneDNN's."""
    cpu_kernels.load()
    if not can_prepack(torch.empty(2, 2, dtype=torch.bfloat16)):
        pytest.skip("neither the CPU kernels nor oneDNN's bf16 on this CPU")
    g = torch.Generator().manual_seed(0)
    layer = QuantizableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(96, 80, generator=g).bfloat16(),
                                      requires_grad=False)
    ref_w = layer.weight.detach().clone()
    layer.prepack()
    assert layer.weight.numel() == 0 and layer.packed is not None
    for rows in (1, 7, 300):
        x = torch.randn(rows, 80, generator=g).bfloat16()
        want = x.double() @ ref_w.double().T
        got = layer.matmul(x)
        # bf16 output rounding is the only difference to float64 (float32 accumulation)
        torch.testing.assert_close(got.double(), want, atol=0.05, rtol=2 ** -7)
        torch.testing.assert_close(got, F.linear(x, ref_w), atol=0.0625, rtol=2 ** -7)


@pytest.mark.slow
def test_bf16_engine_prepacks_every_linear(smollm2_path: str) -> None:
    if not cpu_kernels.load() and not can_prepack(torch.empty(2, 2, dtype=torch.bfloat16)):
        pytest.skip("neither the CPU kernels nor oneDNN's bf16 on this CPU")
    llm = LLM(smollm2_path, compile="off")
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    assert linears and all(m.packed is not None for m in linears)
    # where the CPU kernels load (AVX2 or AVX-512: CI), every layer is in their layout: the
    # backend is built, and registers them, before the engine converts the weights
    kernel = torch.ops.minisgl_cpu.bf16_linear.default if cpu_kernels.load() else None
    assert all(m.packed_linear is kernel for m in linears)
    # every layer drops its float weight; the tied embedding reads its rows from the LM
    # head's packed copy where the kernels give rows (packed_rows), else keeps the float weight
    embed = model.model.embed_tokens
    if kernel is not None:
        assert embed.weight.numel() == 0 and embed.rows_packed is model.lm_head.packed
        assert all(m.weight.numel() == 0 for m in linears)
    else:
        assert embed.weight.numel() > 0
        assert sum(m.weight.numel() == 0 for m in linears) == len(linears) - 1
    text = llm.chat([{"role": "user", "content": "Tell me the capital of France."}],
                    greedy(12))[0].text
    assert "Paris" in text


_gate = threading.Event()  # the op below waits on it: a step held inside its graph
_inside = threading.Event()  # set once a call is waiting


@torch.library.custom_op("minisgl_test::gated_double", mutates_args=())
def _gated_double(x: torch.Tensor) -> torch.Tensor:
    _inside.set()
    _gate.wait(30)
    return x * 2


@_gated_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_graph_compiling_while_a_step_runs_on_another_graph(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A step on a graph runs under the process-wide "fail_on_recompile" stance; a graph
    compiling meanwhile on the background thread must not see it (it used to fail and stay
    eager: the server's prefill graphs while decode steps ran), and a step that finds a
    compilation under way runs eager instead of waiting for it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.minisgl_test.gated_double(x) + 1

    graphs = StepGraphs(fn, {"decode": lambda x: [(x, 0, "batch")]},
                        {"decode": lambda n: (torch.zeros(n),)}, max_batch=8)
    _gate.set()
    graphs.compile_one(("decode", 1, 1))
    assert graphs.ready == {("decode", 1, 1)}
    _gate.clear()
    _inside.clear()
    results: list[torch.Tensor | None] = []
    step = threading.Thread(target=lambda: results.append(
        graphs.run("decode", (torch.ones(1),), 1)))
    step.start()
    assert _inside.wait(30)  # the step is inside its graph, under the stance
    compiling = threading.Thread(target=graphs.compile_one, args=(("decode", 2, 8),))
    compiling.start()
    threading.Timer(1.0, _gate.set).start()  # let the step finish a second later
    step.join(60)
    compiling.join(300)
    assert results and results[0] is not None and torch.equal(results[0], torch.full((1,), 3.0))
    assert graphs.failed == {}, graphs.failed
    assert graphs.ready == {("decode", 1, 1), ("decode", 2, 8)}
    # while a graph compiles, steps on the ready ones run eager (None) rather than wait
    with graphs._lock:
        assert graphs.run("decode", (torch.ones(1),), 1) is None
    assert torch.equal(graphs.run("decode", (torch.ones(3),), 3), torch.full((3,), 3.0))
