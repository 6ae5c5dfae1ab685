"""Shared fixtures: tiny random-weight models saved as HF directories, and the default model."""

from __future__ import annotations

import os
import pathlib

import deepinfer_kernels.cpu  # noqa: F401, I001  (first: holds torch to a DEEPINFER_CPU level before its first op)
import pytest
import torch

os.environ.setdefault("TILELANG_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "tilelang"))

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"

from model_factory import make_tiny_model  # noqa: E402  (tests/ is on sys.path via this conftest)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root / "llama", "llama"),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", tie=True),
        "qwen3": make_tiny_model(root / "qwen3", "qwen3"),
    }


@pytest.fixture(scope="session")
def default_engine():
    """The default SmolLM2-135M engine, built once per test session."""
    from deepinfer import Engine

    return Engine(kv_cache_memory=256 << 20)


# The tests whose results depend on the CPU level (native kernels and their tiles, the decode stack,
# MoE, batch invariance, expert parallelism, quantised loaders, precision choices): marked cpu_levels,
# and run again under every level below this CPU's (DEEPINFER_CPU=avx2, generic) by `make test-levels`,
# which CI runs after the whole suite. Paths under tests/.
CPU_LEVEL_TESTS = (
    "kernels/", "batch_invariant/", "distributed/", "loader/test_loader_gguf_kquant.py", "loader/test_loader_gguf_model.py",
    "engine/test_decode_stack.py", "engine/test_moe.py", "engine/test_moe_experts.py", "engine/test_batch_invariance.py",
    "engine/test_quantized_engine.py", "engine/test_cpu_linear.py", "engine/test_weights16.py", "engine/test_bf16_dot.py",
    "engine/test_last_layer_rows.py", "engine/test_kv_cache_dtype.py", "engine/test_models_vs_hf.py",
    "engine/test_native_in_engine.py", "engine/test_mtp.py", "engine/test_default_model.py",
)


def pytest_collection_modifyitems(config, items):
    tests = pathlib.Path(__file__).resolve().parent
    levels = pytest.mark.cpu_levels
    for item in items:
        rel = pathlib.Path(str(item.fspath)).resolve().relative_to(tests).as_posix()
        if rel.startswith(CPU_LEVEL_TESTS):
            item.add_marker(levels)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
