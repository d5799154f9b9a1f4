"""The bench's analytic model cost against the bundled checkpoint's own tensors, and its
decode fractions against a read ceiling and the reads measured beside the runs."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from minisgl.core.config import ModelConfig
from minisgl.server import bench
from minisgl.server.bench import ModelCost, Timing, Workload


def test_decode_bytes_count_the_checkpoint_weights(smollm2_path: str) -> None:
    """Layer weights = every projection matrix in the checkpoint; LM head = the (tied) embedding;
    a decode step reads them at 2 bytes each in bf16 and 1 byte each with int8."""
    mc = ModelConfig.from_pretrained(smollm2_path)
    proj = embed = 0
    with safe_open(f"{smollm2_path}/model.safetensors", "pt") as f:
        for name in f.keys():
            n = f.get_slice(name).get_shape()
            if name.endswith("proj.weight"):
                proj += n[0] * n[1]
            elif name.endswith("embed_tokens.weight"):
                embed += n[0] * n[1]
    bf16 = ModelCost.from_config(mc, torch.bfloat16)
    assert (bf16.layer_params, bf16.lm_head_params) == (proj, embed)
    assert bf16.decode_bytes() == 2 * (proj + embed)
    assert ModelCost.from_config(mc, torch.bfloat16, "int8").decode_bytes() == proj + embed
    assert ModelCost.from_config(mc, torch.float32).decode_bytes() == 4 * (proj + embed)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"),
                         [(torch.bfloat16, "auto"), (torch.bfloat16, "int8"),
                          (torch.float32, "auto")])
def test_kv_bytes_per_token_are_the_pools(smollm2_path: str, dtype: torch.dtype,
                                          kv_cache_dtype: str) -> None:
    """What a decode step reads of K/V per token of context: the bytes of one slot over every
    layer's K and V tensors of a real KV pool of the model (int8 records with their scales)."""
    from minisgl.core.kvcache import KVPool

    mc = ModelConfig.from_pretrained(smollm2_path)
    pool = KVPool(mc.num_layers, 2, 16, mc.num_kv_heads, mc.head_dim, dtype, torch.device("cpu"),
                  torch.int8 if kv_cache_dtype == "int8" else None)
    per_slot = sum(t.element_size() * t.shape[0] * t.shape[2] for t in pool.k + pool.v)
    assert ModelCost.from_config(mc, dtype, None, kv_cache_dtype).kv_bytes_per_token == per_slot


class _FixedSpeed:
    """A system whose decode takes ``ms`` per token after a 10 ms first token (``decode_bytes``:
    the weights a step of it reads, where its format is its own; None: the model's)."""

    def __init__(self, name: str, ms: float, decode_bytes: int | None = None) -> None:
        self.name, self.ms, self.decode_bytes = name, ms, decode_bytes

    def run_offline(self, wl: Workload) -> tuple[int, float]:
        raise NotImplementedError

    def run_single(self, prompt: list[int], n_out: int) -> Timing:
        return Timing(0.01, 0.01 + self.ms / 1e3 * (n_out - 1), n_out)


def test_latency_puts_decode_and_prefill_beside_what_was_measured_around_them(monkeypatch
                                                                              ) -> None:
    """The ceiling's fraction uses the run's best read; the "beside" fraction uses the reads
    taken right before and after each decode run (here 10 and 30 GB/s: 20 on average), per run,
    and their median. The prefill's uses the higher of the matmuls measured right before and
    after each prefill run (here 1 and 2 TFLOP/s: 2)."""
    reads = iter([10e9, 30e9] * 100)
    monkeypatch.setattr(bench, "measure_read", lambda probe: next(reads))
    matmuls = iter([1e12, 2e12] * 100)
    monkeypatch.setattr(bench, "measure_matmul", lambda ceilings, device: next(matmuls))
    monkeypatch.setattr(bench, "READ_PROBE_BYTES", 1 << 12)  # the probe is never read here
    cost = ModelCost(layer_params=60_000_000, lm_head_params=40_000_000, num_layers=2,
                     attn_width=64, bytes_per_param=2)  # 200 MB per decode step
    ceilings = {"mem_read_bytes_per_s": 40e9, "matmul_flops": 1e12}
    rows = bench.bench_latency([_FixedSpeed("fast", 8.0), _FixedSpeed("slow", 16.0)],
                               list(range(100, 200)), 0.1, 3, 0, cost, ceilings)
    decode = {r.system: r for r in rows if r.metric == "decode ms/token"}
    assert decode["fast"].value == pytest.approx(8.0)
    assert decode["fast"].fraction_of_ceiling == pytest.approx(5.0 / 8.0)  # 200 MB at 40 GB/s
    assert decode["fast"].details["read_bytes_per_s_beside"] == [20e9] * 3
    assert decode["fast"].details["fraction_of_read_beside"] == pytest.approx(10.0 / 8.0)
    assert decode["slow"].details["fraction_of_read_beside"] == pytest.approx(10.0 / 16.0)
    prefill = next(r for r in rows if r.system == "fast" and r.metric.startswith("prefill"))
    long_len = 102  # 1,024 tokens at scale 0.1, prefilled in the fixed 10 ms
    assert prefill.value == pytest.approx(long_len / 0.01)
    assert prefill.details["matmul_flops_beside"] == [2e12] * 3
    flops = cost.prefill_flops(0, long_len)
    assert prefill.fraction_of_ceiling == pytest.approx(flops / 0.01 / 1e12)
    assert prefill.details["fraction_of_matmul_beside"] == pytest.approx(flops / 0.01 / 2e12)
    lines = bench.beside_lines(rows)
    pct = f"{flops / 0.01 / 2e12:.0%}"
    assert lines == [
        "latency: fast decode at 125% of the floor at the read measured beside its runs "
        "(20.0 GB/s median)",
        "latency: slow decode at 62% of the floor at the read measured beside its runs "
        "(20.0 GB/s median)",
        *[f"latency: {name} prefill at {pct} of the matmul peak measured beside its runs (the "
          "higher of before and after each; 2,000 GFLOP/s median)" for name in ("fast", "slow")]]


