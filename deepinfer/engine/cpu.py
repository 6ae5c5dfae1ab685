"""The CPU level the engine runs at: deepinfer_kernels.cpu, the one module that reads the CPU's
features and picks the level (generic / avx2 / avx512, DEEPINFER_CPU to force a lower one), seen
from the engine. Every precision and kernel choice of the engine asks these."""

from deepinfer_kernels.cpu import LEVELS, CpuInfo, CpuLevelError, at_least, has, info, level, torch_mismatch  # noqa: F401
