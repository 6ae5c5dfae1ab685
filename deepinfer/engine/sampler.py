"""Turns a batch of logits into next tokens: penalties, bans, filters, seeded draws, on the logits'
device.

`Sampler.prepare(rows, vocab, device)` reads every row's parameters once per step into a
`SamplingBatch` of tensors on the logits' device; `Sampler.sample(logits, batch)` is then a fixed
sequence of batched tensor ops (no Python loop over rows), the same functions on CPU and CUDA.

Seeded sampling uses counter-based randomness (deepinfer_kernels.rng): each draw uses one
uniform derived from (request seed, token position) only, so a request samples the same tokens alone
or in any batch, and after preemption; the token is drawn by inverting the row's CDF at that
uniform (deepinfer_kernels.inverse_cdf, row-wise ops only). Greedy rows take the argmax (first
maximum on ties).

The fused route (`fused_route`): on CUDA, a batch whose every row needs no penalties, top-k,
top-p or min-p is drawn by the TileLang masked_sample kernel (temperature + draw in one pass, the
same inverse-CDF draw at the same uniform) instead of the torch ops; any other batch, and every
CPU batch unless forced with Sampler(fused="always"), takes the torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.outputs import TokenLogprob
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer_kernels import rng
from deepinfer_kernels.inverse_cdf import inverse_cdf_sample, row_uniform, row_uniforms  # noqa: F401 (re-exported)

FUSED_MODES = ("auto", "always", "never")


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # index in the full sequence of the token being drawn
    prompt_ids: list[int]
    output_ids: list[int]
    banned: list[int]  # token ids masked for this draw (EOS / stop ids while below min_tokens)


@dataclass
class Penalties:
    """The penalised rows' parameters: rows [P] of the batch; (seen_r, seen_c) every (row, token)
    a repetition penalty applies to; (out_r, out_c) every output token (one entry per occurrence)."""

    rows: torch.Tensor
    rep: torch.Tensor | None  # [P] fp32 repetition penalty (None: no row has one)
    seen_r: torch.Tensor | None
    seen_c: torch.Tensor | None
    freq: torch.Tensor | None  # [P] fp32 frequency / presence penalties (None: no row has one)
    pres: torch.Tensor | None
    out_r: torch.Tensor | None
    out_c: torch.Tensor | None


@dataclass
class SamplingBatch:
    """One step's sampling parameters as tensors on the logits' device (Sampler.prepare)."""

    size: int
    all_greedy: bool
    greedy_idx: torch.Tensor | None  # rows drawn by argmax (None when all or none are)
    sampled_idx: torch.Tensor | None  # rows drawn by the inverse CDF (None when none are)
    penalties: Penalties | None
    ban_r: torch.Tensor | None  # (row, token) pairs set to -inf (min_tokens bans)
    ban_c: torch.Tensor | None
    temps: torch.Tensor | None  # [S] fp32 temperatures of the sampled rows
    top_k: torch.Tensor | None  # [S] int64, V where a row has none (None: no row has one)
    top_p: torch.Tensor | None  # [S] fp32
    min_p: torch.Tensor | None  # [S] fp32
    uniforms: torch.Tensor | None  # [S] float64, one per draw (inverse_cdf.row_uniforms of keys)
    keys: torch.Tensor | None  # [S] int64 the draws' 32-bit keys, rng.row_key(seed, position)

    @property
    def fusable(self) -> bool:
        """No penalties, top-k, top-p or min-p: mask + temperature + draw is all the batch needs."""
        return self.penalties is None and self.top_k is None and self.top_p is None and self.min_p is None


def _dev(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # built on the host, copied once; non_blocking lets the copy overlap on CUDA
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def prepare_penalties(rows: list[SamplingRow], vocab: int, device: torch.device) -> Penalties | None:
    pen = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
           or ((r.params.frequency_penalty or r.params.presence_penalty) and r.output_ids)]
    if not pen:
        return None
    rep_vals, seen_r, seen_c = [], [], []
    freq, pres, out_r, out_c = [], [], [], []
    for j, i in enumerate(pen):
        p, r = rows[i].params, rows[i]
        rep_vals.append(p.repetition_penalty)
        if p.repetition_penalty != 1.0:
            ids = [t for t in set(r.prompt_ids) | set(r.output_ids) if t < vocab]
            seen_r += [j] * len(ids)
            seen_c += ids
        f, pr = p.frequency_penalty, p.presence_penalty
        if (f or pr) and r.output_ids:
            ids = [t for t in r.output_ids if t < vocab]
            out_r += [j] * len(ids)
            out_c += ids
            freq.append(f)
            pres.append(pr)
        else:
            freq.append(0.0)
            pres.append(0.0)
    has_rep = bool(seen_r)
    has_freq = bool(out_r)
    lng = torch.long
    return Penalties(
        _dev(pen, lng, device),
        _dev(rep_vals, torch.float32, device) if has_rep else None,
        _dev(seen_r, lng, device) if has_rep else None,
        _dev(seen_c, lng, device) if has_rep else None,
        _dev(freq, torch.float32, device) if has_freq else None,
        _dev(pres, torch.float32, device) if has_freq else None,
        _dev(out_r, lng, device) if has_freq else None,
        _dev(out_c, lng, device) if has_freq else None,
    )


def prepare(rows: list[SamplingRow], vocab: int, device: torch.device | str) -> SamplingBatch:
    """Every row's sampling parameters as tensors on device (the once-per-step host work; only
    what the batch uses is built: an all-greedy batch without bans or penalties builds nothing)."""
    device = torch.device(device)
    B = len(rows)
    params = [r.params for r in rows]
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
    ban_r = ban_c = None
    if any(r.banned for r in rows):
        br, bc = [], []
        for i, r in enumerate(rows):
            if r.banned:
                ids = [t for t in r.banned if t < vocab]
                br += [i] * len(ids)
                bc += ids
        if br:
            ban_r, ban_c = _dev(br, torch.long, device), _dev(bc, torch.long, device)
    pen = None
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        pen = prepare_penalties(rows, vocab, device)
    batch = SamplingBatch(size=B, all_greedy=not sampled, greedy_idx=None, sampled_idx=None, penalties=pen,
                          ban_r=ban_r, ban_c=ban_c, temps=None, top_k=None, top_p=None, min_p=None, uniforms=None,
                          keys=None)
    if not sampled:
        return batch
    lng, f32 = torch.long, torch.float32
    sp = [params[i] for i in sampled]
    if len(sampled) < B:
        batch.greedy_idx = _dev([i for i, p in enumerate(params) if p.temperature == 0.0], lng, device)
    batch.sampled_idx = _dev(sampled, lng, device)
    batch.temps = _dev([p.temperature for p in sp], f32, device)
    if any(p.top_k > 0 for p in sp):
        batch.top_k = _dev([p.top_k if 0 < p.top_k < vocab else vocab for p in sp], lng, device)
    if any(p.top_p < 1.0 for p in sp):
        batch.top_p = _dev([p.top_p for p in sp], f32, device)
    if any(p.min_p > 0 for p in sp):
        batch.min_p = _dev([p.min_p for p in sp], f32, device)
    batch.keys = _dev([rng.row_key(rows[i].seed, rows[i].position) for i in sampled], lng, device)
    batch.uniforms = row_uniforms(batch.keys, device)
    return batch


def penalize(logits: torch.Tensor, pen: Penalties) -> None:
    """Repetition (prompt+output, HF semantics), frequency and presence (output) penalties, in place,
    on the penalised rows only."""
    x = logits.index_select(0, pen.rows)
    if pen.rep is not None:
        seen = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        seen[pen.seen_r, pen.seen_c] = True
        rep = pen.rep.to(x.dtype)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if pen.freq is not None:
        counts = torch.zeros_like(x)
        counts.index_put_((pen.out_r, pen.out_c), torch.ones_like(pen.out_c, dtype=x.dtype), accumulate=True)
        x -= pen.freq.to(x.dtype)[:, None] * counts + pen.pres.to(x.dtype)[:, None] * (counts > 0).to(x.dtype)
    logits.index_copy_(0, pen.rows, x)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """The penalties of rows applied to logits in place (prepare + penalize)."""
    pen = prepare_penalties(rows, logits.shape[1], logits.device)
    if pen is not None:
        penalize(logits, pen)


def filter_logits(x: torch.Tensor, b: SamplingBatch) -> None:
    """top-k, top-p and min-p on temperature-scaled logits of the sampled rows, in place (masked
    entries become -inf)."""
    if b.top_k is not None:
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (b.top_k - 1)[:, None])
        x.masked_fill_(x < kth, float("-inf"))
    if b.top_p is not None:
        sorted_logits, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= b.top_p.to(x.dtype)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)
        x.masked_fill_(drop, float("-inf"))
    if b.min_p is not None:
        probs = torch.softmax(x, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * b.min_p.to(x.dtype)[:, None]
        x.masked_fill_(probs < thresh, float("-inf"))


def compute_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> list[TokenLogprob | None]:
    """Log-probabilities of the chosen tokens under the model's raw distribution, plus top-n."""
    out: list[TokenLogprob | None] = [None] * len(top_n)
    want = [i for i, n in enumerate(top_n) if n is not None]
    if not want:
        return out
    idx = torch.tensor(want, dtype=torch.long, device=raw_logits.device)
    lp = torch.log_softmax(raw_logits.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1).tolist()
    max_n = max(top_n[i] for i in want)
    top_v, top_i = (lp.topk(max_n, dim=-1) if max_n > 0 else (None, None))
    for j, i in enumerate(want):
        n = top_n[i]
        top = []
        if n:
            top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
        out[i] = TokenLogprob(int(tokens[i]), chosen[j], top)
    return out


