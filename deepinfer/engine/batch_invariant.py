"""Batch-invariant torch ops: a row's result does not depend on the other rows in the batch, bitwise.

Why this is needed: BLAS libraries pick a different kernel, blocking and thread split (and so a
different floating-point summation order) depending on the matrix shape. On the reference CPU
build (MKL, AVX-512, 2 threads) fp32 ``mm`` rows differ from the full-batch result by ~1e-4 when
M is in {1,2,3,5,6,7,9,10,11}; with 16 threads MKL also splits M unevenly (a row's bits depend on
its position) and changes its split-K with the batch size. A reduction with a single output row
is split across threads while one with many rows is not. Then the same request gives different
tokens depending on what else is running.

How each op is made invariant:

* ``bi_matmul``: on CPU ("ttiles"), the batch goes through the GEMM as fixed tiles of 16
  columns of ``w @ x_t.T``: every call has the same shape, so the same blocking and threading,
  and a column's bits do not depend on its place in the tile. On CUDA ("tiles"), one
  ``x_t @ w.T`` per fixed tile of 64 rows. See ``bi_matmul`` for the schemes tried.
* ``bi_rmsnorm`` / ``bi_add_rmsnorm``: on CPU a row reduction always sees at least two rows, so
  torch parallelises over rows and never splits one row's sum; on CUDA the sum of squares is a
  fixed-tile GEMM with a ones vector (CUDA reductions choose their layout from the row count).
* ``bi_softmax`` / ``bi_log_softmax``: torch's last-dim kernels already process each row on its
  own (checked by the tests, CPU and CUDA).
* ``bi_attention``: keys are processed in fixed splits of ``SPLIT`` (64; smaller splits pad short decode contexts less, measured 0.53 -> 0.75 of default throughput at batch 32) keys aligned to key 0;
  each split's scores and P@V are GEMMs whose fixed operand (the split's keys / values) is M and
  whose query rows (padded to a multiple of 16) are N, and the splits are merged strictly left
  to right with log-sum-exp rescaling. A split holding no key a query may see changes nothing
  bitwise (its weight is exactly 0 and the running max is unchanged, so the running sums are
  multiplied by exp(0) = 1), so a query at position p gets the same bits whether computed in a
  full prefill, a chunked prefill, after a cached prefix or in a decode step.

Verified by tests/batch_invariant on the 2-core CPU (default and 16 threads) and on a 16-core
CPU + H200 GPU. Cost over plain torch (fp32, 2 threads, best-of-N, run
benchmarks/bi_ops.py): ``bi_matmul`` 4-5x at M=1 for the 576-wide layers
(0.02-0.05 ms -> 0.08-0.19 ms: 16 padded columns), 1.2-2.3x at M=8, ~1x at M=32, 1.4-1.7x at
M=128; the 576x49152 lm_head 2.5x at M=1, 0.7x at M=8, 1.7x at M=32, 3.5x at M=128 (it re-reads
the weight per 16-row tile). ``bi_attention`` is 4.5-10x slower than
``F.scaled_dot_product_attention`` (decode over 2048 keys: 0.3 -> 1.5 ms).
"""

from __future__ import annotations

import torch

from deepinfer.errors import InvalidRequestError

CPU_SCHEME = "ttiles"  # bi_matmul's CPU default with more than 2 threads (see bi_matmul)


def cpu_scheme() -> str:
    """"tpad16" (one GEMM, much faster for prefill) where it is invariant: at 1-2 torch threads;
    "ttiles" above that, where MKL's partition of the batch changes with its size."""
    return "tpad16" if torch.get_num_threads() <= 2 else CPU_SCHEME
ATTN_M_MULTIPLE = 16  # attention query rows (the GEMMs' N) are padded to a multiple of this
CUDA_M_TILE = 64  # rows per GEMM on CUDA ("tiles" scheme)
SPLIT = 64  # keys per attention split


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


# ----------------------------------------------------------------------------- matmul
COL_TILE = 16  # batch rows per GEMM in the CPU schemes (fewer than 12 columns take another kernel)


