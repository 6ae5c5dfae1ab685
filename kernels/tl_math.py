"""Per-element maths shared by the GPU kernels and their CPU twins (TileLang macros).

This is the TileLang twin of the portable section of kernels/rng.py: the same operations in
the same order, each rounded to float32 once. On CUDA every float op goes through an
explicitly rounded intrinsic (__fadd_rn, ...) so nvcc cannot contract a*b+c into an FMA; on
the C target the kernels are built with -ffp-contract=off for the same reason. The GPU kernel
and the CPU twin call the very same macros, so the CPU tests check the GPU maths too.
"""

from __future__ import annotations

from types import SimpleNamespace

from . import _tilelang
from . import rng
from .inverse_cdf import UNIFORM_SALT


# Every CPU-twin kernel that uses these macros passes this as T.Kernel(..., prelude=C_PRELUDE).
C_PRELUDE = """
#include <string.h>
extern "C" inline float dk_f32_from_bits(int32_t b) { float f; memcpy(&f, &b, 4); return f; }
"""


def make_math(cuda: bool) -> SimpleNamespace:
    """Macros for one backend: hashing, portable log, Gumbel noise, sampling score, RMS scaling."""
    if _tilelang.tilelang() is None:  # also points TileLang's cache dir before the import below
        raise RuntimeError(f"tilelang is not importable: {_tilelang.import_error()}")
    import tilelang.language as T  # noqa: PLC0415 - optional dependency
    f32 = "float32"

    def fadd(a, b):
        return T.call_extern(f32, "__fadd_rn", a, b) if cuda else a + b

    def fsub(a, b):
        return T.call_extern(f32, "__fsub_rn", a, b) if cuda else a - b

    def fmul(a, b):
        return T.call_extern(f32, "__fmul_rn", a, b) if cuda else a * b

    def fdiv(a, b):
        return T.call_extern(f32, "__fdiv_rn", a, b) if cuda else a / b

    def c(x):
        # The C codegen prints float literals with 7 significant digits, which does not
        # round-trip (1/3, 2**-23 come back as other floats), so C kernels rebuild each
        # constant from its bit pattern through C_PRELUDE's helper. CUDA prints exact hex floats.
        if cuda:
            return T.float32(x)
        return T.call_extern(f32, "dk_f32_from_bits", T.int32(rng.f32_bits(x)))

    # Intermediates live in T.alloc_var cells rather than let-bindings: TileLang inlines lets
    # (fatally so inside T.Parallel on CUDA), and every reused value would then be recomputed,
    # doubling the expression per hash round (a 27 s lowering and a huge kernel).
    @T.macro
    def hash32(x):
        y = T.alloc_var("uint32")
        y = x ^ (x >> T.uint32(16))
        y = y * T.uint32(0x7FEB352D)
        y = y ^ (y >> T.uint32(15))
        y = y * T.uint32(0x846CA68B)
        y = y ^ (y >> T.uint32(16))
        return y

    @T.macro
    def log(x):
        # Integer steps in uint32, where wrap-around is defined behaviour in C/CUDA (the
        # simplifier regroups these sums, and int32 intermediates could overflow).
        bits = T.alloc_var("uint32")
        e = T.alloc_var("uint32")
        m = T.alloc_var(f32)
        f = T.alloc_var(f32)
        s = T.alloc_var(f32)
        z = T.alloc_var(f32)
        r = T.alloc_var(f32)
        kf = T.alloc_var(f32)
        bits = T.reinterpret(x, "uint32")
        e = (bits + T.uint32(rng.LOG_EXP_BIAS)) >> T.uint32(23)
        m = T.reinterpret(bits - ((e - T.uint32(127)) << T.uint32(23)), f32)
        kf = T.Cast(f32, T.Cast("int32", e) - 127)
        f = fsub(m, c(1.0))
        s = fdiv(f, fadd(f, c(2.0)))
        z = fmul(s, s)
        r = fmul(z, fadd(c(rng.LOG_C3), fmul(z, fadd(c(rng.LOG_C5), fmul(z, fadd(c(rng.LOG_C7), fmul(z, c(rng.LOG_C9))))))))
        s = fadd(s, s)
        r = fadd(s, fmul(s, r))
        return fadd(fmul(kf, c(rng.LN2_HI)), fadd(r, fmul(kf, c(rng.LN2_LO))))

    @T.macro
    def gumbel_from_hash(h):
        u = T.alloc_var(f32)
        t = T.alloc_var(f32)
        u = fmul(fadd(T.Cast(f32, h >> T.uint32(32 - rng.UNIFORM_BITS)), c(0.5)), c(1.0 / (1 << rng.UNIFORM_BITS)))
        t = -log(u)
        return -log(t)

    @T.macro
    def gumbel(key, token):
        # key: uint32 row key; token: int32 index. Same hashing as rng.gumbel_portable_from_keys.
        th = hash32(T.Cast("uint32", token) + T.uint32(rng.TOKEN_SALT))
        return gumbel_from_hash(hash32(key ^ th))

    @T.macro
    def sample_score(logit, temp, key, token):
        # temp > 0 only; greedy rows compare raw logits (the caller branches once per row).
        return fadd(fdiv(logit, temp), gumbel(key, token))

    @T.macro
    def uniform64(key):
        # inverse_cdf.row_uniform: ((hash32(key ^ salt) >> 8) + 0.5) / 2**24 as (2k + 1) / 2**25,
        # built from integer casts only (exact; float64 literals need not print exactly in C)
        h = T.alloc_var("uint32")
        h = hash32(key ^ T.uint32(UNIFORM_SALT))
        return T.Cast("float64", (h >> T.uint32(8)) * T.uint32(2) + T.uint32(1)) / T.Cast("float64", T.int32(1 << 25))

    @T.macro
    def inv_rms(sumsq, n, eps):
        # rsqrt(mean + eps); 1/sqrt is correctly rounded on both backends, rsqrtf is not.
        return fdiv(c(1.0), T.sqrt(fadd(fdiv(sumsq, c(float(n))), c(eps))))

    @T.macro
    def rms_scale(h, inv, w):
        return fmul(fmul(h, inv), w)

    @T.macro
    def rescale(m_old, m_new):
        # exp(m_old - m_new) with exp(-inf - -inf) taken as 0 (an empty state has nothing to scale).
        return T.if_then_else(m_old == -T.infinity(f32), c(0.0), T.exp(fsub(m_old, m_new)))

    return SimpleNamespace(
        rescale=rescale, c=c,
        inv_rms=inv_rms, rms_scale=rms_scale,
        hash32=hash32, log=log, gumbel_from_hash=gumbel_from_hash, gumbel=gumbel,
        sample_score=sample_score, uniform64=uniform64, fadd=fadd, fsub=fsub, fmul=fmul, fdiv=fdiv,
    )
