"""y = x @ w.T on CPU (fp32) for the decoder's projections, on weights packed once at load.

Two backends, measured on the reference 2-core CPU (AVX-512, fp32) against ``F.linear`` (MKL):

* ``native`` (default where the native kernels build, at every CPU level, see
  ``native_gemm_preferred``): deepinfer_kernels.native's panel GEMM
  (csrc/gemm.c), the weight streamed once per call with the partial sums in registers. On
  SmolLM2's shapes with the weights coming from memory: 1.4-2.2x oneDNN's packed GEMM at 1 row,
  1.1-1.25x at 32, about equal at prefill sizes; in the engine (A/B in one process) batch-1
  decode 1.7x faster than the chunked GEMV below, batch 32 1.15-1.2x faster than oneDNN. gate/up
  run as one call with silu * mul applied in registers. Each output is one multiply-add chain over
  k in order, so it is batch-invariant for every batch size, one row included.
* ``onednn`` (no C compiler): oneDNN GEMMs with the weight reordered once
  (``torch.ops.mkldnn._reorder_linear_weight``), 1.6-2.6x faster than MKL's ``F.linear``, which
  re-packs the weight on every call; 1-4 rows take ``chunked_linear`` (MKL runs a GEMV on one
  thread). It is batch-invariant here for M >= 2 only, so the invariant mode pads one row to two.

Either way the packed copy doubles the weights' memory (a bf16 / fp16 checkpoint under dtype="auto"
avoids that: weights16.py keeps its projections in 16-bit native panels, with no fp32 copy). ``verify_invariance`` checks the invariant
mode's property on the model's own shapes at start-up (a library property, not a guarantee).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from deepinfer.engine import cpu
from deepinfer.engine.placeholder import is_placeholder

CHUNKS = 8
GEMV_MAX_M = 4  # up to here (default mode): the chunked GEMV beats the packed GEMM
PACK_HINT_M = 32  # the batch size oneDNN tunes the packed layout for (any M runs on it)


def as_stored_bf16(t: torch.Tensor) -> torch.Tensor | None:
    """t in bf16 when every value of t is a bf16 (a bf16 checkpoint's tensor, loaded as fp32), else None:
    kept so, and widened back where read, it gives the fp32 tensor's bits from half the bytes."""
    b = t.to(torch.bfloat16)
    return b if torch.equal(b.float(), t) else None


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def native_available() -> bool:
    from deepinfer_kernels import native

    return native.available()


def native_gemm_preferred() -> bool:
    """The native panel GEMM is the CPU linear wherever the native kernels build, at every CPU level:
    each level's build has its own register tile (csrc/gemm.c: 8 x 48 on AVX-512, 4 x 24 on AVX2, 3 x 16
    on plain x86-64), and every tile keeps one multiply-add chain per output, so it is batch-invariant
    by construction where oneDNN is so only as a library property of one CPU and thread count (the
    batch-invariant MoE, expert-parallel and EPLB tests failed on an AVX2 Zen 3 with oneDNN there).
    Before the AVX2 tile the 8 x 48 tile spilled there (367 us vs F.linear's 86 for one 1536 x 576 row)."""
    return native_available()


def packed_gemm_available() -> bool:
    """True when some packed backend runs here."""
    return native_available() or onednn_available()


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
    """Callable ``(x, w, b) -> x @ w.T + b`` for the weights it was built with (others: F.linear),
    plus ``silu_mul(x, [gate; up])``. Weights are found by storage address, so they must not be
    reallocated after construction."""

    def __init__(self, weights: Iterable[torch.Tensor], invariant: bool = False, gated: Iterable[torch.Tensor] = (),
                 backend: str | None = None, bf16_dot: bool = False, keep_fp32: Iterable[torch.Tensor] = (),
                 bf16_exact: bool = False):
        """weights: plain projections; gated: stacked [gate; up] weights used through silu_mul;
        backend: "native" or "onednn" (None: native where it is preferred, see native_gemm_preferred;
        oneDNN where that is missing, else native). bf16_dot (native only): packed rounded to bf16 and
        run as bf16 dot products, except the weights in keep_fp32 (an MoE router's: kept in fp32).
        bf16_exact (native only): a weight whose every value is a bf16 (a bf16 checkpoint's, loaded as fp32)
        is packed in bf16 panels, widened exactly in registers: the fp32 panels' bits from half the bytes."""
        if backend is None:
            backend = "native" if native_gemm_preferred() or not onednn_available() else "onednn"
        self.backend = backend
        if self.backend not in ("native", "onednn"):
            raise ValueError(f"CpuLinear backend must be 'native' or 'onednn', got {self.backend!r}")
        self.invariant = invariant
        self.packed: dict[int, object] = {}
        self.packed_gated: dict[int, object] = {}
        ok = lambda w: w.dim() == 2 and w.dtype == torch.float32 and w.is_contiguous()  # noqa: E731
        if self.backend == "native":
            from deepinfer_kernels import native

            self._native = native
            exempt = {w.data_ptr() for w in keep_fp32}

            def stored(w: torch.Tensor) -> torch.Tensor:
                b = as_stored_bf16(w) if bf16_exact and not bf16_dot else None
                return w if b is None else b

            for w in weights:
                if ok(w):
                    self.packed[w.data_ptr()] = native.pack_weight(stored(w), bf16_dot=bf16_dot and w.data_ptr() not in exempt)
            for w in gated:
                if ok(w) and w.shape[0] % 2 == 0:
                    self.packed_gated[w.data_ptr()] = native.pack_gated_weight(stored(w), bf16_dot=bf16_dot)
            return
        if bf16_dot:
            raise ValueError("CpuLinear: bf16_dot needs the native backend")
        for w in weights:
            if ok(w):
                self.packed[w.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_M)
        for w in gated:
            if ok(w) and w.shape[0] % 2 == 0:
                g, u = w.chunk(2, 0)
                self.packed_gated[w.data_ptr()] = tuple(
                    torch.ops.mkldnn._reorder_linear_weight(h.contiguous(), PACK_HINT_M) for h in (g, u)
                )

    @classmethod
    def from_native_panels(cls, packed: dict, packed_gated: dict, invariant: bool = False) -> CpuLinear:
        """The native backend over weights packed elsewhere (native.PackedWeight, any panel dtype), keyed
        by the storage address of the weight the model passes in: weights16.py packs a 16-bit
        checkpoint's tensors and hands the model placeholders with those addresses."""
        from deepinfer_kernels import native

        self = cls.__new__(cls)
        self.backend, self.invariant, self._native = "native", invariant, native
        self.packed, self.packed_gated = dict(packed), dict(packed_gated)
        return self

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        pw = self.packed.get(w.data_ptr())
        if pw is None or x.dim() != 2:
            if self.invariant or is_placeholder(w):  # (a placeholder's values are NaN: never compute on one)
                mode = "batch-invariant" if self.invariant else "16-bit"
                raise RuntimeError(f"{mode} linear called with an unpacked weight {tuple(w.shape)}")
            return F.linear(x, w, b)
        if self.backend == "native":
            return self._native.linear(x, pw, b)
        m = x.shape[0]
        if not self.invariant and 1 <= m <= GEMV_MAX_M:
            return chunked_linear(x, w, b)
        if m == 0:
            return F.linear(x, w, b)
        x = x.contiguous()
        if m == 1 and self.invariant:  # M = 1 would take oneDNN's GEMV kernel (another summation order)
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), pw, b, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, pw, b, "none", [], "")

    def silu_mul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for w = [gate; up], the activation and product fused into
        the GEMM (native: in registers; oneDNN: post-ops, 5-12% faster than separate ops at M = 32-2048)."""
        m = x.shape[0]
        packed = self.packed_gated.get(w.data_ptr())
        if packed is not None and x.dim() == 2 and self.backend == "native":
            return self._native.gated_linear(x, packed)
        if packed is None or x.dim() != 2 or m == 0 or (not self.invariant and m <= GEMV_MAX_M):
            if self.invariant and packed is None:
                raise RuntimeError(f"batch-invariant silu_mul called with an unpacked weight {tuple(w.shape)}")
            g, u = self(x, w).chunk(2, -1)
            return F.silu(g) * u
        pad = m == 1 and self.invariant
        x = x.expand(2, -1).contiguous() if pad else x.contiguous()
        g = torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "swish", [], "")
        y = torch.ops.mkldnn._linear_pointwise.binary(x, g, packed[1], None, "mul")
        return y[:1] if pad else y

    def verify_invariance(self, weights: Iterable[torch.Tensor], sizes=(1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 257)) -> bool:
        """True when, for every distinct weight shape, the first k rows of a batch equal a k-row batch,
        bitwise, for each k in sizes (random inputs, the current thread count)."""
        assert self.invariant
        gen = torch.Generator().manual_seed(0)
        seen: set = set()
        top = max(sizes)
        for w in weights:
            for fn, table in ((self, self.packed), (self.silu_mul, self.packed_gated)):
                if (fn, tuple(w.shape)) in seen or w.data_ptr() not in table:
                    continue
                seen.add((fn, tuple(w.shape)))
                x = torch.randn(top, w.shape[1], generator=gen)
                full = fn(x, w)
                for k in sizes:
                    if not torch.equal(fn(x[:k], w), full[:k]):
                        return False
        return True
