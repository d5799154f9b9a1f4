"""Token sampling: penalties, temperature, top-k / top-p / min-p filtering and seeded draws.

Per-request parameters differ within a batch, so every step works on [B] parameter tensors.
Randomness is drawn per row from the request's own generator, which makes a seeded request
reproducible whatever else shares its batch.
"""

from __future__ import annotations

import abc
import array
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minisgl.core.request import Req


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64 on CPU, the chosen token per row
    # [B] float32 on CPU: log-prob of the chosen token under log_softmax(raw logits), i.e. before
    # penalties and temperature (what vLLM reports by default)
    logprobs: torch.Tensor
    # [B, K] on CPU, K = the largest top_logprobs asked for in the batch (None when 0): the most
    # likely token ids per row and their log-probs, from the same distribution as ``logprobs``
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler(abc.ABC):
    """Interface for sampler plugins (registered by name via the minisgl_register_samplers hook)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @abc.abstractmethod
    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleOutput:
        """logits: [B, V] (any float dtype; work in float32) for the last position of each req,
        row i belongs to reqs[i]."""


# -- penalties ---------------------------------------------------------------------------------


def token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """[B, V] float32 occurrence counts of each id list (the penalties use ``_flat_ids``, the
    seen entries alone)."""
    counts = torch.zeros(len(id_lists), vocab_size, dtype=torch.float32, device=device)
    flat, n = _flat_ids(id_lists, vocab_size, counts.device)
    counts.view(-1)[flat] = n.float()
    return counts


def _row_param(reqs: Sequence[Req], name: str, device: torch.device) -> torch.Tensor:
    """[B, 1] float32 column of one SamplingParams field, ready to broadcast over V."""
    vals = [float(getattr(r.params, name)) for r in reqs]
    return torch.tensor(vals, dtype=torch.float32, device=device).unsqueeze(1)


def _flat_ids(id_lists: Sequence[Sequence[int]], vocab_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, id) pairs of the lists as indices into a flattened [B, V] view, and
    how often each occurs."""
    lens = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    # through array('q'): torch.tensor of a list of ints took ~60 ns per id (32 rows x 2,000 ids
    # 3.8 ms)
    ids = torch.frombuffer(array.array("q", itertools.chain.from_iterable(id_lists)),
                           dtype=torch.int64) if int(lens.sum()) else torch.zeros(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lens)
    flat, counts = torch.unique(rows * vocab_size + ids, return_counts=True)
    return flat.to(device), counts.to(device)


def _penalise_(out: torch.Tensor, reqs: Sequence[Req]) -> None:
    """Apply all penalties, in place, to rows that all have some (float32 [b, V], contiguous).

    Only the entries of tokens a row has seen change, so only those are computed (gathered,
    penalised, written back): a 32-row batch's dense [b, V] passes took 15-20 ms a step."""
    vocab, dev = out.shape[1], out.device
    flat_out = out.view(-1)
    if any(r.params.repetition_penalty != 1.0 for r in reqs):
        # HF/CTRL: divide positive logits, multiply negative ones, so the token always loses mass
        flat, _ = _flat_ids([r.all_ids for r in reqs], vocab, dev)
        rep = _row_param(reqs, "repetition_penalty", dev).squeeze(1)[flat // vocab]
        x = flat_out[flat]
        flat_out[flat] = torch.where(x > 0, x / rep, x * rep)
    if any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in reqs):
        # OpenAI: additive, over generated tokens only
        flat, counts = _flat_ids([r.output_ids for r in reqs], vocab, dev)
        row = flat // vocab
        freq = _row_param(reqs, "frequency_penalty", dev).squeeze(1)[row]
        pres = _row_param(reqs, "presence_penalty", dev).squeeze(1)[row]
        flat_out[flat] = flat_out[flat] - freq * counts.float() - pres


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """Penalised float32 copy of logits [B, V]; the input is left untouched.

    repetition_penalty over prompt_ids + output_ids, frequency/presence_penalty over output_ids.
    Only the rows of requests that have penalties are computed.
    """
    out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if len(rows) == len(reqs):
        _penalise_(out, reqs)
    elif rows:
        idx = torch.tensor(rows, dtype=torch.int64, device=out.device)
        part = out[idx]  # a copy
        _penalise_(part, [reqs[i] for i in rows])
        out[idx] = part
    return out


