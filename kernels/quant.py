"""Block-quantised weights (GGUF's Q4_0, Q4_1, Q8_0, and the k-quants Q4_K, Q6_K) kept as stored, and
the native kernels over them (csrc/qgemm*.c, built with the other native kernels by `native.load`).

A `QuantWeight` is an [N, K] matrix as N rows of ggml blocks (K / 32 blocks, or K / 256 super-blocks
for the k-quants; uint8 [N, row_bytes]): the bytes of the GGUF file, unchanged. `qlinear` computes
x @ W.T on them:

* ``mode="int8"``: activations quantised per 32-block to int8, integer dot products (AVX2
  maddubs/madd, or VNNI's vpdpbusd where the CPU has AVX-512 VNNI: the same sums), fp32 accumulation
  (llama.cpp's scheme);
* ``mode="exact"``: each block dequantised to fp32 in registers against fp32 activations (equal to
  dequantise-then-fp32 up to the summation order).

Both have one fixed reduction order per output element, so a row's result does not depend on the
batch. From PANEL_M rows on, the exact mode runs csrc/qgemm_panel.c (weights dequantised three rows
at a time into L1, a 2 x 3 register tile sweeping the rows), bit-identical to the row kernel;
`qlinear_int8_outer` is the int8 mode's many-row kernel (csrc/qgemm_i8_outer.c with AVX512_VNNI, else
csrc/qgemm_i8_outer_avx2.c: vpmaddubsw, AVX-VNNI where built; `int8_outer_kernel` says which), also
bit-identical to its row kernel.
`pack` is this module's own encoder of the formats (tests; round-trip checked against
`dequantize_reference`, a torch transcription of the formats' definitions).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import native, quant_k
from .errors import KernelInputError

QK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids (GGMLQuantizationType)
Q4_K, Q6_K = quant_k.Q4_K, quant_k.Q6_K
# type id -> (name, bytes per block, elements per block)
FORMATS = {Q4_0: ("Q4_0", 18, QK), Q4_1: ("Q4_1", 20, QK), Q8_0: ("Q8_0", 34, QK),
           Q4_K: ("Q4_K", 144, quant_k.QK_K), Q6_K: ("Q6_K", 210, quant_k.QK_K)}
MODES = ("int8", "exact")
# rows from which the exact mode runs the panel kernel (same bits as the row kernel): at 16 rows, 1
# thread, it took 2.46 ms vs the row kernel's 3.11 (Q4_1 3072 x 576), 0.46 vs 0.62 (960 x 576), 0.63
# vs 0.85 (Q4_K 576 x 1536) (benchmarks/quant_kernels.py, under load)
PANEL_M = 16


def _configure(lib) -> None:
    i64, fp, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.di_qgemm.argtypes = [i32, i32, fp, i64, fp, fp, fp, i64, fp, i64, i32, i64, i64, fp, i64]
    lib.di_qgemm.restype = i32
    lib.di_q8_quantize_rows.argtypes = [fp, i64, i64, i64, fp, fp, fp]
    lib.di_q8_quantize_rows.restype = i32
    lib.di_q_dequant_rows.argtypes = [fp, i64, i32, i64, fp, i64, fp]
    lib.di_q_dequant_rows.restype = i32
    lib.di_q_cpu_level.restype = i32
    lib.di_q_set_level_cap.argtypes = [i32]
    lib.di_q_set_level_cap.restype = None
    lib.di_qgemm_panel.argtypes = [fp, i64, i64, fp, i64, i32, i64, i64, fp, i64]
    lib.di_qgemm_panel.restype = i32
    lib.di_qgemm_exact_bound.argtypes = [ctypes.POINTER(i64), fp, i64, fp]
    lib.di_qgemm_exact_bound.restype = i32
    lib.di_qgemm_int8_bound.argtypes = [ctypes.POINTER(i64), fp, i64, fp]
    lib.di_qgemm_int8_bound.restype = i32
    lib.di_qgemm_outer.argtypes = [fp, i64, i64, fp, i64, i32, i64, i64, fp, i64]
    lib.di_qgemm_outer.restype = i32
    lib.di_qgemm_outer_bf16.argtypes = [fp, i64, i64, fp, i64, i32, i64, i64, fp, i64]
    lib.di_qgemm_outer_bf16.restype = i32
    lib.di_qgemm_outer_i8.argtypes = [fp, i64, i64, fp, i64, i32, i64, i64, fp, i64]
    lib.di_qgemm_outer_i8.restype = i32
    lib.di_qgemm_outer_i8_ready.argtypes = [i32]
    lib.di_qgemm_outer_i8_ready.restype = i32


def _lib():
    return native.require(_configure)


def available() -> bool:
    return native.available()


def cpu_level() -> int:
    """The instruction-set level the kernels use: the CPU level in force (deepinfer_kernels.cpu.kernel_level:
    3 avx512 with AVX512_BF16 (the bf16 kernel, `qlinear_bf16`), 2 avx512, 1 avx2, 0 generic: only the
    scalar code), at most the cap `set_level_cap` set."""
    return int(_lib().di_q_cpu_level())


def set_level_cap(level: int | None) -> None:
    """Cap the level every quantised kernel uses (None: all the CPU has, the default); e.g. 1 runs the
    AVX2 code on an AVX-512 host, 2 makes `qlinear_bf16` fall back to `qlinear_outer`, for tests (the two must give the same bits) and side-by-side
    measurements. Process-wide."""
    if level is not None and (not isinstance(level, int) or level < 0):
        raise KernelInputError(f"set_level_cap: level must be None or an int >= 0, got {level!r}")
    _lib().di_q_set_level_cap(99 if level is None else level)


@dataclass(frozen=True)
class QuantWeight:
    """[n, k] weights as ggml blocks: data uint8 [n, k / block elements * block bytes], contiguous."""

    data: torch.Tensor
    fmt: int
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise KernelInputError(f"QuantWeight: unsupported block format {self.fmt} (have {sorted(FORMATS)})")
        _, bb, be = FORMATS[self.fmt]
        if self.k % be or self.k <= 0:
            raise KernelInputError(f"QuantWeight: K = {self.k} is not a positive multiple of {be} "
                                   f"({FORMATS[self.fmt][0]}'s block)")
        rb = self.k // be * bb
        d = self.data
        if d.dtype != torch.uint8 or d.device.type != "cpu" or tuple(d.shape) != (self.n, rb) or not d.is_contiguous():
            raise KernelInputError(f"QuantWeight: data must be contiguous uint8 CPU [{self.n}, {rb}], got "
                                   f"{d.dtype} {tuple(d.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def format_name(self) -> str:
        return FORMATS[self.fmt][0]


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Row-wise concatenation (fused q|k|v, gate|up) of weights of one format and width."""
    if len({(p.fmt, p.k) for p in parts}) != 1:
        raise KernelInputError("cat_rows: parts differ in format or width")
    return QuantWeight(torch.cat([p.data for p in parts]), parts[0].fmt, sum(p.n for p in parts), parts[0].k)


