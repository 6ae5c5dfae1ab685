"""Shared fixtures for the kernel tests."""

import shutil

import pytest
import torch

from deepinfer_kernels import _tilelang


@pytest.fixture(scope="session")
def tilelang_available():
    if not _tilelang.available():
        pytest.skip("tilelang is not importable")
    return True


@pytest.fixture(scope="session")
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def nvcc_available():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    return True
