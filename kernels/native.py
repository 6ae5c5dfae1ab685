"""Native CPU kernels: C compiled at first use with the system's C compiler, called through ctypes.

Why not TileLang's C target here: its CPU twins are scalar, single-threaded loops (0.3x of torch for
decode attention, benchmarks/kernels.py). Attention over a paged cache with one token per row is a
gather plus a few multiply-adds per byte; written directly in C with OpenMP it reads each key and
value once, where torch must gather them into a copy first.

The library is built once per CPU level (deepinfer_kernels.cpu: ``-march=x86-64-v3`` for avx2,
``x86-64-v4`` for avx512, plain ``x86-64`` for generic; never ``-march=native``, so a level forced
with DEEPINFER_CPU runs the code a CPU of that level runs) with ``-O3 -fopenmp`` into a cache
directory keyed by the source, the compiler and the flags, and written atomically (parallel test workers may race to build it).
Only a verified library is loaded: the directory must be this user's and private (0700), and the
file must be this user's, writable by no one else, with the SHA-256 recorded when it was built;
anything else is rebuilt (see ``_trusted_dir`` and ``_verified``).
``-fopenmp`` links ``libgomp.so.1``: the dynamic loader resolves it to the copy torch has already
loaded, so these loops share torch's OpenMP thread pool and thread count.
If no compiler is found, the CPU is not x86 (the kernels are x86 code) or the build fails, ``load()``
returns None and callers use torch. The loaded library is told the level in force (``di_cpu_set``),
the only CPU knowledge its kernels use at run time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cpu
from .errors import KernelInputError

_CSRC = Path(__file__).with_name("csrc")
_SRCS = sorted(_CSRC.glob("*.c"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast", "-Wno-psabi"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root) / "native"


_private_fallback: Path | None = None


def _trusted_dir() -> Path:
    """The cache directory, if only this user can write it (created 0700; tightened to 0700 when it
    is ours but looser). Otherwise a fresh private temporary directory, with a warning: whoever can
    write the cache directory could plant a library there that this process would load."""
    global _private_fallback
    d = _cache_dir()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            if st.st_mode & 0o077:
                os.chmod(d, 0o700)
            return d
        reason = "is not a directory owned by this user"
    except OSError as e:
        reason = f"cannot be used ({e})"
    if _private_fallback is None:
        _private_fallback = Path(tempfile.mkdtemp(prefix="deepinfer-native-"))  # 0700, ours
        warnings.warn(f"deepinfer_kernels.native: cache directory {d} {reason}; building into "
                      f"{_private_fallback} instead", stacklevel=3)
    return _private_fallback


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(lib: Path) -> bool:
    """The library is ours, writable by no one else, and has the hash recorded when it was built."""
    try:
        st = os.lstat(lib)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
        recorded = lib.with_suffix(".sha256").read_text().strip()
    except OSError:
        return False
    return recorded == _sha256(lib)


def _compile(cc: str, flags: list[str], objs: str, lib: str) -> None:
    """Each source to an object, as many at once as there are cores (one gcc over all of them took
    ~40 s on 2 cores, the AVX-512 bf16 GEMM alone a third of it), then one link."""
    def one(src: Path) -> str:
        obj = os.path.join(objs, src.stem + ".o")
        r = subprocess.run([cc, *flags, "-c", str(src), "-o", obj], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed on {src.name}: {r.stderr.strip()[:2000]}")
        return obj

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        built = list(pool.map(one, _SRCS))
    r = subprocess.run([cc, *flags, *built, "-o", lib, "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cc} failed to link: {r.stderr.strip()[:2000]}")


def _build(cc: str) -> Path:
    src = b"".join(p.name.encode() + p.read_bytes() for p in _SRCS + _HEADERS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags = _FLAGS + cpu.compiler_flags()
    key = hashlib.sha256(src + repr((version, flags)).encode()).hexdigest()[:16]
    out = _trusted_dir() / f"deepinfer_native-{cpu.level()}-{key}.so"
    if _verified(out):
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    objs = tempfile.mkdtemp(dir=out.parent)
    try:
        _compile(cc, flags, objs, tmp)
        os.chmod(tmp, 0o700)
        digest = _sha256(Path(tmp))
        # hash first, then the library, both atomically: a concurrent builder writes identical files
        fd, tmp_hash = tempfile.mkstemp(suffix=".sha256", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp_hash, out.with_suffix(".sha256"))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(objs, ignore_errors=True)
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not _verified(out):  # replaced between our write and now: refuse rather than load it
        raise RuntimeError(f"{out} does not match the hash recorded when it was built")
    return out


def load() -> ctypes.CDLL | None:
    """The compiled library for the CPU level in force, building it on first use; None (with one
    warning) if it cannot be built here. A DEEPINFER_CPU the CPU cannot run raises cpu.CpuLevelError."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        level = cpu.kernel_level()  # raises on a bad DEEPINFER_CPU (before _tried: every caller hears it)
        _tried = True
        why_not = cpu.native_supported()
        if why_not is not None:
            warnings.warn(f"deepinfer_kernels.native: not built: {why_not}", stacklevel=2)
            return None
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            warnings.warn("deepinfer_kernels.native: no C compiler found; using torch attention on CPU", stacklevel=2)
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except Exception as e:  # noqa: BLE001 - any build/load failure means "use torch"
            warnings.warn(f"deepinfer_kernels.native: build failed, using torch attention on CPU ({e})", stacklevel=2)
            return None
        f = lib.di_token_attention_f32
        i64, fp = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [fp, i64, i64, fp, fp, fp, i64, fp, fp, fp, i64, i64, i64, i64, i64, ctypes.c_float]
        f.restype = ctypes.c_int
        lib.di_token_attention_bf16.argtypes = f.argtypes
        lib.di_token_attention_bf16.restype = ctypes.c_int
        lib.di_add_rmsnorm_f32.argtypes = [fp, fp, fp, ctypes.c_float, fp, fp, i64, i64]
        lib.di_add_rmsnorm_f32.restype = ctypes.c_int
        for g in (lib.di_gemm_f32, lib.di_gemm_bf16, lib.di_gemm_f16, lib.di_gemm_bf16dot):
            g.argtypes = [fp, i64, i64, fp, i64, i64, ctypes.c_int, fp, fp, i64]
            g.restype = ctypes.c_int
        lib.di_gemm_bf16dot_level.restype = ctypes.c_int
        lib.di_gemm_bf16dot_set_cap.argtypes = [ctypes.c_int]
        lib.di_gemm_bf16dot_set_cap.restype = None
        lib.di_rope_store_kv_f32.argtypes = [fp, i64, i64, i64, i64, i64, fp, fp, fp, i64, fp, fp, fp, fp, fp,
                                             ctypes.c_float]
        lib.di_rope_store_kv_f32.restype = ctypes.c_int
        lib.di_rope_store_kv_bf16.argtypes = lib.di_rope_store_kv_f32.argtypes
        lib.di_rope_store_kv_bf16.restype = ctypes.c_int
        lib.di_mla_rope_latent_f32.argtypes = [fp, i64, fp, i64, i64, i64, i64, i64, i64, fp, fp, fp,
                                               ctypes.c_float, ctypes.c_int, fp, i64, fp, fp]
        lib.di_mla_rope_latent_f32.restype = ctypes.c_int
        lib.di_mla_rope_latent_bf16.argtypes = lib.di_mla_rope_latent_f32.argtypes
        lib.di_mla_rope_latent_bf16.restype = ctypes.c_int
        lib.di_silu_mul_f32.argtypes = [fp, i64, i64, i64, fp]
        lib.di_silu_mul_f32.restype = ctypes.c_int
        lib.di_argmax_rows_f32.argtypes = [fp, i64, i64, i64, fp]
        lib.di_argmax_rows_f32.restype = ctypes.c_int
        lib.di_fma_peak_f32.argtypes = [i64, fp]
        lib.di_fma_peak_f32.restype = i64
        lib.di_cpu_set.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.di_cpu_set.restype = ctypes.c_int
        if lib.di_cpu_set(level, int(cpu.has("avx512_vnni") or cpu.has("avx_vnni"))) != level:
            warnings.warn(f"deepinfer_kernels.native: the library built for {cpu.level()} refused level {level}; "
                          "using torch", stacklevel=2)
            return None
        _lib = lib
        return _lib