class Sampler:
    """Samples one token per row. Grammar masks are applied by the caller before `sample`, or
    handed to it as a packed bitmask for the fused route.

    fused: "auto" takes the fused kernel on CUDA for batches that need nothing else (see the
    module docstring), "always" also on CPU (the kernel's C twin; tests use it to run the CUDA
    route's code), "never" keeps every batch on the torch ops."""

    def __init__(self, fused: str = "auto", kernels: str = "auto"):
        if fused not in FUSED_MODES:
            raise InvalidRequestError(f"Sampler fused must be one of {', '.join(FUSED_MODES)}, got {fused!r}")
        self.fused = fused
        self.kernels = kernels  # the engine's kernels option: "torch" keeps every batch on torch ops
        self._native_argmax = None  # native.argmax_rows once looked up (False: not available), see argmax

    prepare = staticmethod(prepare)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: torch.argmax(logits, -1) exactly. On CPU fp32 the native kernel
        (deepinfer_kernels.native.argmax_rows): torch's took 2.6-5.4 ms a step at batch 128 on the
        default model's 49152-token vocabulary, 2-4% of the step; the kernel 0.43 ms."""
        if (self.kernels != "torch" and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.shape[1] and logits.stride(1) == 1):
            if self._native_argmax is None:  # once, not per step (the library's lock and build check)
                from deepinfer_kernels import native

                self._native_argmax = native.argmax_rows if native.available() else False
            if self._native_argmax:
                return self._native_argmax(logits)
        return logits.argmax(dim=-1)

    def fused_route(self, batch: SamplingBatch, device: torch.device) -> bool:
        """Whether batch is drawn by the fused masked_sample kernel on device."""
        if self.fused == "never" or batch.all_greedy or not batch.fusable:
            return False  # an all-greedy batch is one argmax: nothing to fuse
        if self.fused == "always":
            return True
        from deepinfer_kernels.dispatch import selected_backend, use_backend

        if device.type != "cuda":
            return False
        with use_backend(self.kernels):
            return selected_backend("masked_sample", device) == "tilelang"

    def sample(self, logits: torch.Tensor, batch: SamplingBatch | list[SamplingRow],
               bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B,V] (fp32, modified in place) -> token ids [B] (int64). bitmask: an int32
        [B, ceil(V/32)] grammar mask not yet applied (on logits' device), or None."""
        if isinstance(batch, list):
            batch = prepare(batch, logits.shape[1], logits.device)
        if batch.size != logits.shape[0]:
            raise InvalidRequestError(f"sampling batch has {batch.size} rows, logits have {logits.shape[0]}")
        if batch.penalties is not None:
            penalize(logits, batch.penalties)
        if batch.ban_r is not None:
            logits[batch.ban_r, batch.ban_c] = float("-inf")
        if self.fused_route(batch, logits.device):
            from deepinfer_kernels.dispatch import masked_sample, use_backend

            # the kernel takes every row: temperature 0 (key unused) for the greedy ones
            si = batch.sampled_idx
            temps = torch.zeros(batch.size, dtype=torch.float32, device=logits.device).index_copy_(0, si, batch.temps)
            keys = torch.zeros(batch.size, dtype=torch.long, device=logits.device).index_copy_(0, si, batch.keys)
            with use_backend("tilelang" if self.fused == "always" else self.kernels):
                return masked_sample(logits.float(), bitmask, temps, keys)
        if bitmask is not None:
            from deepinfer.grammar.bitmask_device import apply_token_bitmask_device_

            apply_token_bitmask_device_(logits, bitmask)
        if batch.all_greedy:
            return self.argmax(logits)
        tokens = torch.empty(batch.size, dtype=torch.long, device=logits.device)
        if batch.greedy_idx is not None:
            tokens[batch.greedy_idx] = self.argmax(logits.index_select(0, batch.greedy_idx))
        si = batch.sampled_idx
        x = logits.index_select(0, si)
        x.div_(batch.temps.to(x.dtype)[:, None])
        filter_logits(x, batch)
        tokens[si] = inverse_cdf_sample(x, batch.uniforms)
        return tokens
