"""y = x @ w.T on CPU (fp32): prepacked oneDNN GEMMs for batches, a chunked GEMV for decoding one row.

Two measured problems with ``F.linear`` on the reference 2-core CPU (AVX-512, fp32):

* Small M. MKL runs a GEMV (M = 1) or a skinny GEMM on one thread and reads the weight at ~10 GB/s,
  a third of what a parallel read reaches. Splitting the weight's rows into a few chunks run as one
  batched matmul spreads them over the cores (``chunked_linear``): 2.4x faster at M = 1 over all of
  SmolLM2's weights (52 -> 21 ms per token).
* Batches. MKL re-packs the weight on every call; that costs as much as the multiply at M = 8-128.
  oneDNN with the weight packed once at load (``torch.ops.mkldnn._reorder_linear_weight``) runs the
  same GEMMs 1.6-2.6x faster over the whole model (M = 32: 127 -> 70 ms; M = 128: 470 -> 195 ms) and
  1.4x at prefill sizes. The packed copy doubles the weights' memory.

oneDNN's packed GEMM is also batch-invariant here: a row's bits do not depend on M for M >= 2 (M = 1
takes a GEMV kernel with another summation order). ``CpuLinear(invariant=True)`` pads a single row
to two and verifies the property on the model's own shapes at start-up (``verify_invariance``): the
batch-invariant mode then costs nothing in its matmuls.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

CHUNKS = 8
GEMV_MAX_M = 4  # up to here (default mode): the chunked GEMV beats the packed GEMM
PACK_HINT_M = 32  # the batch size oneDNN tunes the packed layout for (any M runs on it)


def packed_gemm_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def chunked_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T as one batched matmul over CHUNKS slices of w's rows (fast for M <= 4)."""
    m = x.shape[0]
    n, k = w.shape
    c = CHUNKS if n % CHUNKS == 0 else (2 if n % 2 == 0 else 1)
    if c == 1:
        return F.linear(x, w, b)
    w3 = w.view(c, n // c, k)
    y = torch.bmm(w3, x.t().unsqueeze(0).expand(c, k, m)).view(n, m)
    # (for m = 1, view it as [1, n]: .t() would give strides (1, 1), which torch counts as contiguous
    # but which sends the next GEMV down a path measured 3x slower)
    y = y.view(1, n) if m == 1 else y.t().contiguous()
    return y + b if b is not None else y


class CpuLinear:
    """Callable ``(x, w, b) -> x @ w.T + b`` for the weights it was built with (others: F.linear).

    Weights are found by storage address, so they must not be reallocated after construction.
    """

    def __init__(self, weights: Iterable[torch.Tensor], invariant: bool = False, gated: Iterable[torch.Tensor] = ()):
        """weights: plain projections; gated: stacked [gate; up] weights used through silu_mul."""
        self.invariant = invariant
        self.packed: dict[int, torch.Tensor] = {}
        self.packed_halves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        ok = lambda w: w.dim() == 2 and w.dtype == torch.float32 and w.is_contiguous()  # noqa: E731
        for w in weights:
            if ok(w):
                self.packed[w.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_M)
        for w in gated:
            if ok(w) and w.shape[0] % 2 == 0:
                g, u = w.chunk(2, 0)
                self.packed_halves[w.data_ptr()] = tuple(
                    torch.ops.mkldnn._reorder_linear_weight(h.contiguous(), PACK_HINT_M) for h in (g, u)
                )

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if not self.invariant and x.dim() == 2 and 1 <= m <= GEMV_MAX_M:
            return chunked_linear(x, w, b)
        pw = self.packed.get(w.data_ptr())
        if pw is None or x.dim() != 2 or m == 0:
            if self.invariant:
                raise RuntimeError(f"batch-invariant linear called with an unpacked weight {tuple(w.shape)}")
            return F.linear(x, w, b)
        x = x.contiguous()
        if m == 1 and self.invariant:  # M = 1 would take oneDNN's GEMV kernel (another summation order)
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), pw, b, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, pw, b, "none", [], "")

    def silu_mul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for w = [gate; up]. Batches run as two GEMMs with the
        activation and the product fused into them (oneDNN post-ops): 5-12% faster than one GEMM
        followed by silu and mul (measured at M = 32-2048), and no [M, 2I] intermediate."""
        m = x.shape[0]
        halves = self.packed_halves.get(w.data_ptr())
        if halves is None or x.dim() != 2 or m == 0 or (not self.invariant and m <= GEMV_MAX_M):
            if self.invariant and halves is None:
                raise RuntimeError(f"batch-invariant silu_mul called with an unpacked weight {tuple(w.shape)}")
            g, u = self(x, w).chunk(2, -1)
            return F.silu(g) * u
        pad = m == 1 and self.invariant
        x = x.expand(2, -1).contiguous() if pad else x.contiguous()
        g = torch.ops.mkldnn._linear_pointwise(x, halves[0], None, "swish", [], "")
        y = torch.ops.mkldnn._linear_pointwise.binary(x, g, halves[1], None, "mul")
        return y[:1] if pad else y

    def verify_invariance(self, weights: Iterable[torch.Tensor], sizes=(1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 257)) -> bool:
        """True when, for every distinct weight shape, the first k rows of a batch equal a k-row batch,
        bitwise, for each k in sizes (random inputs, the current thread count)."""
        assert self.invariant
        gen = torch.Generator().manual_seed(0)
        seen: set = set()
        top = max(sizes)
        for w in weights:
            for fn, table in ((self, self.packed), (self.silu_mul, self.packed_halves)):
                if (fn, tuple(w.shape)) in seen or w.data_ptr() not in table:
                    continue
                seen.add((fn, tuple(w.shape)))
                x = torch.randn(top, w.shape[1], generator=gen)
                full = fn(x, w)
                for k in sizes:
                    if not torch.equal(fn(x[:k], w), full[:k]):
                        return False
        return True
