"""DeepInfer's custom kernels (import name deepinfer_kernels).

Each op has a torch reference (also the runtime fallback), a GPU-style TileLang kernel and a
CPU twin built by TileLang's C target; deepinfer_kernels.dispatch picks one per device. The
TileLang parts import lazily, so `import deepinfer_kernels` stays cheap without TileLang.
"""

from .dispatch import (  # noqa: F401
    fused_add_rmsnorm,
    masked_sample,
    paged_decode_attention,
    selected_backend,
    use_backend,
    warmup,
)
from .errors import KernelConfigError, KernelInputError  # noqa: F401