# -- filtering and drawing ---------------------------------------------------------------------


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens that top-k, then top-p, then min-p drop, and renormalise the rest.

    probs [B, V]; top_k [B] int (-1 disables), top_p [B] float (1 disables), min_p [B] float
    (0 disables). Each filter sees the distribution the previous one left (top-p mass is
    measured on the renormalised top-k set, as vLLM does). The most likely token is always kept.
    """
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where(top_k > 0, top_k, vocab).to(probs.device)
    keep = rank < k.unsqueeze(1)
    sorted_p = sorted_p * keep
    # float64 cumsum: the top-p boundary should not move with float32 rounding over a big vocab
    sorted_64 = sorted_p.double()
    cum = sorted_64.cumsum(-1)
    before = (cum - sorted_64) / cum[:, -1:]  # kept mass strictly above each token
    p = top_p.to(probs.device, torch.float64).unsqueeze(1)
    keep &= (before < p) | (p >= 1.0)  # keep while the mass above this token is short of top_p
    keep &= sorted_p >= min_p.to(probs.device, torch.float32).unsqueeze(1) * sorted_p[:, :1]
    mask = torch.zeros_like(keep).scatter_(-1, order, keep)
    out = torch.where(mask, probs, torch.zeros_like(probs))
    return out / out.sum(dim=-1, keepdim=True)


# The draw. A row's randomness for one step is one key from its request's generator
# (draw_keys); token i's uniform is a hash of (key, i) (token_uniforms), the same in the CPU
# kernel and here, so either path draws the same token from the same logits and seed (up to
# float rounding at a near tie), and a kernel can hash only the tokens it needs.

_M32 = 0xFFFFFFFF


def draw_keys(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One key in [0, 2^62) per row, row i's from generators[i]; [B] int64 on the CPU."""
    return torch.tensor([int(torch.randint(0, 2**62, (1,), generator=g, device=g.device))
                         for g in generators], dtype=torch.int64)


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 tensor of the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on the bits of int32 x (a bijection that mixes every bit):
    products wrap mod 2^32, and each shift is logical (masked past the sign's copies)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * (0x85EBCA6B - 2**32)
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * (0xC2B2AE35 - 2**32)
    return x ^ ((x >> 16) & 0xFFFF)


def _uniforms(tokens: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Token ids' uniforms under their keys (int64, broadcast together), float64."""
    h = _fmix32(_fmix32(tokens.to(torch.int32) + _int32(keys & _M32))
                ^ _int32((keys >> 32) & _M32))
    return (h.to(torch.int64) & _M32).double().add_(0.5).mul_(2.0**-32)


def token_uniforms(keys: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float64 in (0, 1): token i's uniform under row b's key k, (h + 1/2) / 2^32 with
    h = fmix32(fmix32((i + k mod 2^32) mod 2^32) xor (k >> 32)) (cpu_sample.cpp hashes alike)."""
    keys = keys.to(device=device, dtype=torch.int64).unsqueeze(1)
    return _uniforms(torch.arange(vocab, dtype=torch.int64, device=device).unsqueeze(0), keys)


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Row b's token: argmax_i probs[b, i] / q_i, q_i = -log(1 - u_i) ~ Exp(1) from
    ``token_uniforms`` (the first maximum); [B] int64.

    The exponential race picks token i with probability p_i (unnormalised p is fine). A row's
    noise comes only from its key, so its draw does not depend on the batch; and a tiny change
    of the logits (bf16 rounding along another path, a cached prefix) changes the winner only at
    a near tie, so a seed gives the same tokens run after run (an inverse transform on the
    cumulative sum, tried, moved with every rounding before the drawn token). 32-bit uniforms:
    q is at least 1.2e-10, so a token 1e-10 as likely as the top one can still win. Where
    filters left a quarter of the entries or fewer, only those are hashed.
    """
    rows, vocab = probs.shape
    keys = keys.to(device=probs.device, dtype=torch.int64)
    if (int(torch.count_nonzero(probs)) * 4 <= probs.numel()
            and bool(torch.isfinite(probs).all())):
        nz = probs.nonzero()
        b, i = nz[:, 0], nz[:, 1]
        r = probs[b, i].double() / torch.log1p(-_uniforms(i, keys[b])).neg_()
        best = torch.full((rows,), -1.0, dtype=torch.float64, device=probs.device)
        best.scatter_reduce_(0, b, r, "amax")
        win = r == best[b]
        first = torch.full((rows,), vocab, dtype=torch.int64, device=probs.device)
        return first.scatter_reduce_(0, b[win], i[win], "amin")
    q = torch.log1p(-token_uniforms(keys, vocab, probs.device)).neg_()
    return row_argmax(probs.double() / q)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [B, V], row i drawn with generators[i] (``race``); [B] int64."""
    return race(probs, draw_keys(generators))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-d tensor (the first maximum; NaN counts as the maximum), in two
    levels where the row splits into blocks: the block maxima's argmax, then the argmax inside
    that block. ATen's CPU argmax over a wide row goes element by element: [32, 49152] float32
    1.69 ms, this 0.15 ms (its amax is vectorised); [1, 49152] 69 -> 32 us."""
    rows, cols = x.shape
    width = next((w for w in (256, 128, 64) if cols % w == 0 and cols > w), 0)
    if not width:
        return x.argmax(dim=-1)
    blocks = x.reshape(rows, cols // width, width)
    block = blocks.amax(dim=-1).argmax(dim=-1)  # amax keeps NaN, so a NaN's block wins too
    inside = blocks[torch.arange(rows, device=x.device), block].argmax(dim=-1)
    return block * width + inside


ArgmaxLogsumexp = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_argmax_lse: ArgmaxLogsumexp | None = None


def register_argmax_logsumexp(fn: ArgmaxLogsumexp | None) -> None:
    """``fn(x)`` for CPU float32 logits [B, V] returns ``(x.argmax(-1), x.logsumexp(-1))`` in
    one call (the CPU kernels register theirs: a decode step's sampling ran ~8 small operators on
    caches the weights had just flushed); None goes back to torch."""
    global _argmax_lse
    _argmax_lse = fn


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first maximum's index and the log-sum-exp of every row of a 2-d float32 tensor."""
    if _argmax_lse is not None and x.device.type == "cpu" and x.shape[1] > 0:
        return _argmax_lse(x)
    return row_argmax(x), x.logsumexp(dim=-1)


SampleRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor], torch.Tensor]
_sample_rows_fn: SampleRows | None = None


def register_sample_rows(fn: SampleRows | None) -> None:
    """``fn(logits, temperature, top_k, top_p, min_p, keys)`` for CPU float32 logits [B, V] and
    [B] float32 / int64 / float64 / float32 / int64 parameters returns each row's token as
    ``race(filter_probs(softmax(logits / temperature), top_k, top_p, min_p), keys)`` would,
    or -1 where it leaves a row to torch (NaN or infinite logits). The CPU kernels register
    theirs: the sort behind top-k / top-p took ~8 ms per SmolLM2 row, a row at temperature alone
    (softmax, a uniform per token, the race) ~0.75 ms (a 32-request decode step 113 ms with top_p
    against ~40 ms of forward); None goes back to torch."""
    global _sample_rows_fn
    _sample_rows_fn = fn


def _filters_needed(reqs: Sequence[Req]) -> bool:
    return any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in reqs)


class TorchSampler(Sampler):
    """The default sampler: pure torch, vectorised over the batch except the per-row noise."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        # For unseeded requests. Seeded from torch's global RNG so torch.manual_seed(engine seed)
        # makes a whole run reproducible.
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleOutput:
        if logits.shape[0] != len(reqs):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(reqs)} requests")
        # A padded lm_head may emit columns past the vocabulary; they are never valid tokens.
        raw = logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size]
        raw = raw.float()
        tokens, lse = argmax_logsumexp(raw)  # the argmax: final for greedy rows
        penalised = raw
        if any(r.params.has_penalties for r in reqs):
            penalised = apply_penalties(raw, reqs)
            tokens = row_argmax(penalised)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(rows) == len(reqs):  # every row sampled: no copy of the rows to pick them out
            tokens = self._sample_rows(penalised, reqs)
        elif rows:
            idx = torch.tensor(rows, dtype=torch.int64, device=raw.device)
            tokens[idx] = self._sample_rows(penalised[idx], [reqs[i] for i in rows])
        logprobs = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        out = SampleOutput(tokens.cpu(), logprobs.cpu())
        k = min(max(r.params.top_logprobs for r in reqs), self.vocab_size)
        if k > 0:
            top, ids = raw.topk(k, dim=-1)
            out.top_ids, out.top_logprobs = ids.cpu(), (top - lse[:, None]).cpu()
        return out

    def _sample_rows(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """Temperature, filters and a seeded draw for non-greedy rows."""
        keys = draw_keys([r.generator if r.generator is not None else self.generator
                          for r in reqs])
        temperature = _row_param(reqs, "temperature", logits.device)
        top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.int64)
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float64)
        min_p = torch.tensor([r.params.min_p for r in reqs], dtype=torch.float32)
        if _sample_rows_fn is not None and logits.device.type == "cpu":
            tokens = _sample_rows_fn(logits, temperature.squeeze(1), top_k, top_p, min_p, keys)
            left = (tokens < 0).nonzero().squeeze(1)
            if len(left) == 0:
                return tokens
            rows = left.tolist()  # NaN or infinite logits: torch's answer, whatever it is
            tokens[left] = self._torch_rows(logits[left], [reqs[i] for i in rows],
                                            temperature[left], top_k[left], top_p[left],
                                            min_p[left], keys[left])
            return tokens
        return self._torch_rows(logits, reqs, temperature, top_k, top_p, min_p, keys)

    @staticmethod
    def _torch_rows(logits: torch.Tensor, reqs: Sequence[Req], temperature: torch.Tensor,
                    top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    keys: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits / temperature, dim=-1)
        if _filters_needed(reqs):
            probs = filter_probs(probs, top_k, top_p, min_p)
        return race(probs, keys)
