"""The CPU bitmask apply: equal to the reference and to xgrammar's function on every mask shape."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from deepinfer.errors import InvalidRequestError
from deepinfer.grammar import (
    allocate_token_bitmask,
    allowed_token_ids,
    apply_token_bitmask_,
    apply_token_bitmask_reference_,
    spec_from_params,
)


def _mask(kind: str, B: int, W: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randint(-(2**31), 2**31 - 1, (B, W), dtype=torch.int32, generator=g)
    if kind == "sparse":  # structural state: a few allowed tokens
        m = torch.zeros(B, W, dtype=torch.int32)
        m[:, torch.randint(0, W, (5,), generator=g)] = torch.randint(1, 2**31 - 1, (5,), dtype=torch.int32, generator=g)
        return m
    if kind == "dense":  # free text: a few disallowed tokens
        m = torch.full((B, W), -1, dtype=torch.int32)
        m[:, torch.randint(0, W, (5,), generator=g)] = torch.randint(-(2**31), -2, (5,), dtype=torch.int32, generator=g)
        return m
    if kind == "sign_bit":  # only bit 31 set / only bit 31 clear
        m = torch.full((B, W), -(2**31), dtype=torch.int32)
        m[:, ::2] = 2**31 - 1
        return m
    return torch.full((B, W), -1 if kind == "all" else 0, dtype=torch.int32)


@pytest.mark.parametrize("V", [64, 100, 1000, 4097])  # multiples of 32 and not
@pytest.mark.parametrize("kind", ["random", "sparse", "dense", "sign_bit", "all", "none"])
@pytest.mark.parametrize("B", [1, 3])
def test_matches_reference_and_xgrammar(V, kind, B):
    g = torch.Generator().manual_seed(V * 7 + B)
    W = (V + 31) // 32
    mask = _mask(kind, B, W, g)
    logits = torch.randn(B, V, generator=g)
    ours, ref, xg = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask_(ours, mask)
    apply_token_bitmask_reference_(ref, mask)
    xgr.apply_token_bitmask_inplace(xg, mask)
    assert torch.equal(ours, ref)
    assert torch.equal(ours, xg)
    # the reference really masks: finite exactly where the bit is set
    for r in range(B):
        finite = torch.isfinite(ours[r]).nonzero().flatten()
        assert torch.equal(finite, allowed_token_ids(mask[r], V))


@pytest.mark.parametrize("kind", ["random", "sparse", "dense"])
def test_rows_subset_leaves_other_rows_untouched(kind):
    g = torch.Generator().manual_seed(1)
    B, V = 5, 777
    mask = _mask(kind, B, (V + 31) // 32, g)
    logits = torch.randn(B, V, generator=g)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, mask, rows=[3, 1])
    apply_token_bitmask_reference_(ref, mask, rows=[3, 1])
    assert torch.equal(ours, ref)
    for r in (0, 2, 4):
        assert torch.equal(ours[r], logits[r])


def test_bitmask_with_more_rows_than_logits():
    g = torch.Generator().manual_seed(3)
    mask = _mask("random", 4, 4, g)
    logits = torch.randn(2, 100, generator=g)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, mask)
    apply_token_bitmask_reference_(ref, mask[:2])
    assert torch.equal(ours, ref)


def test_allocate_allows_everything():
    m = allocate_token_bitmask(2, 70)
    assert m.shape == (2, 3) and m.dtype == torch.int32
    logits = torch.randn(2, 70)
    before = logits.clone()
    apply_token_bitmask_(logits, m)
    assert torch.equal(logits, before)


def test_bad_shapes_raise():
    with pytest.raises(InvalidRequestError, match="covers 32 tokens"):
        apply_token_bitmask_(torch.zeros(1, 40), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(InvalidRequestError, match="int32"):
        apply_token_bitmask_(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(InvalidRequestError, match="out of range"):
        apply_token_bitmask_(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.int32), rows=[2])
    with pytest.raises(InvalidRequestError, match="fewer than the logits' 3"):
        apply_token_bitmask_(torch.zeros(3, 32), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(InvalidRequestError, match="batch >= 1"):
        allocate_token_bitmask(0, 10)


@pytest.mark.parametrize("which", ["compiler", "outlines_compiler"])
def test_ids_past_the_tokenizer_are_always_masked(which, request, smol_tok):
    """vocab_size (the logits width) exceeds the tokenizer: those ids must never be allowed,
    even for a grammar that allows any text."""
    c = request.getfixturevalue(which)
    n_tok = smol_tok.get_vocab_size()
    V = c.vocab_size
    assert V > n_tok  # the compilers are built 40 ids wider than the tokenizer
    m = c.new_matcher(spec_from_params(regex=r"[^\n]*"))
    mask = allocate_token_bitmask(2, V)
    m.fill_bitmask(mask, 1)
    allowed = allowed_token_ids(mask[1], V)
    assert allowed.numel() > n_tok // 2  # free text: most of the vocabulary
    assert int(allowed.max()) < n_tok
    assert torch.equal(mask[0], torch.full_like(mask[0], -1))  # other rows untouched
    logits = torch.zeros(2, V)
    apply_token_bitmask_(logits, mask, rows=[1])
    assert torch.isinf(logits[1, n_tok:]).all()
    assert torch.isfinite(logits[1, allowed]).all()


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 49152, 49153])
def test_allowed_token_ids_are_the_set_bits(V):
    g = torch.Generator().manual_seed(V)
    words = (V + 31) // 32
    rows = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=g),
            torch.zeros(words, dtype=torch.int32), torch.full((words,), -1, dtype=torch.int32)]
    for row in rows:
        want = [t for t in range(V) if (int(row[t // 32]) >> (t % 32)) & 1]
        got = allowed_token_ids(row, V)
        assert got.dtype == torch.int64 and got.tolist() == want
    # a row of a larger mask (a view) gives the same ids
    mask = torch.stack(rows)
    assert allowed_token_ids(mask[0], V).tolist() == allowed_token_ids(rows[0].clone(), V).tolist()


@pytest.mark.parametrize("kind", ["random", "sparse", "dense", "sign_bit", "all", "none"])
def test_torch_fallback_equals_native_path(kind, monkeypatch):
    """fp32 logits go through the native kernel; without it (or for other dtypes) the torch paths run:
    both must equal the reference."""
    from deepinfer_kernels import bitmask as native_bitmask

    g = torch.Generator().manual_seed(11)
    B, V = 4, 1000
    mask = _mask(kind, B, (V + 31) // 32, g)
    logits = torch.randn(B, V, generator=g)
    native, ref = logits.clone(), logits.clone()
    apply_token_bitmask_(native, mask, rows=[0, 2, 3])
    apply_token_bitmask_reference_(ref, mask, rows=[0, 2, 3])
    assert torch.equal(native, ref)
    calls = []
    monkeypatch.setattr(native_bitmask, "apply_", lambda *a: calls.append(1) or False)
    fallback = logits.clone()
    apply_token_bitmask_(fallback, mask, rows=[0, 2, 3])
    assert calls and torch.equal(fallback, ref)


@pytest.mark.parametrize("kind", ["one_byte", "two_bytes", "specials_only", "none", "all"])
def test_forced_byte_native_equals_numpy(kind, monkeypatch):
    """The jump-forward probe's question (which first byte every allowed token shares) answered by
    the native kernel and by the numpy path alike."""
    import numpy as np

    from deepinfer.grammar import xgrammar_backend as xb
    from deepinfer_kernels import bitmask as native_bitmask

    g = torch.Generator().manual_seed(5)
    V = 3000
    first = torch.randint(0, 256, (V,), generator=g).to(torch.int16).numpy()
    first[:10] = -1  # special tokens: no first byte
    row = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    ids = {"one_byte": np.flatnonzero(first == first[100])[:7], "two_bytes": [100, int(np.flatnonzero(first != first[100])[-1])],
           "specials_only": [1, 5], "none": [], "all": list(range(V))}[kind]
    for t in ids:
        row[0, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32) if t % 32 != 31 else torch.tensor(-(2**31), dtype=torch.int32)
    want = {"one_byte": int(first[100]), "two_bytes": None, "specials_only": None, "none": None, "all": None}[kind]
    assert native_bitmask.forced_byte(row[0], first) == want
    assert xb._next_bytes_forced(row, first) == want
    monkeypatch.setattr(native_bitmask, "forced_byte", lambda *a: False)  # the numpy path
    assert xb._next_bytes_forced(row, first) == want


@pytest.mark.parametrize("kind", ["random", "sparse", "dense", "none"])
def test_min_rank_token_is_the_lowest_ranked_allowed_id(kind):
    """The budget guard's step (the allowed token of least rank, ties to the lowest id) natively,
    against its definition."""
    from deepinfer_kernels import bitmask as native_bitmask

    g = torch.Generator().manual_seed(9)
    V = 2000
    mask = _mask(kind, 1, (V + 31) // 32, g)
    rank = torch.randint(0, 5, (V,), generator=g)  # many ties
    ids = allowed_token_ids(mask[0], V)
    want = int(ids[torch.argmin(rank[ids] * V + ids)]) if ids.numel() else None
    assert native_bitmask.min_rank_token(mask[0], rank) == want
