"""host_memory.keep_freed_memory: a buffer freed and allocated again is reused from the heap, not
mapped and page-faulted anew (what a CPU forward does with its activations every step)."""

import resource
import sys

import pytest
import torch

from deepinfer.engine import host_memory


def _faults_of_reallocating(nbytes: int) -> int:
    """Minor page faults of the third allocate-touch-free of an nbytes tensor."""
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(nbytes // 4).fill_(1.0)
        del t
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_without_page_faults():
    if not host_memory.keep_freed_memory():
        pytest.skip("no glibc mallopt here")
    nbytes = 24 << 20  # a 2048-token prefill's gate|up output on the default model is 25 MB
    pages = nbytes // resource.getpagesize()
    # without the thresholds every allocation of this size was a fresh mmap: one fault per page
    assert _faults_of_reallocating(nbytes) < pages // 20


def test_keep_freed_memory_is_idempotent():
    assert host_memory.keep_freed_memory() == host_memory.keep_freed_memory()
