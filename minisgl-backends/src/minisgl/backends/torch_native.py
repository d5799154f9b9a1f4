"""Paged attention: a C++ kernel on x86 CPUs (AVX2 with FMA, or AVX512-BF16), plain PyTorch
elsewhere.

On such a CPU with a bf16 pool (``cpu_kernels``), prefill, extend and decode all run one
``paged_attention`` call per layer that reads each request's keys and values from the pool in
place through a [B, Lk] table of its slots, built once per step (measured in docs/benchmarks.md:
decode 3-7x faster than gathering, prefill 1.5-2.6x faster than PyTorch's CPU flash attention,
on an AVX512-BF16 CPU).

Without it (CUDA, float32, another CPU, no compiler, ``MINISGL_CPU_KERNELS=off``):
Decode (the step ``--compile`` compiles; see ``decode_dims``): every request's cached keys are
gathered into a padded [B, Lk] layout with index tensors built once per step (Lk rounded up to a
bucket), then two batched matmuls with a boolean mask; no data-dependent Python per layer.
Prefill/extend runs eager, one scaled_dot_product_attention per request: a request without a
cached prefix attends causally over its fresh K/V (no gather, no mask, so the kernel skips the
masked half), one with a prefix over its gathered prefix + fresh K/V with an explicit mask. That
is ~2x faster on CPU than one padded, masked call for a mixed batch (measured 45 vs 103 ms for 14
prompts in one layer).

Sliding windows (``windows``, per layer): the kernel skips the keys before each query's window;
the PyTorch path masks them, with one more mask per step and window size.

With the kernels, every step's Llama-family decoder layers run as one ``decoder_layers`` call
(``bind_decoder_layers``, registered with minisgl.core.layers, binds a model's layers to the
kernels once): per layer norms, linears, RoPE, the K/V store and this attention in C++ back to
back, where the layer's weights are in the bf16 or int8 kernel's layout and TP is 1 (Llama,
Mistral, Qwen2's biases, Qwen3's q/k norms); ``MINISGL_FUSED_LAYER=off`` keeps the modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.backends import cpu_kernels
from minisgl.core.attention import AttentionBackend, BatchLayout, ForwardContext
from minisgl.core.kvcache import KVPool
from minisgl.core.layers import DecoderLayerParts, register_fused_decoder_layers
from minisgl.core.layers.quant import QuantizableLinear

KV_BUCKET = 64  # decode: Lk is padded to a multiple of this


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class Segment:
    """One request of a prefill batch: ``q_len`` new tokens after ``prefix`` cached ones."""

    start: int  # first row of its tokens in the flattened batch
    q_len: int
    prefix: int
    prefix_slots: torch.Tensor | None  # [prefix] pool slots of the cached prefix
    mask: torch.Tensor | None  # [q_len, prefix + q_len], True where attention is allowed
    # the same within a sliding window, per window size
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class TorchNativeMeta:
    out_loc: torch.Tensor  # [T] slots the new K/V go to
    kv_slots: torch.Tensor | None = None  # decode: [B, Lk] pool slots (padding -> scratch 0)
    mask: torch.Tensor | None = None  # decode: [B, Lk] True for real keys
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # decode: ... in a window
    segments: list[Segment] = field(default_factory=list)  # prefill
    kernel: KernelArgs | None = None  # the CPU kernel's inputs (prefill and decode)


@dataclass
class KernelArgs:
    """``cpu_kernels.paged_attention``'s index inputs for one step."""

    slots: torch.Tensor  # [B, Lk] pool slots of each request (beyond its kv_len: unread)
    kv_lens: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B] first row of its queries in q
    q_lens: torch.Tensor  # [B]


