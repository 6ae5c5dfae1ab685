"""Turns a batch of logits into next tokens: penalties, constraint masks, filters, seeded draws.

Seeded sampling uses counter-based randomness (deepinfer_kernels.rng): each draw uses one
uniform derived from (request seed, token position) only, so a request samples the same tokens alone
or in any batch, and after preemption; the token is drawn by inverting the row's CDF at that
uniform (row-wise ops only). Greedy rows take the argmax (first maximum on ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.outputs import TokenLogprob
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer_kernels import rng


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # index in the full sequence of the token being drawn
    prompt_ids: list[int]
    output_ids: list[int]
    banned: list[int]  # token ids masked for this draw (EOS / stop ids while below min_tokens)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt+output, HF semantics), frequency and presence (output) penalties, in place."""
    V = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long)
            ids = ids[ids < V]
            if ids.numel():
                x = logits[i, ids]
                logits[i, ids] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.long), minlength=V)[:V].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """top-k, top-p and min-p on temperature-scaled logits, in place (masked entries become -inf)."""
    ks = [r.params.top_k for r in rows]
    ps = [r.params.top_p for r in rows]
    mps = [r.params.min_p for r in rows]
    V = logits.shape[1]
    if any(k > 0 for k in ks):
        k = torch.tensor([k if 0 < k < V else V for k in ks], device=logits.device)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits.masked_fill_(logits < kth, float("-inf"))
    if any(p < 1.0 for p in ps):
        top_p = torch.tensor(ps, device=logits.device, dtype=logits.dtype)
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))
    if any(m > 0 for m in mps):
        min_p = torch.tensor(mps, device=logits.device, dtype=logits.dtype)
        probs = torch.softmax(logits, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits.masked_fill_(probs < thresh, float("-inf"))


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


def row_uniforms(keys: list[int], device) -> torch.Tensor:
    """One uniform in (0, 1) per draw, from its 32-bit counter key (exact: 24-bit grid, never 0 or 1)."""
    h = rng.hash32_t(torch.tensor(keys, dtype=torch.long, device=device) ^ 0x5BD1E995)
    return ((h >> 8).to(torch.float64) + 0.5) / 16777216.0


def inverse_cdf_sample(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(x) by inverting its CDF at u.

    Every op is row-wise (softmax, a sequential cumulative sum, a binary search), so a row's draw
    depends only on its own logits and its uniform, never on the batch; and it costs three passes
    over the logits rather than the per-token noise a Gumbel-max draw needs. Masked (-inf) tokens
    have zero mass and are never drawn.
    """
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # fp64: sums over 100k+ tokens stay exact enough
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=x.shape[1] - 1)


class Sampler:
    """Samples one token per row. Grammar masks are applied by the caller before `sample`."""

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits [B,V] (fp32, modified in place) -> token ids [B] (int64)."""
        B = logits.shape[0]
        if any(r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty for r in rows):
            apply_penalties(logits, rows)
        for i, r in enumerate(rows):
            if r.banned:
                logits[i, r.banned] = float("-inf")
        tokens = torch.empty(B, dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(greedy) == B:
            return logits.argmax(dim=-1)
        if greedy:
            gi = torch.tensor(greedy, dtype=torch.long, device=logits.device)
            tokens[gi] = logits.index_select(0, gi).argmax(dim=-1)
        si = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        srows = [rows[i] for i in sampled]
        x = logits.index_select(0, si)
        temps = torch.tensor([r.params.temperature for r in srows], dtype=x.dtype, device=x.device)
        x.div_(temps[:, None])
        filter_logits(x, srows)
        keys = [rng.row_key(r.seed, r.position) for r in srows]
        tokens[si] = inverse_cdf_sample(x, row_uniforms(keys, x.device))
        return tokens