def test_latency_takes_a_system_own_weight_bytes_for_its_floor(monkeypatch) -> None:
    """A system in a weight format of its own (llama.cpp's Q4_1 GGUF) says how many bytes a
    decode step reads (``decode_bytes``); its floor and both fractions use those, the others
    the model's cost (200 MB here)."""
    monkeypatch.setattr(bench, "measure_read", lambda probe: 20e9)
    monkeypatch.setattr(bench, "measure_matmul", lambda ceilings, device: 1e12)
    monkeypatch.setattr(bench, "READ_PROBE_BYTES", 1 << 12)
    cost = ModelCost(layer_params=60_000_000, lm_head_params=40_000_000, num_layers=2,
                     attn_width=64, bytes_per_param=2)
    systems = [_FixedSpeed("bf16", 8.0), _FixedSpeed("q4", 4.0, decode_bytes=50_000_000)]
    rows = bench.bench_latency(systems, list(range(100, 200)), 0.1, 1, 0, cost,
                               {"mem_read_bytes_per_s": 40e9, "matmul_flops": 1e12})
    decode = {r.system: r for r in rows if r.metric == "decode ms/token"}
    assert decode["bf16"].ceiling == pytest.approx(5.0)  # 200 MB at 40 GB/s
    assert decode["bf16"].fraction_of_ceiling == pytest.approx(5.0 / 8.0)
    assert decode["bf16"].details["fraction_of_read_beside"] == pytest.approx(10.0 / 8.0)
    assert decode["q4"].ceiling == pytest.approx(1.25)  # 50 MB at 40 GB/s
    assert decode["q4"].fraction_of_ceiling == pytest.approx(1.25 / 4.0)
    assert decode["q4"].details["weight_bytes_per_token"] == 50_000_000
    assert decode["q4"].details["fraction_of_read_beside"] == pytest.approx(2.5 / 4.0)


