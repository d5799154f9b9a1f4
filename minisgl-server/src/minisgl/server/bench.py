"""``minisgl bench``: minisgl vs HF transformers ``generate`` on the workloads of benchmarks.md.

Workloads (``--scale`` multiplies every length, ``--num-requests`` the request count):

* ``offline-mixed``: N requests (64), prompt length uniform in [64, 512], output length uniform in
  [32, 256], random non-special token ids, greedy, ignore_eos, seed 0. Metric: generated tokens /
  wall time. HF runs static batches of 16 with left padding and counts only each request's own
  output tokens.
* ``latency``: one 128-token prompt, 128 output tokens: decode ms/token measured apart from the
  prefill (time to first token, then the rest / (n - 1)); plus one 1024-token prefill
  (``--prefill-tokens``: a longer prompt, where attention weighs more). ``--decode-context N``:
  an N-token prompt before the decode instead, where the K/V read per step weighs more.
* ``shared-prefix``: 8 groups x 8 prompts sharing a 1024-token system prompt per group, 64-token
  questions, 32 output tokens, all at once: throughput and mean TTFT with the radix cache, with
  ``--cache naive`` (system ``minisgl-naive``), and HF (bench_prefix.py).

* ``tp`` (not in ``all``): peak memory per rank and step time at TP=1 vs ``--tp`` (bench_tp.py).
* ``quality`` (not in ``all``): int8 (weights; or the KV pool, ``--kv-cache-dtype int8``) vs
  unquantized perplexity of a fixed text and greedy chat answers side by side (bench_quality.py).
* ``speculative`` (not in ``all``): chat answers about paragraphs of a real text with and
  without prompt-lookup drafts (``--speculative-tokens``), alternating (bench_spec.py).
* ``burst``: 16 requests x 64 tokens (128-token prompts) at once: output tokens / wall time.
* ``online``: the HTTP server (``minisgl serve``, started with the engine flags, or ``--url``)
  under 1, 8 and 32 concurrent streaming clients; server over offline throughput, each level
  also against an offline engine capped at that many running requests (bench_serve.py).

``--compare llama-cpp`` adds llama.cpp (llama-cpp-python on the GGUF the bundled model comes from,
Q4_1, one request at a time) to offline-mixed, latency and burst.

``--vs-overlap`` adds a ``minisgl-overlap`` system (overlap scheduling forced on; the CPU default
is off) to offline-mixed and latency; ``--vs-fixed-threads`` a ``minisgl-fixed`` one (always all
its threads: ``--no-adapt-threads``) to offline-mixed, latency and burst.

``--busy N`` runs every system beside N processes that each keep a core busy (a laptop's browser
or build), started after the ceilings are measured and stopped at the end.

Every result is also put next to a ceiling measured in the same run: a matmul in the run's dtype
(FLOP/s; bf16 and float32 are both measured and printed) and a large reduction (memory read
GB/s). The read ceiling is the best of ten passes, and a shared machine's reads swing from minute
to minute (40-75 GB/s within an hour on the 2-core VM of docs/benchmarks.md), so latency also
reads memory right before and after each decode run and prints, below the table, each system's
decode against the floor at that read ("beside"; the table keeps the ceiling's fraction). A
system's decode floor is the bytes of weights it reads per token over the read's speed: the
model's in minisgl's format (bf16, or int8 with ``--quantization int8``), for llama.cpp its own
GGUF's (Q4_1). The
matmul swings too (1.2-2.1 TFLOP/s bf16 within a night on the 2-core AMX VM), so latency also
multiplies right before and after each 1,024-token prefill and prints its fraction of the higher
of the two.
Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

WORKLOADS = ("offline-mixed", "latency", "burst", "shared-prefix", "online")


# ---------------------------------------------------------------------------- records


@dataclass
class Timing:
    """One request timed from submission: first token after ``ttft_s``, all ``n_out`` by ``total_s``."""

    ttft_s: float
    total_s: float
    n_out: int

    @property
    def decode_ms_per_token(self) -> float:
        return (self.total_s - self.ttft_s) / max(1, self.n_out - 1) * 1e3


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass
class Row:
    workload: str
    system: str
    metric: str
    value: float
    higher_is_better: bool
    speedup_vs_hf: float | None = None  # >1: minisgl better than HF
    ceiling: float | None = None  # best value the hardware allows, same unit
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def fraction_of_ceiling(self) -> float | None:
        if self.ceiling is None or self.value <= 0:
            return None
        return self.value / self.ceiling if self.higher_is_better else self.ceiling / self.value


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- machine and ceilings


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model numbers: a VM's name can be
    as bare as "AMD EPYC", where the family tells Zen 4 (25) from Zen 5 (26), whose vector units
    are twice as wide (the bf16 matmul ceiling ~470 against ~930 GFLOP/s on 2 cores). Elsewhere
    what the platform module says."""
    import platform

    from minisgl.backends import cpu_kernels

    fields = cpu_kernels.cpuinfo()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def machine_info(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    import torch

    from minisgl.backends import cpu_kernels

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "device": str(device), "load_average_1m": round(os.getloadavg()[0], 2)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu_kernels"] = torch.ops.minisgl_cpu.linear_isa() if cpu_kernels.load() else "none"
    return info


def _times(fn: Callable[[], object], reps: int) -> list[float]:
    """Wall seconds of each of ``reps`` calls; work queued on a GPU counts (synchronized)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _best_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    return min(_times(fn, reps))


def _matmul_flops(dtype: torch.dtype, device: torch.device, n: int = 2048, reps: int = 10
                  ) -> float:
    """Best of ``reps`` n x n matmuls, in FLOP/s; where a 512 x 512 one is slow (bf16 on a CPU
    without bf16 instructions: ~1 GFLOP/s per thread, a minute per 2048 product) that one.
    GPUs multiply 8192 x 8192 (a 2048 product is over before the GPU is busy)."""
    import torch

    if device.type == "cuda":
        n = 8192
    a, b = (torch.randn(512, 512, dtype=dtype, device=device) for _ in range(2))
    t = _best_time(lambda: a @ b, 1)
    if t * (n / 512) ** 3 > 2.0:
        return 2 * 512 ** 3 / t
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n ** 3 / _best_time(lambda: a @ b, reps)


def measure_ceilings(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """Peak matmul FLOP/s (n=2048) in bf16 and float32, and memory read bandwidth (256 MB
    float32 sum; 4 GB on a GPU), on the run's device. ``matmul_flops`` is the one of ``dtype``,
    the run's: fractions use it. For bf16 on a CPU it is the larger of the two: a CPU without
    bf16 instructions (AVX2) multiplies bf16 in float32 (the engine's kernels do), while
    PyTorch's own bf16 matmul there falls back to a path ~40x slower than the float32 one (Zen 3:
    1.3 vs 49 GFLOP/s per thread), not a ceiling of the machine."""
    import torch

    out: dict[str, float] = {}
    for dt in (torch.bfloat16, torch.float32):
        out[f"matmul_flops_{str(dt).removeprefix('torch.')}"] = _matmul_flops(dt, device)
    out["matmul_flops"] = out[f"matmul_flops_{str(dtype).removeprefix('torch.')}"]
    if dtype == torch.bfloat16 and device.type == "cpu":
        out["matmul_flops"] = max(out["matmul_flops"], out["matmul_flops_float32"])
    x = read_probe((4 << 30) if device.type == "cuda" else (256 << 20), device)
    out["mem_read_bytes_per_s"] = x.numel() * x.element_size() / _best_time(x.sum, 10)
    return out


READ_PROBE_BYTES = 128 << 20  # 4x the 32 MB L3 of the host measured (the ceiling reads 256 MB)


def read_probe(nbytes: int, device: torch.device) -> torch.Tensor:
    """float32 ones to sum for a read speed, in the memory the CPU kernels keep packed weights in
    (2 MiB pages where Linux grants them: a 128 MB sum read 0-7% faster there than in 4 KiB
    pages on Zen 3), so that the floor is the machine's best read, not a page-size handicap."""
    import torch

    from minisgl.backends import cpu_kernels

    if device.type != "cpu":
        return torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    if cpu_kernels.load():
        probe: torch.Tensor = torch.ops.minisgl_cpu.weight_zeros([nbytes // 4], torch.float32)
        return probe.fill_(1)
    return torch.ones(nbytes // 4, dtype=torch.float32)


def measure_matmul(ceilings: dict[str, float], device: torch.device, reps: int = 3) -> float:
    """Matmul FLOP/s of the moment: ``_matmul_flops`` with ``reps`` products in the dtype whose
    ceiling ``matmul_flops`` is (``measure_ceilings``), ~30 ms on a 2-core AMX CPU."""
    import torch

    dt = (torch.bfloat16 if ceilings["matmul_flops"] == ceilings.get("matmul_flops_bfloat16")
          else torch.float32)
    return _matmul_flops(dt, device, reps=reps)


def measure_read(probe: torch.Tensor, reps: int = 3) -> float:
    """Memory read bytes/s of the moment: the median of ``reps`` sums of ``probe``."""
    return probe.numel() * probe.element_size() / statistics.median(_times(probe.sum, reps))


@dataclass(frozen=True)
class ModelCost:
    """Analytic cost of a decoder-only transformer from its config (biases and norms ignored)."""

    layer_params: int  # all decoder layers
    lm_head_params: int
    num_layers: int
    attn_width: int  # num_heads * head_dim
    bytes_per_param: int
    kv_bytes_per_token: int = 0  # K and V of one token in the KV pool, all layers

    @classmethod
    def from_config(cls, mc: Any, dtype: torch.dtype, quantization: str | None = None,
                    kv_cache_dtype: str = "auto") -> ModelCost:
        """``quantization="int8"``: one byte per weight (every linear layer and the LM head;
        the per-row scales are ignored). ``kv_cache_dtype="int8"``: K/V rows of head_dim bytes
        and a float32 scale (the pool's records); else head_dim values of ``dtype``."""
        import torch

        d, hd = mc.hidden_size, mc.head_dim
        attn = d * hd * (2 * mc.num_heads + 2 * mc.num_kv_heads)
        mlp = 3 * d * mc.intermediate_size
        element = torch.empty(0, dtype=dtype).element_size()
        size = 1 if quantization == "int8" else element
        row = hd + 4 if kv_cache_dtype == "int8" else hd * element
        return cls(mc.num_layers * (attn + mlp), mc.vocab_size * d, mc.num_layers,
                   mc.num_heads * hd, size, mc.num_layers * 2 * mc.num_kv_heads * row)

    def decode_bytes(self) -> int:
        """Weights read by one batch-1 decode step (the lm_head once, tied or not)."""
        return (self.layer_params + self.lm_head_params) * self.bytes_per_param

    def prefill_flops(self, start: int, n: int) -> float:
        """FLOPs of tokens at positions start .. start+n-1 (closed form of the sum)."""
        positions_sum = n * start + n * (n + 1) / 2
        return 2.0 * self.layer_params * n + 4.0 * self.num_layers * self.attn_width * positions_sum

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        """Prompt + decoded tokens, plus the lm_head for every generated token."""
        return (self.prefill_flops(0, prompt_len) + self.prefill_flops(prompt_len, output_len - 1)
                + 2.0 * self.lm_head_params * output_len)


# ---------------------------------------------------------------------------- workloads


def normal_token_ids(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] = ()) -> list[int]:
    """Ids a random prompt may use: inside both vocabularies, no special or added tokens (a
    checkpoint without a tokenizer, such as ``bench_tp --make-random``'s: every id of the model's
    vocabulary but its end-of-sequence ids)."""
    if tokenizer is None:
        return [i for i in range(vocab_size) if i not in set(eos_ids)]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return [i for i in range(min(vocab_size, len(tokenizer))) if i not in special]


def random_prompt(rng: random.Random, ids: Sequence[int], n: int) -> list[int]:
    return [ids[rng.randrange(len(ids))] for _ in range(n)]


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def offline_mixed(ids: Sequence[int], num_requests: int, scale: float, seed: int) -> Workload:
    rng = random.Random(seed)
    plens = [rng.randint(_scaled(64, scale), _scaled(512, scale)) for _ in range(num_requests)]
    olens = [rng.randint(_scaled(32, scale), _scaled(256, scale)) for _ in range(num_requests)]
    return Workload("offline-mixed", [random_prompt(rng, ids, n) for n in plens], olens)


# ---------------------------------------------------------------------------- systems


class System(Protocol):
    name: str

    def run_offline(self, wl: Workload) -> tuple[int, float]:
        """(generated tokens counted, wall seconds)."""
        ...

    def run_single(self, prompt: list[int], n_out: int) -> Timing: ...


def warmup(system: System, ids: Sequence[int]) -> None:
    """A short offline run and a single request, on prompts unrelated to any measured one."""
    rng = random.Random("warmup")
    prompts = [random_prompt(rng, ids, n) for n in (32, 48)]
    system.run_offline(Workload("warmup", prompts, [8, 8]))
    system.run_single(random_prompt(rng, ids, 16), 4)


class MinisglSystem:
    def __init__(self, llm: Any, name: str = "minisgl",
                 sampling: dict[str, float] | None = None) -> None:
        self.llm, self.name = llm, name
        self.sampling = sampling or {"temperature": 0.0}  # greedy unless --sampling says

    def run_offline(self, wl: Workload) -> tuple[int, float]:
        from minisgl.core import SamplingParams

        params = [SamplingParams(max_tokens=n, ignore_eos=True, **self.sampling)
                  for n in wl.output_lens]
        t0 = time.perf_counter()
        outs = self.llm.generate(wl.prompts, params)
        elapsed = time.perf_counter() - t0
        return sum(len(o.token_ids) for o in outs), elapsed

    def run_single(self, prompt: list[int], n_out: int) -> Timing:
        """Drive the scheduler directly so the first token's time is visible. A request counts as
        having its first token when a step reports it changed (with overlap scheduling a token
        is a placeholder until its step is collected)."""
        from minisgl.core import SamplingParams
        from minisgl.core.request import Req

        sp = SamplingParams(max_tokens=n_out, ignore_eos=True, **self.sampling)
        req = Req(list(prompt), sp, frozenset(self.llm.engine.model_config.eos_token_ids))
        sched = self.llm.scheduler
        t0 = time.perf_counter()
        sched.add(req)
        ttft: float | None = None
        while not req.finished:
            changed = sched.step()
            if ttft is None and req in changed:
                ttft = time.perf_counter() - t0
            if not changed and not sched.has_work():
                raise RuntimeError("scheduler went idle before the request finished")
        total = time.perf_counter() - t0
        if hasattr(sched, "drain"):
            sched.drain()  # a step may still be in flight for the finished request
        return Timing(ttft if ttft is not None else total, total, len(req.output_ids))


class _TokenClock:
    """An HF streamer that only records when each put() happens (prompt first, then tokens)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFSystem:
    name = "hf"
    kv_bytes_per_token: int | None = None  # its cache's, per token of context (bench_latency)

    def __init__(self, model_dir: str, dtype: torch.dtype, pad_id: int, batch_size: int,
                 device: torch.device | None = None,
                 sampling: dict[str, float] | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        device = device or torch.device("cpu")
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model, self.device = model.to(device).eval(), device
        self.pad_id, self.batch_size = pad_id, batch_size
        self.sample_kwargs = hf_sampling(sampling or {})

    def _left_padded(self, prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, n: int, streamer: Any = None) -> int:
        """Exactly n new tokens (min_new_tokens keeps EOS from ending it: ignore_eos), greedy
        or as --sampling says."""
        import torch

        with torch.inference_mode():
            ids, mask = ids.to(self.device), mask.to(self.device)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                      min_new_tokens=n, pad_token_id=self.pad_id,
                                      streamer=streamer, **self.sample_kwargs)
        return int(out.shape[1] - ids.shape[1])

    def run_offline(self, wl: Workload) -> tuple[int, float]:
        counted = 0
        t0 = time.perf_counter()
        for start in range(0, len(wl.prompts), self.batch_size):
            prompts = wl.prompts[start: start + self.batch_size]
            olens = wl.output_lens[start: start + self.batch_size]
            ids, mask = self._left_padded(prompts)
            generated = self._generate(ids, mask, max(olens))
            counted += sum(min(n, generated) for n in olens)
        return counted, time.perf_counter() - t0

    def run_single(self, prompt: list[int], n_out: int) -> Timing:
        ids, mask = self._left_padded([prompt])
        clock = _TokenClock()
        t0 = time.perf_counter()
        generated = self._generate(ids, mask, n_out, streamer=clock)
        total = time.perf_counter() - t0
        ttft = clock.times[1] - t0 if len(clock.times) > 1 else total
        return Timing(ttft, total, generated)


# ---------------------------------------------------------------------------- runs


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python on the GGUF the bundled SmolLM2 comes from (Q4_1).

    Its Python API runs one sequence at a time, so offline workloads are served one by one (what
    a user of that API gets). Greedy, exactly n tokens (``generate`` ignores EOS), no prefix reuse
    between requests; its own sampler where --sampling asks for one. Install: ``pip install
    llama-cpp-python`` (builds llama.cpp; ~10 min on 2 cores).
    """

    name = "llama-cpp"
    kv_bytes_per_token: int | None = None  # its f16 cache's, per token of context

    def __init__(self, gguf: str, threads: int, n_ctx: int = 4096,
                 sampling: dict[str, float] | None = None) -> None:
        import llama_cpp.llama
        from llama_cpp import Llama

        # On a CPU with AMX llama.cpp repacks the weights for its AMX kernels (an "extra buffer
        # type", on by default); llama-cpp-python 0.3.36 built with -march=native segfaulted
        # in its first decode there (Intel with AMX, 2026-12-04). A child process tries that
        # first; if it dies, llama.cpp runs here without extra buffer types (its AVX-512 path).
        self.extra_buffers = _llama_cpp_extra_buffers_work(gguf, threads)
        if not self.extra_buffers:
            log("llama.cpp crashed with its extra buffer types (AMX repacking) in a child "
                "process: running it without them")
        defaults = llama_cpp.llama.llama_cpp.llama_model_default_params

        def params() -> Any:
            p = defaults()
            p.use_extra_bufts = self.extra_buffers
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
        try:
            self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads,
                             n_threads_batch=threads, n_batch=1024, verbose=False)
        finally:
            llama_cpp.llama.llama_cpp.llama_model_default_params = defaults
        # What one decode step reads, for its floor (not the bf16 model's): the GGUF's tensors
        # (bundled SmolLM2: 96.6 MB, Q4_1 layers and a Q8_0 embedding that is also the LM head),
        # by llama_model_size; else the file's size (its metadata, ~2% more, included).
        model = getattr(self.llm, "_model", None)
        self.decode_bytes = int(model.size()) if hasattr(model, "size") else os.path.getsize(gguf)
        self.sample_kwargs = llama_cpp_sampling(sampling or {})

    def _generate(self, prompt: list[int], n_out: int) -> tuple[int, float | None, float]:
        """(tokens, seconds to the first, seconds in all)."""
        t0 = time.perf_counter()
        first, count = None, 0
        for _ in self.llm.generate(prompt, reset=True, **self.sample_kwargs):
            count += 1
            if first is None:
                first = time.perf_counter() - t0
            if count >= n_out:
                break
        return count, first, time.perf_counter() - t0

    def run_offline(self, wl: Workload) -> tuple[int, float]:
        total, t0 = 0, time.perf_counter()
        for prompt, n in zip(wl.prompts, wl.output_lens):
            total += self._generate(prompt, n)[0]
        return total, time.perf_counter() - t0

    def run_single(self, prompt: list[int], n_out: int) -> Timing:
        count, first, total = self._generate(prompt, n_out)
        return Timing(first if first is not None else total, total, count)


def _cpu_has_amx() -> bool:
    from minisgl.backends import cpu_kernels

    return "amx_int8" in cpu_kernels.cpu_flags()


def _llama_cpp_extra_buffers_work(gguf: str, threads: int) -> bool:
    """Whether llama-cpp-python survives a prefill and a few decode steps with its default
    buffer types, tried in a child process (a crash there costs the bench nothing). Only where
    the CPU has AMX, the one extra buffer type seen to crash; elsewhere True untried."""
    if not _cpu_has_amx():
        return True
    code = textwrap.dedent("""
        import sys
        from llama_cpp import Llama
        llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]),
                    n_threads_batch=int(sys.argv[2]), n_batch=512, verbose=False)
        for i, _ in enumerate(llm.generate(list(range(100, 164)), top_k=1, temp=0.0)):
            if i == 3:
                break
    """)
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", code, gguf, str(threads)],
                              capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def bench_offline(systems: Sequence[System], ids: Sequence[int], num_requests: int, scale: float,
                  repeats: int, seed: int, cost: ModelCost, ceilings: dict[str, float]) -> list[Row]:
    """Repeat r uses seed + r: fresh prompts, so a prefix cache never turns a repeat into hits."""
    runs: dict[str, list[dict[str, float]]] = {s.name: [] for s in systems}
    ceilings_tok_s: list[float] = []
    for r in range(repeats):  # systems interleaved within each repeat: they share the noise
        wl = offline_mixed(ids, num_requests, scale, seed + r)
        total_out = sum(wl.output_lens)
        flops = sum(cost.request_flops(len(p), n) for p, n in zip(wl.prompts, wl.output_lens))
        ceilings_tok_s.append(total_out / (flops / ceilings["matmul_flops"]))  # FLOPs at peak
        for s in systems:
            log(f"offline-mixed: {s.name} run {r + 1}/{repeats} ({len(wl.prompts)} requests, "
                f"{sum(len(p) for p in wl.prompts)} prompt + {total_out} output tokens)")
            tokens, secs = s.run_offline(wl)
            runs[s.name].append({"tokens": tokens, "seconds": secs, "tok_s": tokens / secs})
            log(f"offline-mixed: {s.name} {tokens} tokens in {secs:.2f} s = {tokens / secs:.1f} tok/s")
    ceiling = statistics.median(ceilings_tok_s)
    return [Row("offline-mixed", name, "output tok/s", statistics.median(x["tok_s"] for x in rs),
                True, ceiling=ceiling, details={"runs": rs}) for name, rs in runs.items()]


def bench_burst(systems: Sequence[System], ids: Sequence[int], scale: float, repeats: int,
                seed: int) -> list[Row]:
    """16 requests x 64 output tokens (128-token prompts) arriving at once; median of repeats."""
    runs: dict[str, list[float]] = {s.name: [] for s in systems if s.name != "minisgl-naive"}
    for r in range(repeats):
        rng = random.Random(f"burst/{seed}/{r}")  # fresh prompts per repeat: no cache hits
        wl = Workload("burst", [random_prompt(rng, ids, _scaled(128, scale)) for _ in range(16)],
                      [_scaled(64, scale)] * 16)
        for s in systems:
            if s.name in runs:
                tokens, secs = s.run_offline(wl)
                runs[s.name].append(tokens / secs)
                log(f"burst: {s.name} run {r + 1}/{repeats}: {tokens / secs:.1f} tok/s")
    return [Row("burst", name, "16x64 output tok/s", statistics.median(v), True,
                details={"runs": v}) for name, v in runs.items()]


def latency_lengths(scale: float, decode_context: int = 128, prefill_tokens: int = 1024
                    ) -> tuple[int, int, int]:
    """bench_latency's lengths: the prompt before the decode, the tokens decoded, the long
    prompt prefilled."""
    return (_scaled(decode_context, scale), max(2, _scaled(128, scale)),
            _scaled(prefill_tokens, scale))


def bench_latency(systems: Sequence[System], ids: Sequence[int], scale: float, repeats: int,
                  seed: int, cost: ModelCost, ceilings: dict[str, float],
                  device: torch.device | None = None, prefill_tokens: int = 1024,
                  decode_context: int = 128) -> list[Row]:
    import torch

    device = device or torch.device("cpu")
    plen, n_out, long_len = latency_lengths(scale, decode_context, prefill_tokens)
    # What a decode step reads: the weights (a system in a format of its own, llama.cpp's GGUF,
    # says how many bytes) and the K/V of its context, taken at the decode's middle (a system
    # with a cache of its own, llama.cpp's f16 one, says its bytes per token).
    weights = {s.name: getattr(s, "decode_bytes", None) or cost.decode_bytes() for s in systems}
    kv = {s.name: getattr(s, "kv_bytes_per_token", None) or cost.kv_bytes_per_token
          for s in systems}
    step = {name: weights[name] + kv[name] * (plen + n_out // 2) for name in weights}
    decode_metric = "decode ms/token" + ("" if decode_context == 128 else
                                         f" ({plen}-tok context)")
    prefill_ceiling = long_len / (cost.prefill_flops(0, long_len) / ceilings["matmul_flops"])
    runs: dict[str, dict[str, list[float]]] = {
        s.name: {"decode": [], "ttft": [], "prefill": [], "read": [], "matmul": []}
        for s in systems}
    probe = read_probe(READ_PROBE_BYTES, device)
    for r in range(repeats):  # systems interleaved within each repeat: they share the noise
        rng = random.Random(f"latency/{seed}/{r}")  # fresh prompts per repeat: no cache hits
        prompt, long_prompt = random_prompt(rng, ids, plen), random_prompt(rng, ids, long_len)
        for s in systems:
            log(f"latency: {s.name} run {r + 1}/{repeats}: {plen}-token prompt, {n_out} tokens; "
                f"then a {long_len}-token prefill")
            before = measure_read(probe)
            t = s.run_single(prompt, n_out)
            after = measure_read(probe)
            mm_before = measure_matmul(ceilings, device)
            p = s.run_single(long_prompt, 1)
            mm_after = measure_matmul(ceilings, device)
            got = runs[s.name]
            got["read"].append((before + after) / 2)
            got["matmul"].append(max(mm_before, mm_after))  # the higher: the stricter fraction
            got["decode"].append(t.decode_ms_per_token)
            got["ttft"].append(t.ttft_s * 1e3)
            got["prefill"].append(long_len / p.ttft_s)
            log(f"latency: {s.name} decode {t.decode_ms_per_token:.2f} ms/token, "
                f"ttft {t.ttft_s * 1e3:.1f} ms, prefill {long_len / p.ttft_s:.0f} tok/s")
    rows = []
    for name, got in runs.items():
        rows += [
            Row("latency", name, decode_metric, statistics.median(got["decode"]), False,
                ceiling=step[name] / ceilings["mem_read_bytes_per_s"] * 1e3, details={
                    "runs": got["decode"], "output_tokens": n_out, "context_tokens": plen,
                    "weight_bytes_per_token": weights[name],
                    "kv_bytes_per_context_token": kv[name], "bytes_per_step": step[name],
                    "read_bytes_per_s_beside": got["read"],
                    "fraction_of_read_beside": statistics.median(
                        step[name] / read * 1e3 / ms
                        for read, ms in zip(got["read"], got["decode"]))}),
            Row("latency", name, f"TTFT ms ({plen}-tok prompt)", statistics.median(got["ttft"]),
                False, details={"runs": got["ttft"]}),
            Row("latency", name, f"prefill tok/s ({long_len} tok)", statistics.median(got["prefill"]),
                True, ceiling=prefill_ceiling, details={
                    "runs": got["prefill"], "matmul_flops_beside": got["matmul"],
                    "fraction_of_matmul_beside": statistics.median(
                        tok_s * cost.prefill_flops(0, long_len) / long_len / flops
                        for flops, tok_s in zip(got["matmul"], got["prefill"]))}),
        ]
    return rows


def add_speedups(rows: list[Row]) -> None:
    hf = {(r.workload, r.metric): r.value for r in rows if r.system == "hf"}
    for r in rows:
        base = hf.get((r.workload, r.metric))
        if base and r.value > 0:
            r.speedup_vs_hf = r.value / base if r.higher_is_better else base / r.value


def peer_ratios(rows: Sequence[Row]) -> list[str]:
    """minisgl against its own variants (radix vs naive cache, overlap on vs off)."""
    by_key = {(r.workload, r.system, r.metric): r for r in rows}
    lines = []
    for r in rows:
        if r.system != "minisgl":
            continue
        for peer in ("minisgl-naive", "minisgl-overlap", "minisgl-fixed", "llama-cpp"):
            other = by_key.get((r.workload, peer, r.metric))
            if other and other.value > 0 and r.value > 0:
                ratio = r.value / other.value if r.higher_is_better else other.value / r.value
                lines.append(f"{r.workload}: minisgl vs {peer}, {r.metric}: {ratio:.2f}x better")
    return lines


def beside_lines(rows: Sequence[Row]) -> list[str]:
    """Each system's decode against the floor at the memory read measured beside its runs, and
    its prefill against the matmul measured beside its runs (the higher of before and after)."""
    return [f"{r.workload}: {r.system} decode at {r.details['fraction_of_read_beside']:.0%} of "
            f"the floor at the read measured beside its runs "
            f"({statistics.median(r.details['read_bytes_per_s_beside']) / 1e9:.1f} GB/s median)"
            for r in rows if "fraction_of_read_beside" in r.details] + [
            f"{r.workload}: {r.system} prefill at {r.details['fraction_of_matmul_beside']:.0%} of "
            f"the matmul peak measured beside its runs (the higher of before and after each; "
            f"{statistics.median(r.details['matmul_flops_beside']) / 1e9:,.0f} GFLOP/s median)"
            for r in rows if "fraction_of_matmul_beside" in r.details]


def format_table(rows: Sequence[Row]) -> str:
    head = ["workload", "system", "metric", "value", "speedup vs hf", "of ceiling", "ceiling"]
    body = [[r.workload, r.system, r.metric, f"{r.value:,.2f}",
             "-" if r.speedup_vs_hf is None else f"{r.speedup_vs_hf:.2f}x",
             "-" if r.fraction_of_ceiling is None else f"{r.fraction_of_ceiling:.0%}",
             "-" if r.ceiling is None else f"{r.ceiling:,.2f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """A PNG: one panel per workload metric, a bar per system (matplotlib, imported here)."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.workload, r.metric) for r in rows))
    cols = min(3, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (workload, metric) in zip(axes.flat, keys):
        sel = [r for r in rows if (r.workload, r.metric) == (workload, metric)]
        ax.bar([r.system for r in sel], [r.value for r in sel],
               color=["tab:blue" if r.system.startswith("minisgl") else "tab:gray" for r in sel])
        better = "higher" if sel[0].higher_is_better else "lower"
        ax.set_title(f"{workload}\n{metric} ({better} is better)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(textwrap.fill(title, 60 * cols), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_line(info: dict[str, Any], ceilings: dict[str, float]) -> str:
    return (f"machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
            f"dtype {info['dtype']}, torch {info['torch']}, "
            + (f"GPU {info['gpu']}, " if "gpu" in info else f"kernels {info['cpu_kernels']}, ")
            + f"load {info['load_average_1m']}"
            + (f", beside {info['busy_processes']} busy processes" if info.get("busy_processes")
               else "")
            + "; ceilings: "
            f"{ceilings['matmul_flops'] / 1e9:.0f} GFLOP/s matmul ("
            + ", ".join(f"{k.removeprefix('matmul_flops_')} {v / 1e9:.0f}"
                        for k, v in ceilings.items() if k.startswith("matmul_flops_"))
            + f"), {ceilings['mem_read_bytes_per_s'] / 1e9:.1f} GB/s memory read")


# ---------------------------------------------------------------------------- command


PEERS = ("hf", "llama-cpp")


SAMPLED_WORKLOADS = ("latency", "burst", "offline-mixed", "online")


def sampling_spec(value: str) -> dict[str, float]:
    """``--sampling``: greedy, or name=value pairs of temperature, top_p, top_k and min_p
    separated by commas (checked as SamplingParams checks them); what every system samples
    with in the latency, burst, offline-mixed and online workloads (the server's requests
    carry it too)."""
    from minisgl.core import SamplingParams

    if value == "greedy":
        return {}
    out: dict[str, float] = {}
    for item in value.split(","):
        name, eq, text = item.partition("=")
        name = name.strip()
        if name not in ("temperature", "top_p", "top_k", "min_p") or not eq:
            raise ValueError(f"sampling: {item!r} is not temperature=, top_p=, top_k= or min_p=; "
                             "e.g. temperature=0.7,top_p=0.9 (or greedy)")
        try:
            out[name] = int(text) if name == "top_k" else float(text)
        except ValueError:
            raise ValueError(f"sampling: {name} must be a number (got {text!r})") from None
    SamplingParams(**out)  # type: ignore[arg-type]  # the engine's own checks, by field name
    if out.get("temperature", 1.0) == 0.0:
        raise ValueError("sampling: temperature=0 is greedy; use --sampling greedy")
    return out


def hf_sampling(sampling: dict[str, float]) -> dict[str, Any]:
    """transformers generate's arguments for a --sampling spec (its own defaults, such as
    top_k 50, switched off where the spec does not name them)."""
    if not sampling:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.get("temperature", 1.0),
            "top_p": sampling.get("top_p", 1.0), "top_k": max(0, int(sampling.get("top_k", 0))),
            "min_p": sampling.get("min_p") or None}


def llama_cpp_sampling(sampling: dict[str, float]) -> dict[str, Any]:
    """llama-cpp-python generate's arguments (its defaults top_k 40, top_p 0.95, min_p 0.05
    and temp 0.8 off unless named)."""
    if not sampling:
        return {"top_k": 1, "temp": 0.0}
    return {"temp": sampling.get("temperature", 1.0), "top_p": sampling.get("top_p", 1.0),
            "top_k": max(0, int(sampling.get("top_k", 0))), "min_p": sampling.get("min_p", 0.0)}


def compare_list(value: str) -> list[str]:
    """``--compare``: none, or peers separated by commas (hf, llama-cpp)."""
    peers = [p for p in value.split(",") if p and p != "none"]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"compare: unknown peer {bad[0]!r}; use none or any of {', '.join(PEERS)}")
    return peers


def bench_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags, with compilation (where it is on) finished before timing starts: the
    bench measures the steady state and reports compile time apart. ``auto`` is decided by the
    first engine built (``settle_compile``), per model; ``on`` becomes ``wait``."""
    from minisgl.core.config import default_mode
    from minisgl.server.cli import engine_kwargs

    kw = engine_kwargs(args)
    if (kw.get("compile") or default_mode()) == "on":
        kw["compile"] = "wait"
    return kw


def settle_compile(args: argparse.Namespace, llm: Any) -> None:
    """After the run's first engine: wait for its graphs where ``auto`` chose to compile them,
    and give the engines built after it (and the server) what it chose, as ``wait`` or
    ``off``."""
    graphs = llm.engine.graphs
    if graphs is not None:
        graphs.join()  # auto's "on": the compile worker, then the graphs loaded
        log(f"graphs compiled in {graphs.describe()}")
    args.compile = "off" if graphs is None else "wait"


def _load_systems(args: argparse.Namespace) -> tuple[Any, list[System]]:
    import torch

    from minisgl.core import LLM

    kw = bench_engine_kwargs(args)
    log(f"loading minisgl ({args.model})")
    llm = LLM(model=args.model, **kw)
    mc = llm.engine.model_config
    plen, n_out, long_len = latency_lengths(args.scale, args.decode_context, args.prefill_tokens)
    decode_len = plen + n_out
    if args.workload in ("latency", "all"):
        for field, n in (("prefill_tokens", long_len), ("decode_context", decode_len)):
            if n > llm.engine.max_model_len:
                llm.close()
                raise ValueError(f"{field}: {n} tokens is more than the model takes "
                                 f"({llm.engine.max_model_len})")
    settle_compile(args, llm)
    kw = bench_engine_kwargs(args)
    sampling = sampling_spec(args.sampling)
    systems: list[System] = [MinisglSystem(llm, sampling=sampling)]
    if args.vs_overlap:
        systems.append(MinisglSystem(LLM(model=args.model, **dict(kw, overlap=True)),
                                     "minisgl-overlap", sampling))
    if args.vs_fixed_threads:
        systems.append(MinisglSystem(LLM(model=args.model, **dict(kw, adapt_threads=False)),
                                     "minisgl-fixed", sampling))
    if args.workload in ("shared-prefix", "all"):
        systems.append(MinisglSystem(LLM(model=args.model, **dict(kw, cache="naive")),
                                     "minisgl-naive"))
    peers = compare_list(args.compare)
    if "llama-cpp" in peers:
        from minisgl.core.bundled import _locate_gguf

        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError("--compare llama-cpp needs llama-cpp-python: pip install "
                               "llama-cpp-python")
        log("loading llama.cpp (llama-cpp-python) on the bundled Q4_1 GGUF")
        lcpp = LlamaCppSystem(str(_locate_gguf()), args.threads or torch.get_num_threads(),
                              n_ctx=max(4096, long_len + 16, decode_len + 16), sampling=sampling)
        # its cache: f16 K and V
        lcpp.kv_bytes_per_token = ModelCost.from_config(mc, torch.float16).kv_bytes_per_token
        systems.append(lcpp)
    if "hf" in peers:
        log("loading HF transformers model")
        pad = getattr(llm.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = mc.eos_token_ids[0]
        hf = HFSystem(mc.path, llm.engine.dtype, int(pad),
                      args.hf_batch_size, llm.engine.device, sampling)
        # its cache: the model's dtype
        hf.kv_bytes_per_token = ModelCost.from_config(mc, llm.engine.dtype).kv_bytes_per_token
        systems.append(hf)
    return llm, systems


def _run_workloads(args: argparse.Namespace, workloads: Sequence[str], systems: Sequence[System],
                   ids: Sequence[int], cost: ModelCost, ceilings: dict[str, float]) -> list[Row]:
    import torch

    rows: list[Row] = []
    for name in workloads:
        if name == "offline-mixed":
            plain = [s for s in systems if s.name != "minisgl-naive"]
            rows += bench_offline(plain, ids, args.num_requests, args.scale, args.repeats or 1,
                                  args.data_seed, cost, ceilings)
        elif name == "burst":
            rows += bench_burst(systems, ids, args.scale, args.repeats or 3, args.data_seed)
        elif name == "shared-prefix":
            from minisgl.server.bench_prefix import bench_shared_prefix

            pairs = [(s.name, s.llm if isinstance(s, MinisglSystem) else s) for s in systems
                     if s.name not in ("minisgl-overlap", "minisgl-fixed", "llama-cpp")]
            rows += bench_shared_prefix(pairs, ids, args.scale, args.repeats or 1, args.data_seed)
        elif name == "online":
            from minisgl.server.bench_serve import bench_online

            for s in systems:
                if s.name == "minisgl" and isinstance(s, MinisglSystem):
                    rows += bench_online(args, s, list(ids))
        else:
            rows += bench_latency(systems, ids, args.scale, args.repeats or 3, args.data_seed,
                                  cost, ceilings, torch.device(args.device), args.prefill_tokens,
                                  args.decode_context)
    return rows


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes each spinning on a core while the block runs (``--busy``)."""
    import subprocess

    if n < 0:
        raise ValueError(f"busy: must be >= 0 (got {n})")
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL) for _ in range(n)]
    if n:
        log(f"{n} busy processes beside the systems")
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    compare_list(args.compare)  # a bad peer or --sampling fails before anything loads
    if args.num_requests is None:  # requests of offline-mixed / online, paragraphs of speculative
        args.num_requests = 8 if args.workload == "speculative" else 64
    if sampling_spec(args.sampling):
        workloads = WORKLOADS if args.workload == "all" else (args.workload,)
        other = [w for w in workloads if w not in SAMPLED_WORKLOADS]
        if other:
            raise ValueError(f"sampling: {other[0]} runs greedy; --sampling applies to "
                             f"{', '.join(SAMPLED_WORKLOADS)}")
    if args.workload == "speculative":  # two engines, alternating (bench_spec.py)
        from minisgl.server.bench_spec import cmd_speculative

        return cmd_speculative(args)
    if args.workload == "quality":  # two engines one after the other (bench_quality.py)
        from minisgl.server.bench_quality import cmd_quality

        return cmd_quality(args)
    if args.workload == "tp":  # every configuration in its own process (bench_tp.py)
        from minisgl.server.bench_tp import bench_tp

        rows = bench_tp(args)
        print(format_table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"},
                           "results": [asdict(r) for r in rows]}, f, indent=2)
        return 0
    if args.threads:  # HF's and llama.cpp's threads too (minisgl's come from engine_kwargs)
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.data_seed)
    llm, systems = _load_systems(args)
    info = machine_info(llm.engine.dtype, llm.engine.device)
    for s in systems:
        if isinstance(s, LlamaCppSystem):
            info["llama_cpp_extra_buffers"] = s.extra_buffers
    log("measuring ceilings (matmul, memory read)")
    ceilings = measure_ceilings(llm.engine.dtype, llm.engine.device)
    if args.busy:
        info["busy_processes"] = args.busy
    print(machine_line(info, ceilings), flush=True)
    cost = ModelCost.from_config(llm.engine.model_config, llm.engine.dtype,
                                 llm.engine.config.quantization, llm.engine.config.kv_cache_dtype)
    mc = llm.engine.model_config
    ids = normal_token_ids(llm.tokenizer, mc.vocab_size, mc.eos_token_ids)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    rows: list[Row] = []
    # One system at a time, HF first, each minisgl LLM closed after its turn: a thread that has
    # run torch ops keeps its own OpenMP team, and while it exists every other torch thread in
    # the process runs small ops ~35% slower (2 cores). Interleaved, the overlap worker of
    # minisgl would slow the HF baseline down and inflate the ratios.
    with busy_processes(args.busy):
        for s in sorted(systems, key=lambda s: s.name != "hf"):
            log(f"warming up {s.name}")
            warmup(s, ids)
            rows += _run_workloads(args, workloads, [s], ids, cost, ceilings)
            if isinstance(s, MinisglSystem):
                s.llm.close()  # joins the forward worker thread
    order = {s.name: i for i, s in enumerate(systems)}
    rows.sort(key=lambda r: (workloads.index(r.workload) if r.workload in workloads else 0,
                             order.get(r.system, len(order))))
    add_speedups(rows)
    print(format_table(rows), flush=True)
    for line in [*peer_ratios(rows), *beside_lines(rows)]:
        print(line, flush=True)
    info["peak_rss_mib"] = peak_rss_mib()
    if args.plot:
        plot(rows, args.plot, machine_line(info, ceilings))
        log(f"wrote {args.plot}")
    print(f"peak resident memory of this process (all systems): {info['peak_rss_mib']:,.0f} MiB",
          flush=True)
    if args.json:
        report = {"machine": info, "ceilings": ceilings, "args": {k: v for k, v in vars(args).items()
                                                                  if k != "func"},
                  "results": [{**asdict(r), "fraction_of_ceiling": r.fraction_of_ceiling}
                              for r in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")
    return 0


def add_parser(sub: Any) -> None:
    from minisgl.server.cli import add_engine_args

    p: argparse.ArgumentParser = sub.add_parser(
        "bench", help="benchmarks (minisgl vs HF)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("workload", nargs="?",
                   choices=[*WORKLOADS, "all", "tp", "quality", "speculative"],
                   default="offline-mixed",
                   help="what to run (default offline-mixed); all = every workload but tp, "
                        "quality and speculative; tp = TP=1 vs TP=--tp memory and step time; "
                        "quality = int8 (weights, or the KV pool with --kv-cache-dtype int8) vs "
                        "unquantized perplexity and chat answers; speculative = answers about "
                        "real text with and without prompt-lookup drafts")
    p.add_argument("--compare", default="none", metavar="PEERS",
                   help="comma-separated peers: hf (transformers generate, same prompts and "
                        "dtype), llama-cpp (llama-cpp-python, the bundled Q4_1 GGUF, one request "
                        "at a time); default none")
    p.add_argument("--num-requests", type=int, default=None,
                   help="offline-mixed request count (default 64); speculative: paragraphs "
                        "(default 8)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every prompt/output length (e.g. 0.25 for a smoke run)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per system, median reported (default: offline-mixed 1, latency 3)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument("--vs-overlap", action="store_true",
                   help="also run minisgl with overlap scheduling forced on")
    p.add_argument("--sampling", default="greedy", metavar="SPEC",
                   help="greedy (default), or e.g. temperature=0.7,top_p=0.9 (also top_k=, "
                        "min_p=): every system samples so in latency, burst, offline-mixed, "
                        "online")
    p.add_argument("--vs-fixed-threads", action="store_true",
                   help="also run minisgl with --no-adapt-threads (all its threads always)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run every system beside N processes that each keep a core busy "
                        "(measured after the ceilings)")
    p.add_argument("--prefill-tokens", type=_positive, default=1024, metavar="N",
                   help="latency: the long prompt's length, prefilled once (default 1024)")
    p.add_argument("--decode-context", type=_positive, default=128, metavar="N",
                   help="latency: the prompt's length before the 128 decoded tokens (default "
                        "128); the decode's floor counts the K/V its steps read")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw the results as a PNG chart (needs matplotlib)")
    p.add_argument("--concurrency", default="1,8,32",
                   help="online: concurrent client counts (comma-separated)")
    p.add_argument("--url", default=None,
                   help="online: benchmark this running server instead of starting one")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="quality: the text whose perplexity is measured; speculative: the text "
                        "the questions are about (default: README.md docs/architecture.md of "
                        "the working directory)")
    p.set_defaults(func=cmd_bench)
