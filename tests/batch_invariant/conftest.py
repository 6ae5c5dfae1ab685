"""Fixtures for the batch-invariance tests."""

import pytest
import torch


@pytest.fixture(params=[None, 16], ids=["default-threads", "16-threads"])
def threads(request):
    """Run under the default thread count and under 16 threads: BLAS partitions work across
    threads differently per thread count, which can make a row's bits depend on its position."""
    old = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield
    torch.set_num_threads(old)
