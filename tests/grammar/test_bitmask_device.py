"""The device-generic bitmask apply (the CUDA path), run here on CPU tensors: equal to the
row-by-row reference on every mask shape, typed errors for bad input, and the host->device copy."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import InvalidRequestError
from deepinfer.grammar.bitmask import apply_token_bitmask_, apply_token_bitmask_reference_
from deepinfer.grammar.bitmask_device import BitmaskUploader, apply_token_bitmask_device_, disallowed


def _masks(B: int, W: int, g: torch.Generator):
    yield "random", torch.randint(-(2**31), 2**31 - 1, (B, W), dtype=torch.int32, generator=g)
    sparse = torch.zeros(B, W, dtype=torch.int32)
    sparse[:, 0] = 1 | (1 << 31) - (1 << 32)  # bits 0 and 31 (the sign bit)
    yield "sparse", sparse
    yield "all", torch.full((B, W), -1, dtype=torch.int32)
    yield "none", torch.zeros(B, W, dtype=torch.int32)


@pytest.mark.parametrize("V", [1, 31, 64, 100, 4097])
@pytest.mark.parametrize("rows", [None, [1], [0, 2]])
def test_device_apply_matches_the_reference(V, rows):
    g = torch.Generator().manual_seed(V)
    B, W = 3, (V + 31) // 32 + 1  # a wider mask than needed: the extra bits are ignored
    for kind, m in _masks(B, W, g):
        logits = torch.randn(B, V, generator=g)
        want, got = logits.clone(), logits.clone()
        apply_token_bitmask_reference_(want, m, rows)
        apply_token_bitmask_device_(got, m, rows)
        assert torch.equal(got, want), kind
        # the CPU-tuned apply agrees as well (the engine picks by device; both are one contract)
        cpu = logits.clone()
        apply_token_bitmask_(cpu, m, rows)
        assert torch.equal(cpu, want), kind


def test_disallowed_unpacks_bits_in_token_order():
    m = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63 allowed
    d = disallowed(m, 64)
    assert (~d[0]).nonzero().squeeze(1).tolist() == [0, 2, 63]


def test_device_apply_runs_without_host_tensors_on_a_non_cpu_device():
    # "meta" tensors carry no data: any host tensor mixed into the math would raise here
    logits = torch.empty(4, 100, device="meta")
    m = torch.empty(4, 4, dtype=torch.int32, device="meta")
    apply_token_bitmask_device_(logits, m)
    apply_token_bitmask_device_(logits, m, rows=[1, 3])
    apply_token_bitmask_(logits, m, rows=[0])  # the engine's entry point routes non-CPU tensors here


@pytest.mark.parametrize(
    "logits,mask,rows,match",
    [
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), None, "int32"),
        (torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int32), None, "covers 32 tokens"),
        (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), None, "1 rows"),
        (torch.zeros(64), torch.zeros(2, 2, dtype=torch.int32), None, "2-D"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2], "out of range"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32, device="meta"), None, "one device"),
    ],
)
def test_bad_input_raises_typed_errors(logits, mask, rows, match):
    with pytest.raises(InvalidRequestError, match=match):
        apply_token_bitmask_device_(logits, mask, rows)


def test_uploader_returns_the_mask_on_the_target_device():
    m = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    up = BitmaskUploader()
    assert torch.equal(up.upload(m, torch.device("cpu")), m)
    assert up.upload(m, torch.device("meta")).device.type == "meta"


@pytest.mark.gpu
def test_uploader_pinned_copy_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    up = BitmaskUploader()
    g = torch.Generator().manual_seed(0)
    for n in (3, 7, 2):  # the pinned buffer grows and is reused
        m = torch.randint(-(2**31), 2**31 - 1, (n, 9), dtype=torch.int32, generator=g)
        d = up.upload(m, torch.device("cuda"))
        logits = torch.randn(n, 280, generator=g)
        want = logits.clone()
        apply_token_bitmask_reference_(want, m)
        got = logits.cuda()
        apply_token_bitmask_(got, d)
        assert torch.equal(got.cpu(), want)
