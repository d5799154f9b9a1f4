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


def _kept(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
          min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens of every row of probs [B, V] (each row with a filter): ids [B, W] and
    their weights [B, W] (renormalised; 0 past a row's kept set), W the widest row's number of
    candidates.

    Each filter keeps a prefix of the row in descending order, so only a row's candidates are
    sorted, not its V tokens: the tokens at or above a floor that every kept token reaches.
    Top-k's floor is its k-th value; min-p's min_p x the top; top-p's from the row's mass in
    power-of-two bands below the top, the first band edge above which the row holds the top_p
    mass (with room for float32 sums). A SmolLM2 row at temperature 0.7 / top_p 0.9 sorted
    49,152 tokens in ~4 ms; it has a few hundred candidates.
    """
    rows, vocab = probs.shape
    dev = probs.device
    top = probs.amax(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), 0).to(dev)
    p = top_p.to(dev, torch.float64)
    mp = min_p.to(dev, torch.float32)
    floor = mp * top
    has_k = k > 0
    if bool(has_k.any()):  # top-k's floor alone (its top-p mass is the top-k set's)
        kth = probs.topk(int(k.max()), dim=-1).values
        floor = torch.where(has_k, kth.gather(1, (k.clamp(min=1) - 1).unsqueeze(1)).squeeze(1),
                            floor)
    total = torch.ones(rows, dtype=torch.float64, device=dev)
    need = ((p < 1.0) & ~has_k).nonzero().squeeze(1)
    if len(need):
        part, top_n = probs[need], top[need]
        total[need] = part.double().sum(dim=-1)
        # band j holds the tokens with p / top in (2^-(j+1), 2^-j]; 64 the rest (and zeros)
        band = torch.log2(part / top_n.unsqueeze(1)).neg_().floor_()
        band = band.nan_to_num_(64).clamp_(0, 64).long()
        mass = torch.zeros(len(need), 65, device=dev).scatter_add_(1, band, part)
        short = mass.double().cumsum(dim=-1) < (p[need] * total[need] * (1 + 1e-4)).unsqueeze(1)
        j = short.sum(dim=-1)  # the first band through which the mass suffices
        edge = torch.where(j < 64, top_n * torch.exp2(-(j + 1).float()) * (1 - 1e-5), 0.0)
        floor[need] = torch.maximum(floor[need], edge)
    cand = probs >= floor.unsqueeze(1)
    count = cand.sum(dim=-1)
    width = max(int(count.max()), 1)
    at = cand.nonzero()  # row-major: each row's candidates in id order
    b, i = at[:, 0], at[:, 1]
    pos = torch.arange(len(b), device=dev) - (count.cumsum(0) - count)[b]
    vals = torch.full((rows, width), -1.0, device=dev)  # padding sorts last, never kept
    vals[b, pos] = probs[b, i]
    ids = torch.zeros((rows, width), dtype=torch.int64, device=dev)
    ids[b, pos] = i
    vals, order = vals.sort(dim=-1, descending=True, stable=True)  # equal values: lower id first
    ids = ids.gather(1, order)
    rank = torch.arange(width, device=dev)
    keep = (vals >= 0) & ((rank < k.unsqueeze(1)) | ~has_k.unsqueeze(1))
    kept = vals * keep
    kept_64 = kept.double()
    cum = kept_64.cumsum(dim=-1)
    total = torch.where(has_k, cum[:, -1], total)
    before = (cum - kept_64) / total.unsqueeze(1)  # kept mass strictly above each token
    keep &= (before < p.unsqueeze(1)) | (p >= 1.0).unsqueeze(1)
    keep &= vals >= mp.unsqueeze(1) * vals[:, :1]
    kept = vals * keep
    return ids, kept / kept.sum(dim=-1, keepdim=True)


def _active(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The rows with a filter: [B] bool."""
    return (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens that top-k, then top-p, then min-p drop, and renormalise the rest.

    probs [B, V]; top_k [B] int (-1 disables), top_p [B] float (1 disables), min_p [B] float
    (0 disables). Each filter sees the distribution the previous one left (top-p mass is
    measured on the renormalised top-k set, as vLLM does); of equal values the lower id comes
    first. The most likely token is always kept.
    """
    out = probs / probs.sum(dim=-1, keepdim=True)
    at = _active(top_k, top_p, min_p).nonzero().squeeze(1)
    if len(at):
        rows = at.to(probs.device)
        ids, kept = _kept(probs[rows], top_k[at], top_p[at], min_p[at])
        out[rows] = torch.zeros_like(out[rows]).scatter_add_(1, ids, kept)  # padding adds 0
    return out


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


def _fmix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place on the bits of int32 x (a bijection that mixes
    every bit; tmp a scratch tensor like x): products wrap mod 2^32, and each shift is logical
    (masked past the sign's copies). In place, with the fraction below: [32, 49152] uniforms
    ~5 -> ~2.3 ms (the engine's malloc settings; 17 -> 5 ms without them)."""
    for shift, mask, mul in ((16, 0xFFFF, 0x85EBCA6B), (13, 0x7FFFF, 0xC2B2AE35), (16, 0xFFFF, 0)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_(mask))
        if mul:
            x.mul_(mul - 2**32)
    return x


def _hash(tokens: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Token ids' 32-bit hashes under their keys (int64, broadcast together), as int32 bits."""
    h = tokens.to(torch.int32) + _int32(keys & _M32)
    tmp = torch.empty_like(h)
    return _fmix32_(_fmix32_(h, tmp).bitwise_xor_(_int32((keys >> 32) & _M32)), tmp)


def _uniforms(tokens: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Token ids' uniforms under their keys (int64, broadcast together), float64."""
    # (h mod 2^32 + 1/2) / 2^32 from signed h: shifted into (-1/2, 1/2), then 1 up and the
    # fraction (exact in float64; remainder_ took 5x as long)
    return _hash(tokens, keys).double().add_(0.5).mul_(2.0**-32).add_(1.0).frac_()


def _exp1(u: torch.Tensor) -> torch.Tensor:
    """-log(1 - u), in place: Exp(1) noise from uniforms."""
    return u.neg_().log1p_().neg_()


def token_uniforms(keys: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float64 in (0, 1): token i's uniform under row b's key k, (h + 1/2) / 2^32 with
    h = fmix32(fmix32((i + k mod 2^32) mod 2^32) xor (k >> 32)) (cpu_sample.cpp hashes alike)."""
    keys = keys.to(device=device, dtype=torch.int64).unsqueeze(1)
    return _uniforms(torch.arange(vocab, dtype=torch.int64, device=device).unsqueeze(0), keys)


_PREFILTER_MIN = 1 << 19  # entries; below it a log per token is cheaper than the extra operators


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
    finite = bool(probs.sum().isfinite())  # NaN / inf: the dense path, whatever it answers
    if finite and int(torch.count_nonzero(probs)) * 4 <= probs.numel():
        nz = probs.nonzero()
        return _race_entries(nz[:, 0], nz[:, 1], probs[nz[:, 0], nz[:, 1]], keys, rows, vocab)
    if not finite or probs.numel() < _PREFILTER_MIN:
        q = _exp1(token_uniforms(keys, vocab, probs.device))
        return row_argmax(torch.div(probs, q, out=q))
    # q_i >= u_i, so token i beats the most likely token's r = p / q only if p_i >= u_i x r:
    # the exact uniforms and logs for those few (the CPU kernel's prefilter). The test runs on
    # float32 uniforms (within 1e-7 of them, below them by up to 2^-33; 1e-5 of slack), so no
    # [B, V] float64 tensor is made: each fresh 12 MB one cost ~2 ms of page faults at 32 rows.
    at = torch.arange(rows, device=probs.device)
    top = row_argmax(probs)
    r_top = probs[at, top].double() / _exp1(_uniforms(top, keys))
    u = _hash(torch.arange(vocab, device=probs.device).unsqueeze(0), keys.unsqueeze(1)).float()
    u.mul_(2.0**-32)
    u.sub_(u.floor())  # signed -> unsigned
    nz = (probs >= u.mul_((r_top * (1 - 1e-5)).float().unsqueeze(1))).nonzero()
    return _race_entries(nz[:, 0], nz[:, 1], probs[nz[:, 0], nz[:, 1]], keys, rows, vocab)


def _race_entries(b: torch.Tensor, i: torch.Tensor, p: torch.Tensor, keys: torch.Tensor,
                  rows: int, vocab: int) -> torch.Tensor:
    """``race`` over the entries (row b, token i, weight p) only, the rest of each row zero."""
    r = p.double() / _exp1(_uniforms(i, keys[b]))
    best = torch.full((rows,), -1.0, dtype=torch.float64, device=p.device)
    best.scatter_reduce_(0, b, r, "amax")
    win = r == best[b]
    first = torch.full((rows,), vocab, dtype=torch.int64, device=p.device)
    return first.scatter_reduce_(0, b[win], i[win], "amin")


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
        active = _active(top_k, top_p, min_p)
        if bool(active.all()) and bool(probs.sum().isfinite()):
            ids, kept = _kept(probs, top_k, top_p, min_p)  # every row filtered: race the kept
            b = torch.arange(len(reqs), device=probs.device).unsqueeze(1).expand_as(ids)
            at = kept > 0
            return _race_entries(b[at], ids[at], kept[at], keys.to(probs.device), len(reqs),
                                 probs.shape[1])
        if bool(active.any()):
            probs = filter_probs(probs, top_k, top_p, min_p)
        return race(probs, keys)