def available() -> bool:
    return load() is not None


_configure_lock = threading.Lock()
_configured: set = set()


def require(configure) -> ctypes.CDLL:
    """The library, with `configure(lib)` (one module's ctypes signatures) applied once; RuntimeError
    when it could not be built. Each kernel module's `_lib()` is this with its own `configure`."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    if configure not in _configured:
        with _configure_lock:
            if configure not in _configured:
                configure(lib)
                _configured.add(configure)
    return lib


# ---- projections: y = x @ W.T on weights packed once into 48-column panels (csrc/gemm.c) ----------
PANEL = 48
# the panels' storage types: fp32, or a 16-bit checkpoint's values as stored (csrc/gemm_bf16.c and
# gemm_f16.c: widened exactly in registers, so the result is bit for bit the fp32 kernel's on the
# widened weights); activations, accumulation and outputs are fp32 in every case
PANEL_DTYPES = {torch.float32: "di_gemm_f32", torch.bfloat16: "di_gemm_bf16", torch.float16: "di_gemm_f16"}
# bf16 panels packed with bf16_dot=True run csrc/gemm_bf16dot.c instead: x rounded to bf16, bf16 x bf16
# products accumulated in fp32 (vdpbf16ps where the CPU has AVX512_BF16): Engine(dtype="bfloat16")
BF16_DOT = "di_gemm_bf16dot"


@dataclass(frozen=True)
class PackedWeight:
    """A weight laid out for `linear` / `gated_linear`: panels [P (x2 when gated), K, 48], in the
    dtype it was packed from (fp32, bf16 or fp16); bf16_dot: bf16 panels computed as bf16 dot products
    (x rounded to bf16), not widened to fp32."""

    panels: torch.Tensor
    n: int  # output columns (gated: of each half)
    k: int  # input features
    gated: bool
    bf16_dot: bool = False


def _panels(w: torch.Tensor) -> torch.Tensor:
    """[P, K, 48] (fp32, fp16), or for bf16 [P, K/2, 48, 2]: rows k and k + 1 of each column side by
    side (K padded to even with zeros), the layout csrc/gemm.c's bf16 build widens with one op."""
    n, k = w.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        w = torch.cat([w, w.new_zeros(p * PANEL - n, k)])
    if w.dtype != torch.bfloat16:
        return w.reshape(p, PANEL, k).transpose(1, 2).contiguous()
    if k % 2:
        w = torch.cat([w, w.new_zeros(p * PANEL, 1)], 1)
    return w.reshape(p, PANEL, -1, 2).transpose(1, 2).contiguous()


