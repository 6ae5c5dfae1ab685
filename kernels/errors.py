"""The typed errors the kernel entry points raise."""

import importlib.util
import sys


def _deepinfer_errors():
    """deepinfer.errors, even where deepinfer's package __init__ cannot import.

    That __init__ pulls in the whole runtime (greenlet, ...), which a bare GPU box running only
    the kernel checks may lack; errors.py itself needs nothing. Loading it under its real name
    keeps one set of classes if deepinfer is imported later.
    """
    try:
        from deepinfer import errors  # noqa: PLC0415

        return errors
    except ImportError:
        mod = sys.modules.get("deepinfer.errors")
        if mod is not None:
            return mod
        pkg = importlib.util.find_spec("deepinfer")
        if pkg is None or not pkg.submodule_search_locations:
            raise
        spec = importlib.util.spec_from_file_location(
            "deepinfer.errors", f"{list(pkg.submodule_search_locations)[0]}/errors.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deepinfer.errors"] = mod
        spec.loader.exec_module(mod)
        return mod


DeepInferError = _deepinfer_errors().DeepInferError


class KernelInputError(DeepInferError, ValueError):
    """A kernel was called with tensors of the wrong shape, dtype, device or value range."""


class KernelConfigError(DeepInferError, ValueError):
    """The kernel backend selection (DEEPINFER_KERNELS or use_backend) names no known backend."""