def bi_matmul(x: torch.Tensor, w: torch.Tensor, scheme: str | None = None) -> torch.Tensor:
    """``x @ w.T`` for x [..., K], w [N, K] -> [..., N], batch-invariant over the rows of x.

    scheme (None picks the device default):
    * "ttiles" (CPU default): ``(w @ x_t.T).T`` for each fixed tile x_t of COL_TILE batch rows
      (zero-padded). Every GEMM has the same shape, so the BLAS makes the same blocking and
      threading choices (split-K included) each call; the weight is the GEMM's M operand, so
      the batch rows are columns, and a column's bits do not depend on its place in the tile.
    * "tpad16": one ``(w @ x.T).T`` GEMM over the batch padded to a multiple of 16. Faster for
      large batches and invariant with 1-2 threads, but with 16 threads MKL changes its
      partition (split-K) with the batch size for some shapes (seen for K=1536, N=576).
    * "tiles" (CUDA default): one ``x_t @ w.T`` GEMM per fixed tile of CUDA_M_TILE rows.
    (Plain ``x @ w.T`` with M padded to 4 or 16 is invariant with 1-2 threads but not with 16:
    MKL then splits M unevenly and a row's bits depend on its position.)
    """
    if x.shape[-1] != w.shape[-1] or w.dim() != 2:
        raise InvalidRequestError(f"bi_matmul shape mismatch: x {tuple(x.shape)} vs w {tuple(w.shape)} (want w [N, K])")
    if scheme is None:
        scheme = "tiles" if x.is_cuda else cpu_scheme()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, n = x2.shape[0], w.shape[0]
    if scheme == "ttiles":
        mp = max(COL_TILE, _round_up(m, COL_TILE))
        xp = _pad_rows(x2, mp)
        yt = x2.new_empty((mp // COL_TILE, n, COL_TILE))
        for i in range(mp // COL_TILE):
            torch.mm(w, xp[i * COL_TILE : (i + 1) * COL_TILE].t(), out=yt[i])
        # contiguous: with one tile the reshape is a column-major view, and elementwise ops on a
        # column-major tensor vectorise along the batch, so their bits would depend on M
        y = yt.transpose(1, 2).reshape(mp, n)[:m].contiguous()
    elif scheme == "tpad16":
        xp = _pad_rows(x2, max(COL_TILE, _round_up(m, COL_TILE)))
        y = torch.mm(w, xp.t()).t()[:m].contiguous()
    elif scheme == "tiles":
        mp = max(CUDA_M_TILE, _round_up(m, CUDA_M_TILE))
        xp = _pad_rows(x2, mp)
        y = x2.new_empty((mp, n))
        wt = w.t()
        for s in range(0, mp, CUDA_M_TILE):
            torch.mm(xp[s : s + CUDA_M_TILE], wt, out=y[s : s + CUDA_M_TILE])
        y = y[:m]
    else:
        raise InvalidRequestError(f"unknown bi_matmul scheme {scheme!r}; use 'ttiles', 'tpad16' or 'tiles'")
    return y.reshape(*lead, n)


# ----------------------------------------------------------------------------- norms
def _mean_sq_rows(x2: torch.Tensor) -> torch.Tensor:
    """Mean of squares per row of a 2-D tensor, [M, 1], computed the same way for any M."""
    m = x2.shape[0]
    if x2.is_cuda:
        # CUDA reductions pick their block layout from the number of rows; a GEMM with the
        # ones vector, in fixed row tiles, sums every row the same way.
        ones = x2.new_ones((1, x2.shape[1]))
        return bi_matmul(x2 * x2, ones, scheme="tiles") / x2.shape[1]
    # a single-row reduction is split across threads (two-pass); with >= 2 rows torch
    # parallelises over rows and sums each row serially, the same way for every M.
    xx = _pad_rows(x2, 2) if m < 2 else x2
    return (xx * xx).mean(-1, keepdim=True)[:m]


def bi_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * w`` (fp32 math), batch-invariant."""
    if x.shape[-1] != w.shape[-1]:
        raise InvalidRequestError(f"bi_rmsnorm: x last dim {x.shape[-1]} != weight size {w.shape[-1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    inv = torch.rsqrt(_mean_sq_rows(x2) + eps)
    return ((x2 * inv) * w.to(torch.float32)).to(x.dtype).reshape(*lead, x.shape[-1])


def bi_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: returns ``(rmsnorm(x + residual), x + residual)``."""
    if x.shape != residual.shape:
        raise InvalidRequestError(f"bi_add_rmsnorm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    new_residual = x + residual
    return bi_rmsnorm(new_residual, w, eps), new_residual


# ----------------------------------------------------------------------------- softmax
def bi_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (fp32 math); torch's last-dim kernel is already row-wise."""
    return torch.softmax(x.to(torch.float32).contiguous(), dim=-1).to(x.dtype)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim (fp32 math); row-wise like ``bi_softmax``."""
    return torch.log_softmax(x.to(torch.float32).contiguous(), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- attention
def _split_attention(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Core of the split attention.

    qg [*B, Mp, D] (Mp a multiple of ATTN_M_MULTIPLE), k/v [*B, L, D] (L a multiple of SPLIT),
    valid [*B or broadcastable, Mp, L] bool -> [*B, Mp, D], all fp32.
    """
    *bdims, mp, d = qg.shape
    n_split = k.shape[-2] // SPLIT
    ks = k.reshape(*bdims, n_split, SPLIT, d)
    vs = v.reshape(*bdims, n_split, SPLIT, d)
    # GEMMs are laid out with the fixed-size operand (a split's SPLIT keys / values) as M and the
    # query rows as N (as in bi_matmul: a column's bits do not depend on how many columns there
    # are, from 16 up): scores^T = K_s @ Q^T  [SPLIT, Mp]
    scores = torch.matmul(ks, qg.unsqueeze(-3).transpose(-1, -2)).transpose(-1, -2).contiguous()
    scores = scores * scale  # [*B, n_split, Mp, SPLIT]
    vmask = valid.reshape(*valid.shape[:-2], mp, n_split, SPLIT).transpose(-3, -2)
    scores = scores.masked_fill(~vmask, float("-inf"))
    m_s = scores.amax(-1, keepdim=True)  # max is exact: no order question
    m_safe = torch.where(torch.isinf(m_s), torch.zeros_like(m_s), m_s)
    p = torch.exp(scores - m_safe)  # masked -> exactly 0
    l_s = p.sum(-1, keepdim=True)  # [*B, n_split, Mp, 1]
    # o^T = V_s^T @ P^T  [D, Mp]: again the fixed operand is M
    o_s = torch.matmul(vs.transpose(-1, -2), p.transpose(-1, -2)).transpose(-1, -2)  # [*B, n_split, Mp, D]
    # merge splits strictly left to right (fixed order, log-sum-exp rescaling)
    m, l, o = m_s[..., 0, :, :], l_s[..., 0, :, :], o_s[..., 0, :, :]
    for s in range(1, n_split):
        ms = m_s[..., s, :, :]
        m_new = torch.maximum(m, ms)
        m_new_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        a = torch.exp(m - m_new_safe)
        b = torch.exp(ms - m_new_safe)
        l = l * a + l_s[..., s, :, :] * b
        o = o * a + o_s[..., s, :, :] * b
        m = m_new
    safe_l = torch.where(l > 0, l, torch.ones_like(l))
    return torch.where(l > 0, o / safe_l, torch.zeros_like(o))  # a query that sees no key -> 0


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batched: bool) -> tuple[int, int, int]:
    kd = 4 if batched else 3
    if q.dim() != 3 or k.dim() != kd or v.shape != k.shape:
        raise InvalidRequestError(
            f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; want "
            + ("q [B, H, D], k/v [B, L_max, Hkv, D]" if batched else "q [q_len, H, D], k/v [kv_len, Hkv, D]")
        )
    h, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise InvalidRequestError(f"attention head dims differ: q {d}, k {k.shape[-1]}")
    if hkv == 0 or h % hkv:
        raise InvalidRequestError(f"num heads {h} is not a multiple of num kv heads {hkv}")
    return h, hkv, d


def bi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal_offset: int | None
) -> torch.Tensor:
    """Reference attention for one sequence, batch-invariant and split-invariant.

    q [q_len, H, D], k/v [kv_len, Hkv, D] (GQA: H a multiple of Hkv). Query i attends keys
    j <= causal_offset + i (usually causal_offset = kv_len - q_len); ``causal_offset=None``
    means no causal mask. Returns [q_len, H, D] in q's dtype (math in fp32). A query's output
    depends only on its own values and the keys it sees, bitwise, not on q_len or on keys
    beyond its causal limit.
    """
    h, hkv, d = _check_qkv(q, k, v, batched=False)
    q_len, kv_len = q.shape[0], k.shape[0]
    g = h // hkv
    out = q.new_zeros((q_len, h, d))
    if q_len == 0 or kv_len == 0:
        return out
    # queries that share a kv head form the rows of one GEMM: [Hkv, G * q_len, D]
    # (row chunks keep the score tensor bounded; results do not depend on chunking)
    qf = q.to(torch.float32).reshape(q_len, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    big_l = _round_up(kv_len, SPLIT)
    kf = _pad_rows(k.to(torch.float32), big_l).permute(1, 0, 2).contiguous()  # [Hkv, L, D]
    vf = _pad_rows(v.to(torch.float32), big_l).permute(1, 0, 2).contiguous()
    key_idx = torch.arange(big_l, device=q.device)
    chunk = max(1, (1024 // g))  # queries per chunk
    for q0 in range(0, q_len, chunk):
        q1 = min(q_len, q0 + chunk)
        n = q1 - q0
        rows = g * n
        mp = max(ATTN_M_MULTIPLE, _round_up(rows, ATTN_M_MULTIPLE))
        qg = _pad_rows(qf[:, :, q0:q1].reshape(hkv, rows, d).transpose(0, 1), mp).transpose(0, 1).contiguous()
        qpos = torch.arange(q0, q1, device=q.device).repeat(g)  # row r = (g_idx, i)
        valid = (key_idx[None, :] < kv_len).expand(rows, big_l)
        if causal_offset is not None:
            valid = valid & (key_idx[None, :] <= (causal_offset + qpos)[:, None])
        valid = _pad_rows(valid, mp)  # padded rows see nothing
        o = _split_attention(qg, kf, vf, valid, scale)[:, :rows]  # [Hkv, G*n, D]
        out[q0:q1] = o.reshape(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d).to(q.dtype)
    return out


def bi_attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | list[int], *, scale: float
) -> torch.Tensor:
    """Batched decode attention: q [B, H, D], padded k/v [B, L_max, Hkv, D], per-row lengths.

    Row b attends keys [0, lengths[b]); its result equals
    ``bi_attention(q[b:b+1], k[b, :lengths[b]], v[b, :lengths[b]], scale=scale,
    causal_offset=lengths[b] - 1)`` bitwise. Returns [B, H, D].
    """
    h, hkv, d = _check_qkv(q, k, v, batched=True)
    b_sz, l_max = k.shape[0], k.shape[1]
    if q.shape[0] != b_sz:
        raise InvalidRequestError(f"q has {q.shape[0]} rows but k/v have {b_sz}")
    lens = torch.as_tensor(lengths, dtype=torch.int64, device=q.device)
    if lens.shape != (b_sz,):
        raise InvalidRequestError(f"lengths must have one entry per row ({b_sz}), got shape {tuple(lens.shape)}")
    if b_sz and (int(lens.min()) < 0 or int(lens.max()) > l_max):
        raise InvalidRequestError(f"lengths must lie in [0, {l_max}], got {lens.tolist()}")
    g = h // hkv
    if b_sz == 0 or l_max == 0:
        return q.new_zeros((b_sz, h, d))
    mp = max(ATTN_M_MULTIPLE, _round_up(g, ATTN_M_MULTIPLE))
    big_l = _round_up(l_max, SPLIT)
    qg = q.to(torch.float32).reshape(b_sz, hkv, g, d)
    qg = torch.cat([qg, qg.new_zeros((b_sz, hkv, mp - g, d))], dim=2) if mp > g else qg
    kf = k.to(torch.float32).permute(0, 2, 1, 3)
    vf = v.to(torch.float32).permute(0, 2, 1, 3)
    if big_l > l_max:
        pad = kf.new_zeros((b_sz, hkv, big_l - l_max, d))
        kf, vf = torch.cat([kf, pad], dim=2), torch.cat([vf, pad], dim=2)
    kf, vf = kf.contiguous(), vf.contiguous()
    key_idx = torch.arange(big_l, device=q.device)
    row_ok = torch.arange(mp, device=q.device) < g  # padded rows see nothing
    valid = (key_idx[None, None, :] < lens[:, None, None]) & row_ok[None, :, None]  # [B, Mp, L]
    o = _split_attention(qg.contiguous(), kf, vf, valid[:, None], scale)  # [B, Hkv, Mp, D]
    return o[:, :, :g].reshape(b_sz, h, d).to(q.dtype)
