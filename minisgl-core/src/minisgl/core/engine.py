"""One rank's model runner: loads the model, owns the KV pool, runs a batch, samples."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minisgl.core.attention import AttentionBackend, BatchLayout, ForwardContext
from minisgl.core.compile import DUMMY_KV_LEN, DynamicDims, StepGraphs, resolve_mode
from minisgl.core.config import EngineConfig, ModelConfig, resolve_dtype
from minisgl.core.distributed import Communicator, bind
from minisgl.core.kvcache import KVPool, PageAllocator, ReqToTokenTable, check_pool_fits
from minisgl.core.layers.quant import int8_rows_limit, prepack_model, quantize_model_int8
from minisgl.core.model import CausalLM
from minisgl.core.plugins import PluginManager, get_plugin_manager
from minisgl.core.request import Batch, Req
from minisgl.core.sampling import SampleOutput, Sampler
from minisgl.core.threads import ThreadTuner
from minisgl.core.weights import iter_weights

log = logging.getLogger("minisgl.engine")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)


def keep_freed_memory() -> bool:
    """On glibc: allocations under 32 MiB from the heap, and up to 512 MiB of freed heap kept for
    the next ones (``mallopt``), so that a CPU step's tensors of a few MB reuse memory instead
    of taking fresh pages from the kernel. With glibc's defaults the heap's top went back to the
    kernel whenever a few MB were free there, and the next step faulted it in again, page by page:
    a 4,096-token SmolLM2 prefill took 4,600-56,000 page faults (8-160 ms of kernel time in
    1.1-1.25 s; alternating runs 1.08-1.25 s), with these settings 0-18 (1.07-1.11 s).
    Process-wide; the cost is that up to 512 MiB of freed memory stays with the process. True
    where it applied; ``MINISGL_MALLOC_TUNING=off`` leaves malloc as it is."""
    if os.environ.get("MINISGL_MALLOC_TUNING", "on").lower() in ("0", "off", "false", "no"):
        return False
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # this process's libc
    # (the mmap threshold first: setting either one ends glibc's adjusting of both)
    return (bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20))
            and bool(mallopt(_M_TRIM_THRESHOLD, 512 << 20)))


def return_free_memory() -> bool:
    """glibc's ``malloc_trim(0)``: the heap memory freed so far back to the kernel. Loading frees
    the checkpoint's tensors as their packed copies are made, and with ``keep_freed_memory``'s
    512 MiB trim threshold that memory would stay with the process for good: after loading,
    SmolLM2 762 -> 631 MiB of anonymous memory, a Qwen3-0.6B-shaped model 2,556 -> 1,730. The
    engine calls it once, when it is built. True where it ran."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL(None).malloc_trim(0)  # (1 where it gave memory back, else 0)
    return True


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [T]; negative ids are placeholders: -1 - (future-buffer slot)
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    logits_indices: torch.Tensor  # [N] rows of the hidden states whose logits are sampled
    meta: Any = None  # the backend's metadata, built on the scheduler thread (overlap)
    placeholders: bool = True  # input_ids may hold placeholders (False: prepare saw none)