class TorchNativeBackend(AttentionBackend):
    supports_sliding_window = True
    supports_int8_kv = True  # the kernels, or KVPool.read/write

    def __init__(self, kv: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, device: torch.device) -> None:
        super().__init__(kv, num_heads, num_kv_heads, head_dim, scale, device)
        # The first engine on a machine builds the kernels (~6 s); later ones load them. Loading
        # also registers the bf16 and int8 linear kernels with the core (cpu_kernels.load), for
        # any head shape: the engine converts the weights after building the backend.
        dtype = kv.dtype
        if device.type == "cpu" and dtype == torch.bfloat16:
            cpu_kernels.load()
        self.uses_cpu_kernel = device.type == "cpu" and cpu_kernels.supports(
            dtype, num_heads, num_kv_heads, head_dim, kv.quantized)
        # the decoder layers as one call (bind_decoder_layers, for this backend's steps)
        self.fused_layers = self.uses_cpu_kernel and cpu_kernels.fused_layer_enabled()
        # PyTorch's path: on a CPU without bf16 instructions (AVX2), PyTorch's bf16 matmuls are
        # slow (a bmm of SmolLM2's batch-1 decode attention took ~90 us, 60 of them 4.6 ms of a
        # 29 ms step on 2 Zen 3 cores), so there the decode attention runs in float32
        self.decode_f32 = (device.type == "cpu" and dtype == torch.bfloat16
                           and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if self.fused_layers:
            register_fused_decoder_layers(bind_decoder_layers)
        # the engine's thread count (set before it builds the backend): the kernel splits few
        # decode requests' keys for it, also in the steps its thread tuner runs on fewer
        # threads, so that those give the same numbers (cpu_kernels.paged_attention)
        self.threads = torch.get_num_threads()

    def prepare(self, layout: BatchLayout) -> TorchNativeMeta:
        if self.uses_cpu_kernel:
            return self._prepare_kernel(layout)
        dev = self.device
        table = layout.req_to_token
        sizes = sorted({w for w in self.windows if w > 0})
        if layout.phase == "decode":
            kv_lens = torch.tensor(layout.kv_lens, dtype=torch.int64, device=table.device)
            lk = min(_round_up(max(layout.kv_lens), KV_BUCKET), table.shape[1])
            rows = torch.tensor(layout.rows, dtype=torch.int64, device=table.device)
            keys = torch.arange(lk, device=table.device)[None, :]
            valid = keys < kv_lens[:, None]
            kv_slots = torch.where(valid, table[rows, :lk], 0)
            windowed = {w: (valid & (keys >= kv_lens[:, None] - w)).to(dev) for w in sizes}
            return TorchNativeMeta(layout.out_loc.to(dev), kv_slots.to(dev), valid.to(dev),
                                   windowed)
        segments, start = [], 0
        for n, kv_len, row in zip(layout.q_lens, layout.kv_lens, layout.rows):
            prefix = kv_len - n
            slots = mask = None
            windowed: dict[int, torch.Tensor] = {}
            if prefix or sizes:
                q_pos, k_pos = torch.arange(prefix, kv_len)[:, None], torch.arange(kv_len)[None, :]
                causal = k_pos <= q_pos
                windowed = {w: (causal & (k_pos > q_pos - w)).to(dev) for w in sizes}
                if prefix:
                    slots, mask = table[row, :prefix].to(dev), causal.to(dev)
            segments.append(Segment(start, n, prefix, slots, mask, windowed))
            start += n
        return TorchNativeMeta(layout.out_loc.to(dev), segments=segments)

    def _prepare_kernel(self, layout: BatchLayout) -> TorchNativeMeta:
        table = layout.req_to_token
        lk = max(layout.kv_lens)
        if layout.phase == "decode":  # Lk bucketed: fewer distinct shapes for compiled decode
            lk = min(_round_up(lk, KV_BUCKET), table.shape[1])
        q_start = [0, *itertools.accumulate(layout.q_lens)][:-1]  # (small lists: no torch ops)
        # through numpy: a torch op each costs ~10-40 us right after a decode step's weights
        lens = np.array([layout.kv_lens, q_start, layout.q_lens], dtype=np.int64)
        if table.device.type == "cpu":
            slots = torch.from_numpy(table.numpy()[layout.rows, :lk])
        else:
            slots = table[torch.tensor(layout.rows, device=table.device), :lk].contiguous()
        args = KernelArgs(slots, *(torch.from_numpy(a) for a in lens))
        return TorchNativeMeta(layout.out_loc, kernel=args)

    @staticmethod
    def _kernel_dims(meta: TorchNativeMeta, new_tokens: str) -> list[tuple[torch.Tensor, int, str]]:
        """The kernel path's dims; ``new_tokens``: the kind of out_loc's ("batch" in decode)."""
        a = meta.kernel
        assert a is not None
        return [(meta.out_loc, 0, new_tokens), (a.slots, 0, "batch"), (a.slots, 1, "kv"),
                (a.kv_lens, 0, "batch"), (a.q_start, 0, "batch"), (a.q_lens, 0, "batch")]

    def decode_dims(self, meta: TorchNativeMeta) -> list[tuple[torch.Tensor, int, str]] | None:
        if meta.kernel is not None:
            return self._kernel_dims(meta, "batch")
        assert meta.kv_slots is not None and meta.mask is not None
        masks = [meta.mask, *meta.window_masks.values()]
        return [(meta.out_loc, 0, "batch"), (meta.kv_slots, 0, "batch"), (meta.kv_slots, 1, "kv"),
                *[(m, d, kind) for m in masks for d, kind in ((0, "batch"), (1, "kv"))]]

    def prefill_dims(self, meta: TorchNativeMeta) -> list[tuple[torch.Tensor, int, str]] | None:
        if meta.kernel is None:  # the PyTorch path loops over requests in Python
            return None
        return self._kernel_dims(meta, "tokens")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: TorchNativeMeta) -> torch.Tensor:
        self.kv.write(layer, meta.out_loc, k, v)
        if meta.kernel is not None:
            a = meta.kernel
            qh = q.reshape(q.shape[0], self.num_heads, self.head_dim).to(self.kv.dtype).contiguous()
            out = cpu_kernels.paged_attention(qh, self.kv.k[layer], self.kv.v[layer], a.slots,
                                              a.kv_lens, a.q_start, a.q_lens, self.scale,
                                              self.windows[layer], self.threads)
            return out.view(q.shape[0], -1).to(q.dtype)
        window = self.windows[layer]
        if meta.kv_slots is not None and meta.mask is not None:
            kp, vp = self.kv.read(layer, meta.kv_slots)  # [KVH, B, Lk, D], contiguous
            return self._decode(q, kp, vp, meta.window_masks[window] if window else meta.mask)
        outs = []
        gqa = self.num_heads != self.num_kv_heads
        dtype = self.kv.dtype
        for seg in meta.segments:
            end = seg.start + seg.q_len
            if self.kv.quantized:  # as the pool holds them (and later steps will read them)
                ki, vi = self.kv.read(layer, meta.out_loc[seg.start:end])
            else:
                ki, vi = k[seg.start:end].transpose(0, 1), v[seg.start:end].transpose(0, 1)
                ki, vi = ki.to(dtype), vi.to(dtype)  # [KVH, n, D], exactly what the pool holds
            if seg.prefix_slots is not None:
                pk, pv = self.kv.read(layer, seg.prefix_slots)
                ki, vi = torch.cat([pk, ki], dim=1), torch.cat([pv, vi], dim=1)
            mask = seg.window_masks[window] if window else seg.mask
            out = F.scaled_dot_product_attention(
                q[seg.start:end].transpose(0, 1)[None], ki[None], vi[None], attn_mask=mask,
                is_causal=mask is None, scale=self.scale, enable_gqa=gqa)
            outs.append(out[0].transpose(0, 1).reshape(seg.q_len, -1))
        return torch.cat(outs)

    def _decode(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        # Two batched matmuls with the query heads of each KV head grouped together: on CPU this
        # is ~20x faster than bf16 scaled_dot_product_attention for a single query (measured:
        # 0.37 vs 7 ms for 16 requests x 576 keys), and KV heads are never repeated in memory.
        b, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        qg = q.view(b, kvh, self.num_heads // kvh, d).transpose(0, 1)  # [KVH, B, G, D]
        if self.decode_f32:
            qg, kp, vp = qg.float(), kp.float(), vp.float()
        scores = torch.matmul(qg, kp.transpose(-1, -2)).float() * self.scale  # [KVH, B, G, Lk]
        scores = scores.masked_fill(~mask.view(1, b, 1, -1), float("-inf"))  # mask: [B, Lk]
        out = torch.matmul(scores.softmax(-1).to(vp.dtype), vp)  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(b, self.num_heads * d).to(q.dtype)


def _kernel_weights(linears: tuple[QuantizableLinear, ...]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The layers' weights and int8 scales (none for bf16) as ``decoder_layer`` takes them, or
    None where a layer is in another format or mixed with the others."""
    ops = torch.ops.minisgl_cpu
    if all(m.packed is not None and m.packed_linear is ops.bf16_linear.default for m in linears):
        return [m.packed for m in linears if m.packed is not None], []
    if all(m.qweight is not None and m.qscale is not None
           and m.qlinear is ops.int8_linear.default for m in linears):
        return ([m.qweight for m in linears if m.qweight is not None],
                [m.qscale for m in linears if m.qscale is not None])
    return None


def _fusable(p: DecoderLayerParts, first: DecoderLayerParts) -> bool:
    """Whether ``decoder_layer`` computes what layer ``p``'s modules would, in a run with
    ``first`` (the kernel takes one eps, head count and set of optional tensors for the run)."""
    norms = [n for n in (p.in_norm, p.post_norm, p.q_norm, p.k_norm) if n is not None]
    biases = [b for b in (p.qkv.bias, p.o.bias) if b is not None]
    return ((p.q_norm is None) == (p.k_norm is None) == (first.q_norm is None)
            and (p.qkv.bias is None) == (first.qkv.bias is None)
            and (p.o.bias is None) == (first.o.bias is None)
            and all(n.eps == first.in_norm.eps and n.weight.dtype == torch.bfloat16
                    for n in norms)
            and all(b.dtype == torch.bfloat16 for b in biases)
            and p.gate_up.bias is None and p.down.bias is None
            and p.o.comm.world_size == 1 and p.down.comm.world_size == 1
            and (p.qkv.num_heads, p.qkv.num_kv_heads)
            == (first.qkv.num_heads, first.qkv.num_kv_heads))


class FusedLayerRun:
    """The layers as one ``cpu_kernels.decoder_layers`` call in this backend's steps (their
    weights, norms and pools bound once: ``run``)."""

    def __init__(self, backend: TorchNativeBackend, run: cpu_kernels.LayerRun) -> None:
        self.backend, self.run = backend, run

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None,
                 cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = ctx.meta
        if not (ctx.backend is self.backend and isinstance(meta, TorchNativeMeta)
                and meta.kernel is not None and x.dtype == torch.bfloat16):
            return None
        cos, sin = cos_sin  # [T, 1, head_dim] as they are (no reshape op: the kernel takes them)
        a = meta.kernel
        return cpu_kernels.decoder_layers(self.run, x, residual, cos, sin, meta.out_loc, a.slots,
                                          a.kv_lens, a.q_start, a.q_lens, ctx.out_rows)


def bind_decoder_layers(layers: Sequence[DecoderLayerParts], backend: AttentionBackend
                        ) -> FusedLayerRun | None:
    """The layers bound to ``cpu_kernels`` for one call per step with ``backend``, or None (run
    the modules) where that call would not compute what they do."""
    if not (isinstance(backend, TorchNativeBackend) and backend.fused_layers and layers):
        return None
    first = layers[0]
    weights: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    for p in layers:
        packed = _kernel_weights((p.qkv, p.o, p.gate_up, p.down))
        if packed is None or not _fusable(p, first):
            return None
        weights += packed[0]
        scales += packed[1]
        norms += [p.in_norm.weight, p.post_norm.weight]
    if 0 < len(scales) < len(weights):  # bf16 and int8 layers in one model
        return None
    qkv_biases = [p.qkv.bias for p in layers if p.qkv.bias is not None]
    o_biases = [p.o.bias for p in layers if p.o.bias is not None]
    qk_norms = [n.weight for p in layers for n in (p.q_norm, p.k_norm) if n is not None]
    ids, kv = [p.layer_id for p in layers], backend.kv
    run = cpu_kernels.LayerRun(
        norms, weights, scales, qkv_biases, o_biases, qk_norms, [kv.k[i] for i in ids],
        [kv.v[i] for i in ids], [backend.windows[i] for i in ids], backend.scale,
        first.in_norm.eps, first.qkv.num_heads, first.qkv.num_kv_heads, backend.threads)
    return FusedLayerRun(backend, run)
