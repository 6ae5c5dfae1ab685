"""DeepInfer's custom kernels (import name deepinfer_kernels).

Each op has a torch reference (also the runtime fallback), a GPU-style TileLang kernel and a
CPU twin built by TileLang's C target; deepinfer_kernels.dispatch picks one per device. The
dispatch entry points import on first use, so `import deepinfer_kernels.cpu` (deepinfer imports it
first, to hold torch's CPU dispatch to a forced level before torch runs any op) imports no torch.
"""

from .errors import KernelConfigError, KernelInputError  # noqa: F401

_DISPATCH = ("fused_add_rmsnorm", "masked_sample", "paged_decode_attention", "selected_backend", "use_backend",
             "warmup")


def __getattr__(name):
    if name in _DISPATCH:
        from . import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'deepinfer_kernels' has no attribute {name!r}")