def test_latency_floor_counts_the_context_kv(monkeypatch) -> None:
    """--decode-context: the decode's prompt is that long, its metric says so, and its floor is
    the weights plus the K/V of the context at the decode's middle (prompt + half the output),
    per system (a cache of its own says its bytes per token); the TTFT's prompt is that long."""
    monkeypatch.setattr(bench, "measure_read", lambda probe: 20e9)
    monkeypatch.setattr(bench, "measure_matmul", lambda ceilings, device: 1e12)
    monkeypatch.setattr(bench, "READ_PROBE_BYTES", 1 << 12)
    prompts: list[int] = []

    class _Seen(_FixedSpeed):
        def run_single(self, prompt: list[int], n_out: int) -> Timing:
            prompts.append(len(prompt))
            return super().run_single(prompt, n_out)

    cost = ModelCost(layer_params=60_000_000, lm_head_params=40_000_000, num_layers=2,
                     attn_width=64, bytes_per_param=2, kv_bytes_per_token=100_000)
    own = _Seen("own-cache", 8.0)
    own.kv_bytes_per_token = 300_000  # type: ignore[attr-defined]
    rows = bench.bench_latency([_Seen("model", 8.0), own], list(range(100, 200)), 0.1, 1, 0,
                               cost, {"mem_read_bytes_per_s": 40e9, "matmul_flops": 1e12},
                               decode_context=2000)
    plen, n_out = 200, 13  # 2,000 and 128 tokens at scale 0.1
    assert prompts[0::2] == [plen, plen]  # (each system's second run is the long prefill)
    decode = {r.system: r for r in rows if r.metric == f"decode ms/token ({plen}-tok context)"}
    for name, kv in (("model", 100_000), ("own-cache", 300_000)):
        step = 200_000_000 + kv * (plen + n_out // 2)
        assert decode[name].details["bytes_per_step"] == step
        assert decode[name].ceiling == pytest.approx(step / 40e9 * 1e3)
        assert decode[name].details["fraction_of_read_beside"] == pytest.approx(
            step / 20e9 * 1e3 / 8.0)
    assert {r.metric for r in rows if r.metric.startswith("TTFT")} == {
        f"TTFT ms ({plen}-tok prompt)"}


def test_measure_matmul_reports_a_plausible_rate() -> None:
    """Both of its dtypes (bf16 where the bf16 matmul was the ceiling, float32 where that one
    was: a CPU without bf16 instructions) give a plausible FLOP/s."""
    for ceilings in ({"matmul_flops": 5.0, "matmul_flops_bfloat16": 5.0},
                     {"matmul_flops": 5.0, "matmul_flops_bfloat16": 1.0}):
        assert 1e8 < bench.measure_matmul(ceilings, torch.device("cpu"), reps=1) < 1e15


def test_measure_read_reports_bytes_per_second() -> None:
    probe = torch.ones(1 << 20)  # 4 MB
    speed = bench.measure_read(probe, reps=3)
    assert 1e8 < speed < 1e13  # plausible for any machine: 0.1 GB/s .. 10 TB/s


def test_bench_engines_compile_as_auto_decides(smollm2_path: str, monkeypatch) -> None:
    """The bench's first engine decides ``auto`` for the run (SmolLM2's decoder layers are one
    kernel call on CPU: eager), the engines after it and the server get that choice as an
    explicit mode, and an ``on`` asked for compiles before timing (``wait``)."""
    from minisgl.backends import cpu_kernels
    from minisgl.core import LLM
    from minisgl.server.cli import build_parser

    if not cpu_kernels.load():
        pytest.skip("no CPU kernels here: auto would compile (minutes)")
    monkeypatch.delenv("MINISGL_COMPILE", raising=False)  # tests/conftest.py sets "off"
    args = build_parser().parse_args(["bench", "latency", "--model", smollm2_path])
    assert bench.bench_engine_kwargs(args).get("compile", "auto") == "auto"
    with LLM(model=smollm2_path, **bench.bench_engine_kwargs(args)) as llm:
        bench.settle_compile(args, llm)
        assert llm.engine.compile_mode == "off" and llm.engine.graphs is None
    assert bench.bench_engine_kwargs(args)["compile"] == "off"
    on = build_parser().parse_args(["bench", "latency", "--model", smollm2_path, "--compile", "on"])
    assert bench.bench_engine_kwargs(on)["compile"] == "wait"


def test_sampling_spec_is_checked_by_field_name() -> None:
    assert bench.sampling_spec("greedy") == {}
    assert bench.sampling_spec("temperature=0.7,top_p=0.9,top_k=50,min_p=0.05") == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05}
    for bad, field in [("top_p=1.5", "top_p"), ("temperature=-1", "temperature"),
                       ("top_k=0", "top_k"), ("top_k=2.5", "top_k"), ("seed=3", "seed=3"),
                       ("temperature", "temperature"), ("temperature=0", "greedy")]:
        with pytest.raises(ValueError, match=field):
            bench.sampling_spec(bad)


def test_peers_sample_as_the_spec_says() -> None:
    """HF's and llama.cpp's own sampling defaults (top_k 50 / 40, min_p 0.05, temp 0.8) are off
    unless the spec names them; greedy stays greedy."""
    assert bench.hf_sampling({}) == {"do_sample": False}
    assert bench.hf_sampling({"temperature": 0.7, "top_p": 0.9}) == {
        "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": None}
    assert bench.llama_cpp_sampling({}) == {"top_k": 1, "temp": 0.0}
    assert bench.llama_cpp_sampling({"top_k": 20, "min_p": 0.1}) == {
        "temp": 1.0, "top_p": 1.0, "top_k": 20, "min_p": 0.1}


def test_minisgl_system_samples_with_the_spec(smollm2_path: str) -> None:
    """Offline and single-request runs carry the spec's parameters into every request."""
    from minisgl.core import LLM

    seen: list[object] = []
    with LLM(model=smollm2_path) as llm:
        system = bench.MinisglSystem(llm, sampling={"temperature": 0.7, "top_p": 0.9})
        add = llm.scheduler.add  # every request, offline or single, goes through it
        llm.scheduler.add = lambda req: (seen.append(req.params), add(req))[1]
        tokens, _ = system.run_offline(Workload("w", [[5, 6, 7], [8, 9]], [3, 4]))
        timing = system.run_single([10, 11, 12], 5)
    assert tokens == 7 and timing.n_out == 5 and len(seen) == 3
    assert all(p.temperature == 0.7 and p.top_p == 0.9 and p.ignore_eos for p in seen)


def test_bench_refuses_sampling_where_a_workload_runs_greedy() -> None:
    from minisgl.server.cli import build_parser

    for workload in ("shared-prefix", "all", "quality"):
        args = build_parser().parse_args(["bench", workload, "--sampling", "temperature=0.7"])
        with pytest.raises(ValueError, match="runs greedy"):
            bench.cmd_bench(args)
