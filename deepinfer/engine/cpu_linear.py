"""y = x @ w.T on CPU, fast at the small batch sizes of decoding.

MKL runs a GEMV (M = 1) or a skinny GEMM on one thread and reads the weight at ~10 GB/s on the
reference 2-core machine, a third of what a parallel read reaches. Splitting the weight's rows
into a few chunks and running them as one batched matmul lets torch spread the chunks over the
cores: measured 2.7-3.1x faster at M = 1 and 1.2-1.6x at M = 8-32 for SmolLM2's shapes
(`benchmarks/throughput.py` shows the end-to-end effect). Large M keeps the plain GEMM, which is
already compute-efficient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNKS = 4
GEMV_MAX_M = 4  # up to here: weight-chunk-major batched matmul (best for GEMV)
BATCHED_MAX_M = 96  # up to here: row-major batched matmul; above: one plain GEMM


def cpu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    m = x.shape[0] if x.dim() == 2 else -1
    n, k = w.shape
    c = CHUNKS if n % CHUNKS == 0 else (2 if n % 2 == 0 else 1)
    if m < 1 or m > BATCHED_MAX_M or c == 1:
        return F.linear(x, w, b)
    w3 = w.view(c, n // c, k)
    if m <= GEMV_MAX_M:
        y = torch.bmm(w3, x.t().unsqueeze(0).expand(c, k, m)).reshape(n, m).t().contiguous()
    else:
        y = torch.bmm(x.unsqueeze(0).expand(c, m, k), w3.transpose(1, 2)).permute(1, 0, 2).reshape(m, n)
    return y + b if b is not None else y
