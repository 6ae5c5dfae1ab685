"""The one place that knows the CPU: its features, read once, and the level the native kernels run at.

Levels, lowest first (``LEVELS``):

* ``generic`` -- plain x86-64 (SSE2; the native kernels built for it, no FMA), or a CPU without x86
  SIMD (aarch64: NEON / SVE are reported, but the C kernels are x86 code, so they are not built there
  and every op runs on torch);
* ``avx2`` -- AVX2 + FMA + F16C (x86-64-v3), with AVX-VNNI for the int8 dot products where the CPU
  has it (else ``vpmaddubsw``);
* ``avx512`` -- AVX-512 F/BW/DQ/VL (x86-64-v4), with AVX512_VNNI and AVX512_BF16 where the CPU has
  them.

The level in force is the highest the CPU has, or the one ``DEEPINFER_CPU`` names (``avx2`` or
``generic`` on a more capable CPU; a level above the CPU's is refused, naming what it lacks). Each
level has its own build of the native library (`compiler_flags`: ``-march=x86-64-v3`` for avx2, never
``-march=native``), so ``DEEPINFER_CPU=avx2`` on an AVX-512 machine runs the code an AVX2 machine
runs. When a level is forced, torch's own CPU dispatch is held to it as well (ATen's
``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA``, MKL's ``MKL_ENABLE_INSTRUCTIONS``, each
unless already set): they only take effect if set before torch runs its first op, which importing
this module (deepinfer imports it first) does.

Nothing else reads /proc/cpuinfo: kernels and precision choices ask `level()` and `has()`. Results
are bitwise reproducible within one level (batch invariance, expert parallelism, the decode stack);
across levels they may differ in the last bits (FMA or not, another tile of a torch kernel).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from .errors import KernelConfigError

LEVELS = ("generic", "avx2", "avx512")
ENV = "DEEPINFER_CPU"

# what each x86 level needs (Linux /proc/cpuinfo flag names)
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
}
# extensions a level uses where present (the feature names `has` answers to)
_EXTRAS = {"avx2": ("avx_vnni",), "avx512": ("avx_vnni", "avx512_vnni", "avx512_bf16")}
# the compiler's target for each level's build of the native library: fixed ISA and tuning (never
# -march / -mtune=native), so one level compiles to the same code on every CPU that runs it (GCC's
# Zen tunings, for one, stop contracting some multiply-add chains into FMAs)
_MARCH = {"generic": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
_EXTRA_FLAGS = {"avx_vnni": "-mavxvnni", "avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}
# torch's dispatch held to a forced level: (ATen, oneDNN, MKL)
_TORCH_ENV = {
    "generic": ("default", "SSE41", "SSE4_2"),
    "avx2": ("avx2", "AVX2", "AVX2"),
}


class CpuLevelError(KernelConfigError):
    """DEEPINFER_CPU names no level, or one above what this CPU has."""


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # "x86_64", "aarch64", ...
    model: str  # the CPU's model name, for logs and benchmark headers
    flags: frozenset[str]  # every feature the OS reports for this CPU
    detected: str  # the highest level this CPU has
    level: str  # the level in force (detected, or lower where DEEPINFER_CPU says)
    forced: bool  # DEEPINFER_CPU set it

    @property
    def x86(self) -> bool:
        return _is_x86(self.arch)

    def features(self) -> frozenset[str]:
        """The features the level in force may use: its own and its extras the CPU has."""
        if not self.x86 or self.level == "generic":
            return frozenset()
        return frozenset(_NEEDS[self.level]) | {f for f in _EXTRAS[self.level] if f in self.flags}

    def describe(self) -> str:
        extras = sorted(f for f in self.features() if any(f in e for e in _EXTRAS.values()))
        text = f"{self.level}" + (f" (+{', '.join(extras)})" if extras else "")
        if self.level != self.detected:
            text += f", forced by {ENV} (the CPU has {self.detected})"
        return f"{text} on {self.model}" if self.model else text


def _read_cpuinfo() -> tuple[str, set[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:  # x86: flags; aarch64: Features
            flags = set(value.split())
    return model, flags


def _highest(arch: str, flags: set[str]) -> str:
    if not _is_x86(arch):
        return "generic"
    for name in ("avx512", "avx2"):
        if all(f in flags for f in _NEEDS[name]):
            return name
    return "generic"


def _machine() -> str:
    return platform.machine().lower()


def _is_x86(arch: str) -> bool:
    return arch in ("x86_64", "amd64", "i686", "i386")


def _resolve(detected: str, flags: set[str], asked: str | None, arch: str = "x86_64") -> str:
    if not asked:
        return detected
    name = asked.strip().lower()
    if name not in LEVELS:
        raise CpuLevelError(f"{ENV}={asked!r} names no CPU level; use one of {', '.join(LEVELS)}")
    if LEVELS.index(name) > LEVELS.index(detected):
        missing = [f for f in _NEEDS[name] if f not in flags] if _is_x86(arch) else [f"x86 SIMD (it is {arch})"]
        raise CpuLevelError(f"{ENV}={name} asks for more than this CPU has: it lacks {', '.join(missing)} "
                            f"(its level is {detected})")
    return name


@functools.lru_cache(maxsize=1)
def info() -> CpuInfo:
    """This CPU and the level in force, read once per process (CpuLevelError for a bad DEEPINFER_CPU)."""
    arch = _machine()
    model, flags = _read_cpuinfo()
    if not model:
        model = platform.processor()
    detected = _highest(arch, flags)
    asked = os.environ.get(ENV)
    return CpuInfo(arch, model, frozenset(flags), detected, _resolve(detected, flags, asked, arch), bool(asked))


def level() -> str:
    """The level in force: "avx512", "avx2" or "generic"."""
    return info().level


def at_least(name: str) -> bool:
    """Whether the level in force is `name` or above."""
    if name not in LEVELS:
        raise CpuLevelError(f"no CPU level {name!r}; levels are {', '.join(LEVELS)}")
    return LEVELS.index(level()) >= LEVELS.index(name)


def has(feature: str) -> bool:
    """Whether the level in force may use `feature` ("avx512_bf16", "avx512_vnni", "avx_vnni", "fma", ...):
    the CPU has it and the level includes it (under DEEPINFER_CPU=avx2 an AVX-512 CPU has no avx512_bf16)."""
    return feature in info().features()


def native_supported() -> str | None:
    """None where the native C kernels can be built for this CPU, else why not."""
    cpu = info()
    if not cpu.x86:
        return f"the native kernels are x86 code; this CPU is {cpu.arch} (torch runs every op)"
    return None


def compiler_flags(cpu: CpuInfo | None = None) -> list[str]:
    """The C compiler's target flags for the level in force's build of the native library (or `cpu`'s)."""
    cpu = cpu or info()
    flags = [f"-march={_MARCH[cpu.level]}", "-mtune=generic"]
    return flags + [_EXTRA_FLAGS[f] for f in sorted(cpu.features()) if f in _EXTRA_FLAGS]


def kernel_level() -> int:
    """The level as the native library numbers it (csrc/cpu_level.h): 0 generic, 1 avx2, 2 avx512,
    3 avx512 with AVX512_BF16."""
    lv = LEVELS.index(level())
    return 3 if lv == 2 and has("avx512_bf16") else lv


def torch_mismatch() -> str | None:
    """Under a forced level, why torch's own CPU dispatch may still run above it (ATen picked its level
    before this module could cap it: torch ran an op before deepinfer was imported), else None."""
    cpu = info()
    if not cpu.forced or cpu.level not in _TORCH_ENV or not cpu.x86:
        return None
    import torch  # (only here: importing this module imports no torch)

    have = torch.backends.cpu.get_cpu_capability().lower()
    want = _TORCH_ENV[cpu.level][0]
    order = ("default", "avx2", "avx512")
    if have in order and order.index(have) > order.index(want):
        return (f"{ENV}={cpu.level}, but torch's CPU kernels run at {have.upper()}: torch ran an op before "
                f"deepinfer was imported; set ATEN_CPU_CAPABILITY={want} (and ONEDNN_MAX_CPU_ISA, "
                f"MKL_ENABLE_INSTRUCTIONS) in the environment to hold torch to the level as well")
    return None


def torch_env(name: str) -> dict[str, str]:
    """The environment that holds torch's CPU dispatch to level `name` (ATen, oneDNN, MKL), for a child
    process started under DEEPINFER_CPU=name; empty for the top level (nothing to hold)."""
    return dict(zip(("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"), _TORCH_ENV.get(name, ())))


def _hold_torch_to_level() -> None:
    """Forced level: cap torch's CPU dispatch to it too (see the module docstring)."""
    try:
        cpu = info()
    except CpuLevelError:
        return  # raised again where a kernel or the engine asks for the level
    if cpu.forced and cpu.x86:
        for var, value in torch_env(cpu.level).items():
            os.environ.setdefault(var, value)


_hold_torch_to_level()


def below() -> list[str]:
    """The levels under this CPU's own (each one DEEPINFER_CPU can force here), highest first."""
    cpu = info()
    return [lv for lv in LEVELS[: LEVELS.index(cpu.detected)][::-1]] if cpu.x86 else []


if __name__ == "__main__":  # python -m deepinfer_kernels.cpu [--below]
    import sys

    if sys.argv[1:] == ["--below"]:  # the lower levels, one a line (make test-levels)
        print("\n".join(below()))
    else:
        cpu = info()
        print(f"level {cpu.describe()} ({cpu.arch}); features used: {', '.join(sorted(cpu.features())) or '-'}")
        print(f"native build: {' '.join(compiler_flags()) if native_supported() is None else native_supported()}")