def _check_x(name: str, x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelInputError(f"{name}: x must be float32 CPU [M, {k}], got {x.dtype} {tuple(x.shape)}")
    return x if x.stride(1) == 1 and x.stride(0) >= k else x.contiguous()


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, mode: str = "int8",
            level: int = 1, out: torch.Tensor | None = None, panel: bool | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias) -> [M, N] fp32. level 0 forces the scalar code (tests).
    panel (exact mode, AVX2): None = from PANEL_M rows on; True / False force it (tests, benchmarks)."""
    if mode not in MODES:
        raise KernelInputError(f"qlinear: mode must be one of {MODES}, got {mode!r}")
    lib = _lib()
    x = _check_x("qlinear", x, w.k)
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, w.n, dtype=torch.float32)
    elif out.shape != (m, w.n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise KernelInputError(f"qlinear: out must be float32 [{m}, {w.n}] with dense rows")
    if m:
        rb = w.data.shape[1]
        use_panel = mode == "exact" and level >= 1 and (m >= PANEL_M if panel is None else panel)
        # the panel kernel refuses (1) without AVX2: the row kernel below then runs
        rc = 1 if not use_panel else lib.di_qgemm_panel(x.data_ptr(), x.stride(0), m, w.data.data_ptr(), rb, w.fmt,
                                                        w.n, w.k, out.data_ptr(), out.stride(0))
        if not rc:
            pass
        elif mode == "int8":
            qx, xs, xsum = quantize_activations(x)
            rc = lib.di_qgemm(1, level, None, 0, qx.data_ptr(), xs.data_ptr(), xsum.data_ptr(), m, w.data.data_ptr(),
                              rb, w.fmt, w.n, w.k, out.data_ptr(), out.stride(0))
        else:
            rc = lib.di_qgemm(0, level, x.data_ptr(), x.stride(0), None, None, None, m, w.data.data_ptr(), rb, w.fmt,
                              w.n, w.k, out.data_ptr(), out.stride(0))
        if rc:
            raise KernelInputError(f"qlinear: the kernel refused format {w.fmt} with K = {w.k}")
    return _add_bias("qlinear", out, bias)


def _add_bias(name: str, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        if bias.shape != (out.shape[1],):
            raise KernelInputError(f"{name}: bias {tuple(bias.shape)} does not fit {out.shape[1]} outputs")
        out += bias
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 mode's activations for x [M, K] fp32 (K a multiple of 32): per 32-block b of row r,
    scale s = max|x| / 127, q = round-half-even(x * (1 / s)) as int8 [M, K], scale [M, K / 32] and
    s * sum(q) [M, K / 32] (Q4_1's min term)."""
    if x.dim() != 2 or x.shape[1] % QK or x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelInputError(f"quantize_activations: x must be float32 CPU [M, K] with K a multiple of {QK}, "
                               f"got {x.dtype} {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    qx = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, k // QK, dtype=torch.float32)
    xsum = torch.empty(m, k // QK, dtype=torch.float32)
    if m:
        _lib().di_q8_quantize_rows(x.data_ptr(), x.stride(0), m, k, qx.data_ptr(), xs.data_ptr(), xsum.data_ptr())
    return qx, xs, xsum


class RowKernel:
    """x [M, K] -> x @ W.T for one weight below PANEL_M rows (decode), in the exact or the int8 mode,
    the kernel's arguments bound once (csrc/qgemm.c's di_qgemm_exact_bound / di_qgemm_int8_bound, the
    latter quantising x itself): a batch-1 step makes ~120 of these calls, and qlinear's checks, its
    three scratch tensors and ctypes' conversion of 15 arguments cost more than the kernel on the
    small projections. Same kernels, same bits as `qlinear(x, w, mode=mode)`. Other inputs (not
    dense float32 CPU, PANEL_M+ rows) go through `qlinear`."""

    def __init__(self, w: QuantWeight, mode: str = "exact"):
        if mode not in MODES:
            raise KernelInputError(f"RowKernel: mode must be one of {MODES}, got {mode!r}")
        self.w = w
        self.mode = mode
        lib = _lib()
        self._call = lib.di_qgemm_exact_bound if mode == "exact" else lib.di_qgemm_int8_bound
        # W's address is bound here: w.data must not be replaced (QuantWeight is frozen)
        self._wargs = (ctypes.c_int64 * 5)(w.data.data_ptr(), w.data.shape[1], w.fmt, w.n, w.k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu or not x.is_contiguous() or not 0 < x.shape[0] < PANEL_M:
            return qlinear(x, w, mode=self.mode)
        if x.shape[1] != w.k:
            raise KernelInputError(f"qlinear: x must be float32 CPU [M, {w.k}], got {x.dtype} {tuple(x.shape)}")
        m = x.shape[0]
        out = torch.empty(m, w.n, dtype=torch.float32)
        if self._call(self._wargs, x.data_ptr(), m, out.data_ptr()):
            raise KernelInputError(f"qlinear: the kernel refused format {w.fmt} with K = {w.k}")
        return out


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [len(ids), K]: rows ids of W (an embedding lookup); ids outside [0, N) raise."""
    lib = _lib()
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.n):
        raise KernelInputError(f"dequantize_rows: a row id is outside [0, {w.n})")
    out = torch.empty(ids.numel(), w.k, dtype=torch.float32)
    if ids.numel():
        lib.di_q_dequant_rows(w.data.data_ptr(), w.data.shape[1], w.fmt, w.k, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The whole matrix as fp32 [N, K] (native)."""
    return dequantize_rows(w, torch.arange(w.n))


# ---- the formats' definitions in torch: reference decoder and this project's encoder -------------
def _halves(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def dequantize_reference(w: QuantWeight) -> torch.Tensor:
    """fp32 [N, K] decoded in torch from the block layouts (the reference for the kernels)."""
    _, bb, be = FORMATS[w.fmt]
    if be != QK:
        return quant_k.dequantize(w.data, w.fmt, w.n, w.k)
    blocks = w.data.view(w.n, w.k // QK, bb)
    d = _halves(blocks[..., 0:2])  # [N, nb, 1]
    if w.fmt == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(w.n, w.k)
    qs = blocks[..., 4:] if w.fmt == Q4_1 else blocks[..., 2:]
    q = torch.cat([qs & 0xF, qs >> 4], -1).float()  # element j: low nibble of byte j; j + 16: high
    if w.fmt == Q4_0:
        return ((q - 8) * d).reshape(w.n, w.k)
    return (q * d + _halves(blocks[..., 2:4])).reshape(w.n, w.k)


def pack(w: torch.Tensor, fmt: int) -> QuantWeight:
    """Encode an fp32 [N, K] matrix (K a multiple of the block) in `fmt` (round to nearest per block)."""
    if fmt not in FORMATS:
        raise KernelInputError(f"pack: unsupported block format {fmt}")
    be = FORMATS[fmt][2]
    if w.dim() != 2 or w.shape[1] % be:
        raise KernelInputError(f"pack: expected [N, K] with K a multiple of {be}, got {tuple(w.shape)}")
    n, k = w.shape
    if be != QK:
        return QuantWeight(quant_k.pack(w, fmt), fmt, n, k)
    b = w.float().reshape(n, k // QK, QK)

    def half_bytes(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [N, nb, 2]

    if fmt == Q8_0:
        d = (b.abs().amax(-1) / 127).to(torch.float16).float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (b * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        raw = torch.cat([half_bytes(d), q], -1)
    elif fmt == Q4_0:
        idx = b.abs().argmax(-1, keepdim=True)
        d = (b.gather(-1, idx).squeeze(-1) / -8).to(torch.float16).float()  # the signed max maps to -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = ((b * inv.unsqueeze(-1)).round() + 8).clamp(0, 15).to(torch.uint8)
        raw = torch.cat([half_bytes(d), q[..., :16] | (q[..., 16:] << 4)], -1)
    else:
        lo, hi = b.amin(-1), b.amax(-1)
        d = ((hi - lo) / 15).to(torch.float16).float()
        m = lo.to(torch.float16).float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((b - m.unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        raw = torch.cat([half_bytes(d), half_bytes(m), q[..., :16] | (q[..., 16:] << 4)], -1)
    return QuantWeight(raw.reshape(n, -1).contiguous(), fmt, n, k)


# ---- many rows, default mode: dequantised 16-row panels and an outer-product tile (csrc/qgemm_outer.c)
def qlinear_outer(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias) through csrc/qgemm_outer.c: one fixed order per output whatever M
    (so a row does not depend on the batch), but not the row kernels' order: for the default mode at
    PANEL_M+ rows, not the batch-invariant one. Without AVX2 it runs `qlinear`'s exact mode."""
    return _outer("qlinear_outer", _lib().di_qgemm_outer, x, w, bias, lambda: qlinear(x, w, bias, mode="exact"))


def _outer(name: str, kernel, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, fallback) -> torch.Tensor:
    """One of the many-row kernels (same arguments) on x [M, K] fp32, or `fallback()` where it refuses."""
    x = _check_x(name, x, w.k)
    m = x.shape[0]
    out = torch.empty(m, w.n, dtype=torch.float32)
    if m and kernel(x.data_ptr(), x.stride(0), m, w.data.data_ptr(), w.data.shape[1], w.fmt, w.n, w.k,
                    out.data_ptr(), out.stride(0)):
        return fallback()
    return _add_bias(name, out, bias)


# ---- many rows in bf16 products (csrc/qgemm_bf16.c) ----------------------------------------------------
def qlinear_bf16(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias) with x and the dequantised weights rounded to bf16 (nearest even) and
    multiplied by AVX512_BF16's vdpbf16ps, accumulated in fp32 (csrc/qgemm_bf16.c): one fixed order per
    output whatever M, so a row does not depend on the batch. Where the CPU lacks AVX512_BF16
    (`cpu_level()` below 3) it runs `qlinear_outer` (exact fp32 products) instead."""
    return _outer("qlinear_bf16", _lib().di_qgemm_outer_bf16, x, w, bias, lambda: qlinear_outer(x, w, bias))


# ---- many rows in the int8 mode (csrc/qgemm_i8_outer.c, csrc/qgemm_i8_outer_avx2.c) ------------------
# di_qgemm_outer_i8_ready's answers: the kernel qlinear_int8_outer runs for a format at the level in force
INT8_OUTER_KERNELS = {0: None, 1: "avx2", 2: "avx_vnni", 3: "avx512_vnni"}


def int8_outer_kernel(w: QuantWeight) -> str | None:
    """Which kernel `qlinear_int8_outer` runs for w's format at the level in force (`cpu_level()`, the cap
    of `set_level_cap` included): "avx512_vnni" (level 2+ with AVX512_VNNI: zmm vpdpbusd tiles,
    csrc/qgemm_i8_outer.c), "avx_vnni" (level 1+ where the build has AVX-VNNI: ymm vpdpbusd) or "avx2"
    (level 1+ otherwise: vpmaddubsw / vpmaddwd; both csrc/qgemm_i8_outer_avx2.c), None where it runs the
    row kernel instead (level 0, or a k-quant: Q4_0 / Q4_1 / Q8_0 only). All give the row kernel's bits."""
    return INT8_OUTER_KERNELS[int(_lib().di_qgemm_outer_i8_ready(w.fmt))]


def int8_outer_ready(w: QuantWeight) -> bool:
    """True where `qlinear_int8_outer` runs one of its own kernels for w's format (`int8_outer_kernel`):
    Q4_0 / Q4_1 / Q8_0 at `cpu_level()` 1 (AVX2) or more."""
    return int8_outer_kernel(w) is not None


def qlinear_int8_outer(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias) in the int8 mode as an outer product of integer register tiles
    (`int8_outer_kernel`: vpdpbusd with AVX512_VNNI, csrc/qgemm_i8_outer.c; vpmaddubsw / vpmaddwd or
    AVX-VNNI on AVX2, csrc/qgemm_i8_outer_avx2.c): `qlinear(mode="int8")`'s result bit for bit (the same
    activation quantisation, the same integer block sums and fp32 combination order), so a row's bits do
    not depend on M or on which of them ran it. Where `int8_outer_ready(w)` is False it runs that row
    kernel."""
    return _outer("qlinear_int8_outer", _lib().di_qgemm_outer_i8, x, w, bias, lambda: qlinear(x, w, bias, mode="int8"))
