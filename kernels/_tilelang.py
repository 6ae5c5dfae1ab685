"""Importing TileLang (optional) and compiling kernels once per shape class.

TileLang is imported lazily and only here, after pointing its on-disk cache at
~/.cache/deepinfer/tilelang (or $XDG_CACHE_HOME/deepinfer/tilelang) instead of ~/.tilelang,
unless TILELANG_CACHE_DIR is already set. Every compiled kernel is memoised in-process by its
shape-class key, and TileLang's own disk cache makes a second process load it without
re-running the compiler.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

_LOCK = threading.Lock()
_TL: Any = None
_IMPORT_ERROR: BaseException | None = None
_WARNED = False
_KERNELS: dict[tuple, Any] = {}
COMPILE_SECONDS: dict[tuple, float] = {}

# g++ builds TileLang's C target without optimisation by default. -ffp-contract=off keeps a*b+c
# two roundings (no FMA), which the bit-exact sampling maths relies on.
CPU_COMPILE_FLAGS = ["-O2", "-ffp-contract=off"]
# Keep let-bindings: inlining them duplicates every reused intermediate (the hash uses each
# value twice per round), which made the sampling kernel's source and compile time explode.
PASS_CONFIGS = {"tl.Simplify": {"enable_simplify_let_inline": False}}
CUDA_ARCH = os.environ.get("DEEPINFER_CUDA_ARCH", "sm_90a")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepinfer" / "tilelang"


def tilelang():
    """The tilelang module, or None when it is not installed or fails to import."""
    global _TL, _IMPORT_ERROR
    if _TL is not None or _IMPORT_ERROR is not None:
        return _TL
    with _LOCK:
        if _TL is None and _IMPORT_ERROR is None:
            if "TILELANG_CACHE_DIR" not in os.environ:
                d = default_cache_dir()
                d.mkdir(parents=True, exist_ok=True)
                os.environ["TILELANG_CACHE_DIR"] = str(d)
            try:
                import tilelang as tl  # noqa: PLC0415 - optional, heavy (~2-3 s)

                _TL = tl
            except Exception as e:  # any import failure means "use torch"
                _IMPORT_ERROR = e
    return _TL


def available() -> bool:
    """True when TileLang imports."""
    return tilelang() is not None


def import_error() -> BaseException | None:
    """Why tilelang failed to import (None if it imported or was not tried)."""
    tilelang()
    return _IMPORT_ERROR


def warn_fallback(what: str, err: BaseException) -> None:
    """Warn once per process that a TileLang kernel is unavailable and torch is used instead."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            f"deepinfer_kernels: TileLang kernel {what} unavailable ({type(err).__name__}: {err}); "
            "falling back to the torch implementations",
            RuntimeWarning,
            stacklevel=3,
        )


def cuda_target():
    from tvm.target import Target  # noqa: PLC0415 - only importable once tilelang is

    return Target({"kind": "cuda", "arch": CUDA_ARCH})


def compile_cached(key: tuple, build: Callable[[], Any], target: str) -> Any:
    """Compile build()'s prim_func for target ("c" or "cuda") once per key; memoised.

    Raises whatever TileLang raises (the caller decides whether to fall back).
    """
    k = _KERNELS.get(key)
    if k is not None:
        return k
    tl = tilelang()
    if tl is None:
        raise RuntimeError(f"tilelang is not importable: {_IMPORT_ERROR}")
    with _LOCK:
        k = _KERNELS.get(key)
        if k is None:
            t0 = time.perf_counter()
            if target == "c":
                k = tl.compile(build(), target="c", compile_flags=CPU_COMPILE_FLAGS, pass_configs=PASS_CONFIGS)
            else:
                k = tl.compile(build(), target=cuda_target(), pass_configs=PASS_CONFIGS)
            COMPILE_SECONDS[key] = time.perf_counter() - t0
            _KERNELS[key] = k
    return k


def lower_cuda_source(func) -> str:
    """CUDA C++ source of a GPU-style prim_func for CUDA_ARCH, without a GPU or nvcc."""
    tl = tilelang()
    if tl is None:
        raise RuntimeError(f"tilelang is not importable: {_IMPORT_ERROR}")
    tgt = cuda_target()
    with tgt, tl.transform.PassContext(config=PASS_CONFIGS):
        art = tl.lower(func, target=tgt)
    return art.kernel_source
