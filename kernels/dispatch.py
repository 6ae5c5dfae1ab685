"""Pick, per (op, device), the implementation of each custom kernel, and run it.

Backends: "torch" (the reference implementations, always available), "tilelang" (the TileLang
kernels: GPU-style on CUDA, the target="c" twins on CPU) and "auto" (the default). Select with
the environment variable DEEPINFER_KERNELS=torch|tilelang|auto, or within a block with
use_backend("torch"), which wins over the variable.

"auto" reads AUTO_TABLE, a static table filled from benchmarks/kernels.py rather than a
runtime timing probe: a probe would add compile + timing work at start-up, its result on a
busy shared CPU is noise-prone, and the ratios below are large and stable. On CUDA the
TileLang kernels are chosen (one fused pass instead of several torch launches). On CPU the
twin is chosen only where it measured faster than torch (figures in AUTO_TABLE's comment).

Under "auto", a TileLang failure (not installed, build error) falls back to torch with one
warning and is remembered for that (op, device kind). Under "tilelang" failures propagate,
so tests cannot silently compare torch with itself. Kernels compile on first use per shape
class (sizes that vary per step are dynamic); call warmup() at start-up to keep compilation
off the per-step path.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

from . import _tilelang, paged_attention, rmsnorm, sampling
from .errors import KernelConfigError

BACKENDS = ("torch", "tilelang", "auto")
OPS = ("masked_sample", "fused_add_rmsnorm", "paged_decode_attention")
ENV_VAR = "DEEPINFER_KERNELS"

# (op, device type) -> backend under "auto". CPU rows from benchmarks/kernels.py on the shared
# 2-core dev box (medians; torch time / twin time, > 1 = twin faster; the box was loaded, so
# single rows are noisy, the pattern is not):
#   masked_sample: sampled rows x13-41 at V=49152, B=1/8/64 (the twin fuses the ~30 elementwise
#     passes of the portable noise and skips masked tokens); greedy rows x0.1-4 (noise-level).
#     (Measured for the earlier Gumbel-max draw; the inverse-CDF draw has not been re-measured.
#     The engine calls this op only on its CUDA fused route, engine/sampler.py.)
#   fused_add_rmsnorm: x0.4-0.7 at hidden 576/4096, B=1..64 (torch's vectorised ops win over
#     the scalar C loop), so torch.
#   paged_decode_attention: x0.3 at B=1, x0.9-1.3 at B=8/64 (ctx 512): no clear win for the
#     serial twin, so the simpler multi-threaded torch path.
# CUDA rows from the same script on an H200 (torch / kernel, per-call times of 0.04-3 ms that
# include TileLang's host-side launch cost): masked_sample x2.7-4.1 greedy, x25-28 sampled;
# fused_add_rmsnorm x2.4-4.2 (fp32 and bf16); paged_decode_attention x1.9-9.2.
AUTO_TABLE: dict[tuple[str, str], str] = {
    ("masked_sample", "cuda"): "tilelang",
    ("fused_add_rmsnorm", "cuda"): "tilelang",
    ("paged_decode_attention", "cuda"): "tilelang",
    ("masked_sample", "cpu"): "tilelang",
    ("fused_add_rmsnorm", "cpu"): "torch",
    ("paged_decode_attention", "cpu"): "torch",
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("deepinfer_kernels_backend", default=None)
_failed: set[tuple[str, str]] = set()


def _check_backend(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise KernelConfigError(f"{source} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def requested_backend() -> str:
    """The backend asked for: use_backend()'s, else $DEEPINFER_KERNELS, else "auto"."""
    o = _override.get()
    if o is not None:
        return o
    return _check_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend ("torch", "tilelang" or "auto") inside a with-block (context-local)."""
    token = _override.set(_check_backend(name, "use_backend()"))
    try:
        yield
    finally:
        _override.reset(token)


def selected_backend(op: str, device: torch.device | str) -> str:
    """The backend that op would run on for tensors on device ("torch" or "tilelang")."""
    if op not in OPS:
        raise KernelConfigError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    dev = torch.device(device).type
    req = requested_backend()
    if req == "torch":
        return "torch"
    if req == "tilelang":
        return "tilelang"
    choice = AUTO_TABLE.get((op, dev), "torch")
    if choice == "tilelang" and (op, dev) in _failed:
        return "torch"
    if choice == "tilelang" and not _tilelang.available():
        _tilelang.warn_fallback("import", _tilelang.import_error() or ImportError("tilelang"))
        return "torch"
    return choice


def _run(op: str, device: torch.device, supported: bool, tl_fn, ref_fn, args):
    backend = selected_backend(op, device)
    if backend == "tilelang" and supported:
        if requested_backend() == "tilelang":
            return tl_fn(*args)
        try:
            return tl_fn(*args)
        except Exception as e:  # build/import failure: remember it and use torch from now on
            _failed.add((op, device.type))
            _tilelang.warn_fallback(op, e)
    return ref_fn(*args)


def masked_sample(
    logits: torch.Tensor, bitmask: torch.Tensor | None, temperature: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Token ids [B] int64: greedy (temperature 0) or the seeded inverse-CDF draw over allowed tokens.

    bitmask None allows every token. See deepinfer_kernels.sampling for the exact definition;
    backends return the same ids (greedy rows bit for bit, sampled rows up to float rounding at a
    CDF step).
    """
    if bitmask is None and isinstance(logits, torch.Tensor) and logits.dim() == 2:
        bitmask = torch.full(
            (logits.shape[0], (logits.shape[1] + 31) // 32), -1, dtype=torch.int32, device=logits.device
        )
    sampling.check_args(logits, bitmask, temperature, keys)
    return _run(
        "masked_sample", logits.device, True, sampling.masked_sample_tilelang, sampling.masked_sample_reference,
        (logits, bitmask, temperature, keys),
    )


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); see deepinfer_kernels.rmsnorm."""
    rmsnorm.check_args(x, residual, weight, eps)
    if x.is_cuda:
        supported = x.shape[1] % 32 == 0
    else:
        supported = x.dtype == torch.float32
    return _run(
        "fused_add_rmsnorm", x.device, supported, rmsnorm.fused_add_rmsnorm_tilelang,
        rmsnorm.fused_add_rmsnorm_reference, (x, residual, weight, float(eps)),
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, out [B, H, D]; see deepinfer_kernels.paged_attention."""
    paged_attention.check_args(q, k_cache, v_cache, block_tables, context_lens, scale)
    supported = q.is_cuda or q.dtype == torch.float32
    return _run(
        "paged_decode_attention", q.device, supported, paged_attention.paged_decode_attention_tilelang,
        paged_attention.paged_decode_attention_reference, (q, k_cache, v_cache, block_tables, context_lens, float(scale)),
    )


def warmup(
    device: torch.device | str = "cpu",
    *,
    vocab_size: int | None = None,
    hidden: int | None = None,
    eps: float | None = None,
    attention: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Compile (or load from the disk cache) the kernels the selected backends will use.

    attention: dict(num_heads=, num_kv_heads=, head_dim=, block_size=, scale=). Each op runs
    once on tiny inputs of the right shape class, so later steps never compile.
    """
    dev = torch.device(device)
    if vocab_size:
        masked_sample(
            torch.zeros(1, vocab_size, device=dev), None, torch.ones(1, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
        )
    if hidden and eps:
        x = torch.zeros(1, hidden, device=dev, dtype=dtype)
        fused_add_rmsnorm(x, x, torch.ones(hidden, device=dev, dtype=dtype), eps)
    if attention:
        h, hkv, d, bs = (attention[k] for k in ("num_heads", "num_kv_heads", "head_dim", "block_size"))
        q = torch.zeros(1, h, d, device=dev, dtype=dtype)
        kv = torch.zeros(1, bs, hkv, d, device=dev, dtype=dtype)
        paged_decode_attention(
            q, kv, kv, torch.zeros(1, 1, dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev),
            attention["scale"],
        )