def packed_rows(pw: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of the [N, K] weight packed in pw, widened to fp32: [*ids.shape, K]
    (an embedding lookup on a tied LM head's panels)."""
    if pw.gated:
        raise KernelInputError("packed_rows: a gated weight holds two matrices")
    flat = ids.reshape(-1)
    p, c = flat // PANEL, flat % PANEL
    rows = pw.panels[p, :, c] if pw.panels.dim() == 3 else pw.panels[p, :, c, :].flatten(1)[:, : pw.k]
    return rows.float().view(*ids.shape, pw.k)


def _dense_weight(name: str, t: torch.Tensor) -> None:
    if t.dtype not in PANEL_DTYPES or t.device.type != "cpu" or not t.is_contiguous():
        raise KernelInputError(f"{name} must be a contiguous float32, bfloat16 or float16 CPU tensor, "
                               f"got {t.dtype} on {t.device}")


def to_bf16_dot(w: torch.Tensor) -> torch.Tensor:
    """w rounded to bf16 as the bf16-dot kernel reads it: to nearest even (torch's conversion), NaN
    kept, subnormals flushed to a zero of their sign (vdpbf16ps reads subnormal inputs as zero; its
    widening fallback then sees the same values)."""
    b = w.to(torch.bfloat16)
    return torch.where(b.abs() < torch.finfo(torch.bfloat16).tiny, b * 0, b)


def pack_weight(w: torch.Tensor, bf16_dot: bool = False) -> PackedWeight:
    """Pack an [N, K] weight (fp32, bf16 or fp16, kept in that type) for `linear` (a copy: the
    original is not referenced). bf16_dot: rounded to bf16 (`to_bf16_dot`) for csrc/gemm_bf16dot.c."""
    _dense_weight("pack_weight: w", w)
    if w.dim() != 2:
        raise KernelInputError(f"pack_weight: expected a 2-D weight, got shape {tuple(w.shape)}")
    return PackedWeight(_panels(to_bf16_dot(w) if bf16_dot else w), w.shape[0], w.shape[1], False, bf16_dot)


def pack_gated_weight(w: torch.Tensor, bf16_dot: bool = False) -> PackedWeight:
    """Pack a stacked [gate; up] weight [2I, K] for `gated_linear` (gate and up panels interleaved;
    fp32, bf16 or fp16, kept in that type; bf16_dot: as in `pack_weight`)."""
    _dense_weight("pack_gated_weight: w", w)
    if w.dim() != 2 or w.shape[0] % 2:
        raise KernelInputError(f"pack_gated_weight: expected [2I, K], got shape {tuple(w.shape)}")
    if bf16_dot:
        w = to_bf16_dot(w)
    g, u = _panels(w[: w.shape[0] // 2]), _panels(w[w.shape[0] // 2 :])
    return PackedWeight(torch.stack([g, u], 1).flatten(0, 1).contiguous(), w.shape[0] // 2, w.shape[1], True,
                        bf16_dot)


def panel_kernel(pw: PackedWeight) -> str:
    """The library function `linear` / `gated_linear` run pw's panels with (by its panel dtype, or the
    bf16-dot kernel); the decode stack binds the same one."""
    return BF16_DOT if pw.bf16_dot else PANEL_DTYPES[pw.panels.dtype]


def _gemm(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    if x.dim() != 2 or x.shape[1] != pw.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelInputError(f"linear: x must be float32 CPU [M, {pw.k}], got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1 or x.stride(0) < pw.k:
        x = x.contiguous()
    if bias is not None:
        _dense_f32("linear: bias", bias)
        if bias.shape != (pw.n,):
            raise KernelInputError(f"linear: bias {tuple(bias.shape)} does not fit {pw.n} outputs")
    m = x.shape[0]
    y = torch.empty(m, pw.n, dtype=torch.float32)
    if m:
        gemm = getattr(lib, panel_kernel(pw))
        rc = gemm(x.data_ptr(), x.stride(0), m, pw.panels.data_ptr(), pw.k, pw.n, int(pw.gated),
                  bias.data_ptr() if bias is not None else None, y.data_ptr(), pw.n)
        if rc:
            raise MemoryError(f"linear: no memory for x's bf16 copy ({m} x {pw.k})")
    return y


def linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for W packed by `pack_weight`. Every output is one multiply-add chain
    over k in a fixed order, so a row's bits do not depend on M or the other rows."""
    if pw.gated:
        raise KernelInputError("linear: this weight was packed for gated_linear")
    return _gemm(x, pw, bias)


def gated_linear(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [M, I] for [gate; up] packed by `pack_gated_weight`."""
    if not pw.gated:
        raise KernelInputError("gated_linear: this weight was packed for linear")
    return _gemm(x, pw, None)


def bf16_dot_level() -> int:
    """1 where the bf16-dot kernel runs vdpbf16ps (AVX512_BF16), 0 where it runs its widening fallback
    (see csrc/gemm_bf16dot.c), after any `set_bf16_dot_cap`."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    return int(lib.di_gemm_bf16dot_level())


def set_bf16_dot_cap(cap: int | None) -> None:
    """0 forces the bf16-dot kernel's widening fallback (tests, side-by-side runs); None lifts that."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    lib.di_gemm_bf16dot_set_cap(1 if cap is None else int(cap))


KV_DTYPES = (torch.float32, torch.bfloat16)  # the KV-cache dtypes token_attention and rope_store_kv take


def _check_caches(where: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches as the kernels read them: contiguous CPU tensors of one shape, both fp32 or both bf16."""
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise KernelInputError(f"{where}: the caches must be both float32 or both bfloat16, got "
                               f"{k_cache.dtype} and {v_cache.dtype}")
    if k_cache.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError(f"{where}: the caches must be contiguous CPU tensors")
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(f"{where}: the caches differ in shape: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")


def token_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    idx: torch.Tensor,
    row: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H, D]: query token t attends to cache slots idx[row[t], :lens[t]], in order.

    q [T, H, D] fp32 (last dim contiguous); caches [S, Hkv, D] contiguous, both fp32 or both bf16
    (widened exactly as they are read: the fp32 kernel's result on k_cache.float()); idx [R, Lmax],
    row [T], lens [T] int64 with 0 <= lens <= max_len <= Lmax; tokens with lens 0 are skipped
    (their rows of `out`, if given, are left as they are). Batch-invariant by construction (see
    csrc/token_attention.c). Raises KernelInputError on bad inputs, RuntimeError if not built.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    T, H, D = q.shape
    S, Hkv, Dk = k_cache.shape
    if q.dtype != torch.float32 or q.device.type != "cpu" or q.stride(2) != 1:
        raise KernelInputError("token_attention: q must be a float32 CPU tensor with its last dim dense")
    _check_caches("token_attention", k_cache, v_cache)
    if Dk != D or H % Hkv:
        raise KernelInputError(f"token_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    for name, t in (("idx", idx), ("row", row), ("lens", lens)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise KernelInputError(f"token_attention: {name} must be a contiguous int64 tensor")
    if row.shape != (T,) or lens.shape != (T,) or idx.dim() != 2 or max_len > idx.shape[1]:
        raise KernelInputError("token_attention: row/lens must be [T] and max_len <= idx.shape[1]")
    if out is None:
        out = torch.empty(T, H, D, dtype=torch.float32)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise KernelInputError("token_attention: out must be a contiguous float32 tensor shaped like q")
    if T == 0:
        return out
    fn = lib.di_token_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.di_token_attention_f32
    rc = fn(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        idx.data_ptr(), idx.shape[1], row.data_ptr(), lens.data_ptr(), out.data_ptr(),
        T, H, Hkv, D, max_len, float(scale),
    )
    if rc != 0:
        raise MemoryError("token_attention: a thread could not allocate its scratch buffer")
    return out


def rope_store_kv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Rotary embedding + KV-cache write from a fused projection; returns the rotated q [T, H, D].

    qkv [T, (H + 2 Hkv) D] fp32 (rows dense); cos/sin [T, D] (any leading shape with T * D values,
    sin carrying rotate_half's sign: -sin in the first half); slots int64 [T]; caches [S, Hkv, D],
    both fp32 or both bf16 (then k and v are rounded to nearest even as stored: Tensor.to's bits).
    q_norm / k_norm: per-head RMSNorm weights [D] (Qwen3; both or neither), applied to every q and k
    head before the rotation with `add_rmsnorm`'s bits, eps its epsilon.
    The rotated k and the v of token t go to cache slot slots[t]; a slot outside the cache raises
    KernelInputError (the other tokens are still written)."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    T = qkv.shape[0]
    S, Hkv, D = k_cache.shape
    if Hkv != num_kv_heads or qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * Hkv) * D or D % 2:
        raise KernelInputError(f"rope_store_kv: qkv {tuple(qkv.shape)} does not fit {num_heads} heads over caches {tuple(k_cache.shape)}")
    if qkv.dtype != torch.float32 or qkv.stride(1) != 1:
        raise KernelInputError("rope_store_kv: qkv must be float32 with dense rows")
    for name, t in (("cos", cos), ("sin", sin)):
        _dense_f32(f"rope_store_kv: {name}", t)
    _check_caches("rope_store_kv", k_cache, v_cache)
    if cos.numel() != T * D or sin.numel() != T * D:
        raise KernelInputError("rope_store_kv: cos/sin are not [T, D]")
    if slots.dtype != torch.int64 or slots.shape != (T,) or not slots.is_contiguous():
        raise KernelInputError("rope_store_kv: slots must be a contiguous int64 [T] tensor")
    if (q_norm is None) != (k_norm is None):
        raise KernelInputError("rope_store_kv: q_norm and k_norm go together (both or neither)")
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None:
            _dense_f32(f"rope_store_kv: {name}", t)
            if t.numel() != D:
                raise KernelInputError(f"rope_store_kv: {name} has {t.numel()} weights for head dim {D}")
    q = torch.empty(T, num_heads, D, dtype=torch.float32)
    if T:
        fn = lib.di_rope_store_kv_bf16 if k_cache.dtype == torch.bfloat16 else lib.di_rope_store_kv_f32
        rc = fn(qkv.data_ptr(), qkv.stride(0), T, num_heads, Hkv, D, cos.data_ptr(),
                sin.data_ptr(), slots.data_ptr(), S, k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(),
                q_norm.data_ptr() if q_norm is not None else None, k_norm.data_ptr() if k_norm is not None else None,
                eps)
        if rc:
            raise KernelInputError(f"rope_store_kv: a slot is outside the cache's {S} slots")
    return q


def mla_rope_latent(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv_norm: torch.Tensor, eps: float, interleave: bool, slots: torch.Tensor,
                    cache: torch.Tensor, q_full: torch.Tensor, nope: int) -> None:
    """Latent attention's rope and cache write (csrc/mla_rope_latent.c): q [T, H, nope + rope] (rows
    dense), ckv [T, r + rope] (kv_a_proj_with_mqa's output, rows dense), cos / sin [T, rope] (sin
    carrying rotate_half's sign); writes each head's rotated rope part to q_full[:, :, r:] ([T, H, r + rope]
    contiguous fp32) and rmsnorm(ckv[:, :r]) * kv_norm | rotated ckv[:, r:] to cache[slots] ([S, 1, r + rope],
    fp32 or bf16). interleave: DeepSeek's interleaved rope pairs, reordered to rotate-half first. A slot
    outside the cache raises KernelInputError (the other tokens are still written)."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    T, H, qk = q.shape
    S, one, E = cache.shape
    rope = qk - nope
    r = E - rope
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != qk or ckv.dtype != torch.float32 \
            or ckv.stride(-1) != 1 or tuple(ckv.shape) != (T, E):
        raise KernelInputError(f"mla_rope_latent: q {tuple(q.shape)} / ckv {tuple(ckv.shape)} do not fit a cache "
                               f"entry of {E} with a rope part of {rope} (float32, dense rows)")
    if one != 1 or r <= 0 or rope <= 0 or rope % 2 or not cache.is_contiguous() or cache.dtype not in KV_DTYPES:
        raise KernelInputError(f"mla_rope_latent: the cache must be contiguous [S, 1, r + rope] float32 or bfloat16, "
                               f"got {cache.dtype} {tuple(cache.shape)} for a rope part of {rope}")
    if q_full.dtype != torch.float32 or not q_full.is_contiguous() or tuple(q_full.shape) != (T, H, E):
        raise KernelInputError(f"mla_rope_latent: q_full must be contiguous float32 {(T, H, E)}")
    for name, t in (("cos", cos), ("sin", sin), ("kv_norm", kv_norm)):
        _dense_f32(f"mla_rope_latent: {name}", t)
    if cos.numel() != T * rope or sin.numel() != T * rope or kv_norm.numel() != r:
        raise KernelInputError("mla_rope_latent: cos/sin are not [T, rope] or kv_norm not [r]")
    if slots.dtype != torch.int64 or slots.shape != (T,) or not slots.is_contiguous():
        raise KernelInputError("mla_rope_latent: slots must be a contiguous int64 [T] tensor")
    if T:
        fn = lib.di_mla_rope_latent_bf16 if cache.dtype == torch.bfloat16 else lib.di_mla_rope_latent_f32
        rc = fn(q.data_ptr(), q.stride(0), ckv.data_ptr(), ckv.stride(0), T, H, nope, rope, r, cos.data_ptr(),
                sin.data_ptr(), kv_norm.data_ptr(), eps, int(interleave), slots.data_ptr(), S, cache.data_ptr(),
                q_full.data_ptr())
        if rc:
            raise KernelInputError(f"mla_rope_latent: a slot is outside the cache's {S} slots")


def token_attention_reference(q, k_cache, v_cache, idx, row, lens, scale, max_len=None) -> torch.Tensor:
    """torch definition of token_attention (one softmax per query token and head)."""
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty(T, H, D, dtype=q.dtype)
    for t in range(T):
        slots = idx[row[t], : lens[t]]
        k = k_cache[slots].repeat_interleave(H // Hkv, dim=1)  # [L, H, D]
        v = v_cache[slots].repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[t].double(), k.double()) * scale
        out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v.double()).to(q.dtype)
    return out


def _dense_f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise KernelInputError(f"{name} must be a contiguous float32 CPU tensor")


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); residual None: (rmsnorm(x) * weight, x).
    Row by row in a fixed order (batch-invariant); x [M, D] fp32 CPU."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    x = x.contiguous()
    _dense_f32("add_rmsnorm: x", x)
    _dense_f32("add_rmsnorm: weight", weight)
    if residual is not None:
        residual = residual.contiguous()
        _dense_f32("add_rmsnorm: residual", residual)
        if residual.shape != x.shape:
            raise KernelInputError("add_rmsnorm: x and residual differ in shape")
    D = x.shape[-1]
    if weight.shape != (D,):
        raise KernelInputError(f"add_rmsnorm: weight {tuple(weight.shape)} does not fit rows of {D}")
    M = x.numel() // D if D else 0
    out = torch.empty(x.shape, dtype=x.dtype)  # (empty_like would copy odd strides of size-1 dims)
    res = torch.empty(x.shape, dtype=x.dtype) if residual is not None else x
    if M:
        lib.di_add_rmsnorm_f32(
            x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), float(eps),
            out.data_ptr(), res.data_ptr() if residual is not None else None, M, D,
        )
    return out, res


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of fp32 CPU logits [M, N] with dense rows, exactly (the first index of a
    row's maximum; the first NaN's where it has one), in two vectorised passes (csrc/argmax.c)."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
        raise KernelInputError(f"argmax_rows: x must be float32 CPU [M, N] with dense rows, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise KernelInputError("argmax_rows: rows of length 0 have no argmax")
    out = torch.empty(x.shape[0], dtype=torch.long)
    if x.shape[0]:
        lib.di_argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [M, I] from a fused gate|up projection's output gu [M, 2I] (fp32 CPU, rows
    dense), element by element (csrc/silu_mul.c: within a few ulp of F.silu(g) * u)."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.dtype != torch.float32 or gu.device.type != "cpu" or gu.stride(1) != 1:
        raise KernelInputError(f"silu_mul: gu must be float32 CPU [M, 2I] with dense rows, got {gu.dtype} {tuple(gu.shape)}")
    m, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(m, inter, dtype=torch.float32)
    if m and inter:
        lib.di_silu_mul_f32(gu.data_ptr(), gu.stride(0), m, inter, out.data_ptr())
    return out


def fma_peak(seconds: float = 0.2, repeats: int = 3) -> float:
    """This CPU's fp32 multiply-add peak in GFLOP/s on torch's threads (csrc/fma_peak.c: register-only
    FMA chains, the best of `repeats` runs of about `seconds` each): the ceiling any fp32 kernel here
    runs under. benchmarks/moe.py sets model-FLOP rates against it."""
    lib = load()
    if lib is None:
        raise RuntimeError("deepinfer_kernels.native is not available (no C compiler or build failed)")
    if not seconds > 0 or repeats < 1:
        raise KernelInputError(f"fma_peak: seconds must be > 0 and repeats >= 1, got {seconds}, {repeats}")
    total = ctypes.c_double()

    def run(iters: int) -> float:
        t = time.perf_counter()
        flops = lib.di_fma_peak_f32(iters, ctypes.byref(total))
        dt = time.perf_counter() - t
        # every chain converges to 2 (csrc/fma_peak.c): 2 x 16 lanes x 12 chains per thread
        threads = flops // (2 * 16 * 12 * iters)
        if total.value != 2.0 * 16 * 12 * threads:
            raise RuntimeError(f"fma_peak: the FMA loop's checksum is {total.value}, expected {2.0 * 16 * 12 * threads}")
        return flops / max(dt, 1e-9) / 1e9

    iters = 1 << 16
    while True:  # calibrate: double until a run takes a tenth of the target
        t = time.perf_counter()
        run(iters)
        if time.perf_counter() - t > seconds / 10 or iters >= 1 << 40:
            break
        iters *= 2
    iters = max(int(iters * seconds / max(time.perf_counter() - t, 1e-9)), 64)
    return max(run(iters) for _ in range(repeats))