class Engine:
    """Model + KV pool + attention backend + sampler of one rank. The batch is always an argument."""

    def __init__(self, config: EngineConfig, comm: Communicator | None = None,
                 plugins: PluginManager | None = None) -> None:
        self.config = config
        self.comm = comm or Communicator(config.tp_rank, config.tp_size)
        self.plugins = pm = plugins or get_plugin_manager()
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        self.device = config.torch_device
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = resolve_dtype(config.dtype, self.device, mc.hf_dtype)
        model_cls = pm.models.get(mc.architecture)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model: CausalLM = model_cls(mc, self.comm)
        self.model.load_weights(iter_weights(mc.path))
        self.model.eval()

        backend_cls = pm.attention_backends.get(config.attention_backend)
        if config.kv_cache_dtype == "int8" and not backend_cls.supports_int8_kv:
            raise ValueError(f"kv_cache_dtype: attention backend {config.attention_backend!r} "
                             "does not read an int8 KV pool (supports_int8_kv)")
        limit = mc.max_position_embeddings
        window = mc.sliding_window or limit
        windowed = window < limit
        if windowed and not backend_cls.supports_sliding_window:
            # within the window, windowed attention equals the full attention the backend has
            limit = window
            log.warning("%s attends to a sliding window of %d tokens and attention backend %r "
                        "has none: contexts are capped at %d tokens", mc.architecture, limit,
                        config.attention_backend, limit)
        self.max_model_len = min(config.max_model_len or limit, limit)
        page = config.page_size
        tp = self.comm.world_size
        kv_heads = mc.num_kv_heads // tp if mc.num_kv_heads >= tp else 1
        kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else None
        per_page = KVPool.bytes_per_page(mc, page, kv_heads, self.dtype, kv_dtype)
        num_pages = config.num_pages or max(2, config.kv_cache_memory // per_page)
        if self.device.type == "cpu":
            check_pool_fits(num_pages * per_page,
                            "num_pages" if config.num_pages else "kv_cache_memory")
        self.kv = KVPool(mc.num_layers, num_pages, page, kv_heads, mc.head_dim, self.dtype,
                         self.device, kv_dtype)
        self.allocator = PageAllocator(num_pages)
        self.table = ReqToTokenTable(config.max_running_requests,
                                     -(-self.max_model_len // page) * page, self.device)
        self.backend: AttentionBackend = backend_cls(
            self.kv, mc.num_heads // tp, kv_heads, mc.head_dim, mc.head_dim ** -0.5, self.device)
        if windowed and backend_cls.supports_sliding_window:
            self.backend.windows = mc.layer_windows()
        # after the backend, which may register kernels for the linear layers (quant.py)
        if config.quantization == "int8":
            quantize_model_int8(self.model)
        else:
            prepack_model(self.model)  # bf16 on CPU: a kernel's blocked layout (no-op elsewhere)
        self.model.bind(self.backend)
        sampler_cls = pm.samplers.get(config.sampler)
        self.sampler: Sampler = sampler_cls(mc.vocab_size, self.device)
        # Sampled tokens land here too, so a step launched before the previous one finished
        # (overlap scheduling) can read its input tokens by slot. Slots are reused round-robin.
        self.future = torch.zeros(4 * config.max_running_requests + 8, dtype=torch.int64,
                                  device=self.device)
        # on CPU, the same memory as a numpy array: a step's tokens are written through it
        # (18-29 vs 46-64 us per batch-1 step for torch's index_put with a fresh index tensor)
        self._future_np = self.future.numpy() if self.device.type == "cpu" else None
        self._next_future = 0
        self.graphs: StepGraphs | None = None
        # sampled rows a compiled prefill graph covers (None: any); more run eager
        self.prefill_graph_rows: int | None = None
        self.compile_mode = resolve_mode(config.compile, self.device,
                                         self.model.layers_in_one_call)
        if self.compile_mode != "off":
            dims: dict[str, Callable[..., DynamicDims]] = {"decode": self._decode_dims}
            dummy: dict[str, Callable[[int], tuple[Any, ...]]] = {"decode": self._dummy_decode}
            if self.backend.prefill_dims(self._dummy_prefill(2)[2]) is not None:
                dims["prefill"], dummy["prefill"] = self._prefill_dims, self._dummy_prefill
            if config.quantization == "int8" and "prefill" in dims:
                self.prefill_graph_rows = int8_rows_limit(self.model)
            self.graphs = StepGraphs(self._forward, dims, dummy, config.max_running_requests,
                                     self._worker_config(), self.prefill_graph_rows, self.comm)
            self.graphs.start(wait=self.compile_mode == "wait")
        # fewer threads while other processes keep the cores busy (TP ranks split the cores)
        self.thread_tuner = ThreadTuner.for_this_process(torch.get_num_threads()) \
            if self.device.type == "cpu" and config.tp_size == 1 and config.adapt_threads \
            else None
        if self.device.type == "cpu":
            return_free_memory()  # what loading (and compiling, with "wait") freed

    def _worker_config(self) -> dict[str, Any]:
        """This engine's config as JSON-able fields, for the compile worker process."""
        cfg = dataclasses.asdict(self.config)
        if isinstance(cfg["dtype"], torch.dtype):
            cfg["dtype"] = str(cfg["dtype"]).removeprefix("torch.")
        return cfg

    def _zeros(self, *shape: int) -> torch.Tensor:  # a fresh tensor each: no aliased arguments
        return torch.zeros(shape, dtype=torch.int64, device=self.device)

    def _dummy_decode(self, batch_size: int) -> tuple[Any, ...]:
        """Arguments of ``_forward`` for a decode step that reads and writes only slot 0 (the
        scratch page): compiles a graph while real requests run eager."""
        zeros = self._zeros
        layout = BatchLayout("decode", [1] * batch_size, [DUMMY_KV_LEN] * batch_size,
                             [0] * batch_size, zeros(1, DUMMY_KV_LEN), zeros(batch_size))
        return (zeros(batch_size), zeros(batch_size), self.backend.prepare(layout),
                torch.arange(batch_size, device=self.device))

    def _dummy_prefill(self, num_reqs: int) -> tuple[Any, ...]:
        """Like ``_dummy_decode`` for a prefill/extend step: request i has 59 + 2i new tokens after
        3 + 3i cached ones, so that tokens, requests and keys all differ (one symbol each). Inductor
        sizes its loops by these: at 5 tokens a request it ran a prefill's K RoPE and KV-pool
        stores (per token: 3 heads x 64 dims, below its 512 elements per thread) on one thread
        while the other waited, whatever the prefill's length."""
        zeros = self._zeros
        q_lens = [59 + 2 * i for i in range(num_reqs)]
        kv_lens = [n + 3 + 3 * i for i, n in enumerate(q_lens)]
        n = sum(q_lens)
        layout = BatchLayout("prefill", q_lens, kv_lens, [0] * num_reqs, zeros(1, max(kv_lens)),
                             zeros(n))
        ends = torch.cumsum(torch.tensor(q_lens), 0) - 1
        if num_reqs > 2:  # the last request unsampled (a chunk), so rows differ from requests
            ends = ends[:-1]
        return (zeros(n), zeros(n), self.backend.prepare(layout), ends.to(self.device))

    def _prefill_dims(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                      logits_indices: torch.Tensor) -> DynamicDims:
        dims = self.backend.prefill_dims(meta)
        assert dims is not None
        return [(ids, 0, "tokens"), (positions, 0, "tokens"), (logits_indices, 0, "rows"), *dims,
                *self._pool_dims()]

    def _pool_dims(self) -> DynamicDims:
        return [(t, 1, "pool") for t in self.kv.k + self.kv.v]  # [kv_heads, slots, head_dim]

    def _decode_dims(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                     logits_indices: torch.Tensor) -> DynamicDims:
        dims = self.backend.decode_dims(meta)
        if dims is None:
            raise NotImplementedError(f"attention backend {self.config.attention_backend!r} "
                                      "has no compilable decode (decode_dims)")
        return [(ids, 0, "batch"), (positions, 0, "batch"), (logits_indices, 0, "batch"), *dims,
                *self._pool_dims()]

    def prepare(self, batch: Batch) -> ForwardInputs:
        """Flatten the batch (no padding) and build the attention layout for it. The index
        lists are built in Python and become one tensor each (on CPU through numpy, with no
        torch op): a decode step runs right after the weights have flushed the caches, where
        every small torch op costs ~10-40 us."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        kv_lens: list[int] = []
        row_of_token: list[int] = []
        logits_indices: list[int] = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start, draft = req.num_computed, batch.drafts[i] if batch.drafts else []
            ids.extend(req.token_slice(start, start + n - len(draft)))
            ids.extend(draft)
            positions.extend(range(start, start + n))
            row_of_token.extend([req.table_row] * n)
            rows.append(req.table_row)
            kv_lens.append(start + n)
            # the request's last new token, or its last batch.rows(i) tokens (a draft's)
            logits_indices.extend(range(len(ids) - batch.rows(i), len(ids)))
        cpu = self.device.type == "cpu"  # through numpy there: no torch op (~10-40 us, cold)

        def ints(values: list[int]) -> torch.Tensor:
            return (torch.from_numpy(np.array(values, dtype=np.int64)) if cpu
                    else torch.tensor(values, dtype=torch.int64, device=self.device))

        pos, table = ints(positions), self.table.table
        out_loc = (torch.from_numpy(table.numpy()[row_of_token, pos.numpy()]) if cpu
                   else table[ints(row_of_token), pos])
        layout = BatchLayout(batch.phase, list(batch.extend_lens), kv_lens, rows, table, out_loc)
        return ForwardInputs(ints(ids), pos, layout, ints(logits_indices),
                             self.backend.prepare(layout), placeholders=min(ids, default=0) < 0)

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """Float32 logits [N, vocab] for the sampled rows of the batch."""
        meta = inputs.meta if inputs.meta is not None else self.backend.prepare(inputs.layout)
        args = (inputs.input_ids, inputs.positions, meta, inputs.logits_indices)
        # Eager steps bind the group too: while another thread compiles a graph,
        # torch.compiler.is_compiling() reads True in the whole process, and this step's
        # collectives then take the graph path (distributed.py), which runs on the bound group.
        with bind(self.comm):
            if self.graphs is not None:
                out = self._run_graph(inputs.layout, args)
                if out is not None:
                    return out
            return self._forward(*args, resolve=inputs.placeholders,
                                 pick=self.comm.world_size == 1)

    def _run_graph(self, layout: BatchLayout, args: tuple[Any, ...]) -> torch.Tensor | None:
        assert self.graphs is not None
        ids, logits_indices = args[0], args[3]
        n, reqs, rows = ids.shape[0], len(layout.q_lens), logits_indices.shape[0]
        if layout.phase == "decode":
            return self.graphs.run("decode", args, reqs) if rows == reqs else None
        if reqs == 1:
            return self.graphs.run("prefill", args, 1) if rows == 1 and n >= 2 else None
        if rows > reqs:  # prompt_logprobs
            return None
        # Sampled rows (a chunk's unfinished last request has none) are a symbolic dim >= 2:
        # fewer are padded with the last token's row and dropped again.
        padded = torch.cat([logits_indices, logits_indices.new_full((2 - rows,), n - 1)]) \
            if rows < 2 else logits_indices
        out = self.graphs.run("prefill", (*args[:3], padded), reqs)
        return None if out is None else out[:rows]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                 logits_indices: torch.Tensor, resolve: bool = True, pick: bool = False
                 ) -> torch.Tensor:
        """The forward itself (what ``graphs`` compile, ``resolve`` left True). An eager step
        skips the torch ops it can tell it does not need: the placeholders' lookup where
        ``prepare`` saw none (``resolve`` False), the gather of the sampled rows where they are
        every row, in order (a decode step's; ``prepare`` lists each request's rows in order).
        Right after the weights' stream each small op costs ~10-40 us (its code and data back
        from DRAM): these were 6 of the ~30 outside the kernels in a batch-1 decode step.
        ``pick`` (an eager step of a single rank): where the sampled rows are not every row, name
        them to the model (ForwardContext.out_rows), whose last layer then runs attention, O
        and the MLP for them alone. Not at TP > 1: a rank on a compiled graph runs every row,
        and its collectives would not match another rank's eager ones."""
        if resolve:
            ids = torch.where(ids >= 0, ids, self.future[(-1 - ids).clamp(min=0)])
        rows = logits_indices if pick and logits_indices.shape[0] != ids.shape[0] else None
        hidden = self.model(ids, positions, ForwardContext(self.backend, meta, rows))
        # (rows named: the model returned them, or every row where it does not pick)
        if (rows is None and torch.compiler.is_compiling()) \
                or logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden[logits_indices]
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def prompt_logprobs(self, req: Req) -> torch.Tensor:
        """[n - 1] float32 log-probs of ``req.prompt_ids[1:]``, each given the tokens before it
        (teacher forcing, for perplexity). ``req`` holds a table row and pages for its whole
        prompt, nothing of it computed yet."""
        n = len(req.prompt_ids)
        inputs = self.prepare(Batch("prefill", [req], [n], [True]))
        inputs.logits_indices = torch.arange(n - 1, device=self.device)
        logp = torch.log_softmax(self.forward(inputs), dim=-1)
        target = torch.tensor(req.prompt_ids[1:], device=self.device)
        return logp.gather(1, target[:, None]).squeeze(1).cpu()

    def take_future_slots(self, n: int) -> list[int]:
        """``n`` slots of the future buffer; at most two steps are in flight, so the ring (4x the
        largest batch) never hands out a slot whose token is still unread."""
        size = self.future.numel()
        slots = [(self._next_future + i) % size for i in range(n)]
        self._next_future = (self._next_future + n) % size
        return slots

    def resolve(self, placeholder: int) -> int:
        return int(self.future[-1 - placeholder])

    @torch.inference_mode()
    def run(self, inputs: ForwardInputs, sample_reqs: list[Req], future_slots: list[int]
            ) -> SampleOutput | None:
        """Forward + sample; the tokens also go to ``future_slots`` of the future buffer.

        May run on a worker thread: it touches no scheduler state, only its arguments.
        """
        tuner = self.thread_tuner
        if tuner is None:
            return self._run(inputs, sample_reqs, future_slots)
        # OpenMP's thread count is the calling thread's: set on the thread that runs the step,
        # and put back after it (the caller's torch ops between steps get what they had)
        rows = inputs.input_ids.shape[0]
        kind = (inputs.layout.phase == "decode", rows.bit_length())
        threads, before = tuner.begin(kind, rows), torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self._run(inputs, sample_reqs, future_slots)
        finally:
            torch.set_num_threads(before)
            tuner.end()

    def _run(self, inputs: ForwardInputs, sample_reqs: list[Req], future_slots: list[int]
             ) -> SampleOutput | None:
        logits = self.forward(inputs)
        if logits.shape[0] == 0:
            return None
        if self.comm.rank == 0:
            views = [r.sampling_view(self.resolve) if r.params.has_penalties else r
                     for r in sample_reqs]
            out = self.sampler.sample(logits, views)
        if self.comm.world_size > 1:  # rank 0 samples; every rank gets the same tokens
            out = self._broadcast_sample(out if self.comm.rank == 0 else None, sample_reqs)
        if self._future_np is not None:
            self._future_np[future_slots] = out.tokens.numpy()
        else:
            self.future[torch.tensor(future_slots, device=self.device)] = out.tokens.to(self.device)
        return out

    def _broadcast_sample(self, out: SampleOutput | None, reqs: list[Req]) -> SampleOutput:
        """Rank 0's SampleOutput on every rank, packed in one float64 tensor [B, 2 + 2K]
        (token ids are exact in float64)."""
        k = min(max(r.params.top_logprobs for r in reqs), self.model_config.vocab_size)
        packed = torch.empty(len(reqs), 2 + 2 * k, dtype=torch.float64)
        if out is not None:
            packed[:, 0], packed[:, 1] = out.tokens, out.logprobs
            if k:
                assert out.top_ids is not None and out.top_logprobs is not None
                packed[:, 2: 2 + k], packed[:, 2 + k:] = out.top_ids, out.top_logprobs
        packed = self.comm.broadcast(packed.to(self.device), src=0).cpu()
        res = SampleOutput(packed[:, 0].long(), packed[:, 1].float())
        if k:
            res.top_ids, res.top_logprobs = packed[:, 2: 2 + k].long(), packed[:, 2 + k:].float()
        return res
