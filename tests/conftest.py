"""Shared fixtures: tiny random-weight models saved as HF directories, and the default model."""

from __future__ import annotations

import os
import pathlib

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
