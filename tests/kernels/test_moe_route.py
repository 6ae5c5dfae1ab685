"""deepinfer_kernels.moe_route: native MoE routing against its torch definition (the experts chosen
exactly, weights to fp32 rounding) for the Qwen, DeepSeek-V2 and V3 routings, batch invariance
(bitwise), and input checks."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, moe_route

if not moe_route.available():
    pytest.skip("no C compiler here: the native kernels are not built", allow_module_level=True)

CASES = {  # name: (E, route kwargs)
    "qwen softmax": (32, dict(top_k=4, scoring="softmax", norm=True)),
    "qwen2 softmax, not normed": (60, dict(top_k=4, scoring="softmax")),
    "v2 group-limited greedy": (32, dict(top_k=6, scoring="softmax", n_group=8, topk_group=3, group_score="max", scale=16.0)),
    "v3 sigmoid, bias, groups": (32, dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, norm=True, scale=2.5)),
    "v3 sigmoid, one group": (64, dict(top_k=8, scoring="sigmoid", norm=True, scale=2.5)),
}


def _logits(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) * 2.0  # continuous: no ties


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 37, 600])
def test_matches_the_torch_definition(name, T):
    E, kw = CASES[name]
    logits = _logits(T, E, seed=T + E)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.1 if kw["scoring"] == "sigmoid" else None
    w, idx = moe_route.route(logits, bias=bias, **kw)
    rw, ridx = moe_route.route_reference(logits, bias=bias, **kw)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == (T, kw["top_k"])
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


def test_group_limits_are_kept():
    # V3 routing: every chosen expert lies in one of the topk_group best groups
    E, n_group, topk_group = 32, 4, 2
    logits = _logits(200, E, seed=5)
    bias = torch.randn(E) * 0.1
    _, idx = moe_route.route(logits, top_k=4, scoring="sigmoid", bias=bias, n_group=n_group, topk_group=topk_group, norm=True)
    for row in idx:
        assert len(set((row // (E // n_group)).tolist())) <= topk_group


def test_a_tokens_route_does_not_depend_on_the_batch():
    E, kw = CASES["v3 sigmoid, bias, groups"]
    logits = _logits(700, E, seed=9)  # enough rows for the parallel loop
    bias = torch.randn(E) * 0.1
    w, idx = moe_route.route(logits, bias=bias, **kw)
    for t in (0, 349, 699):
        w1, idx1 = moe_route.route(logits[t : t + 1], bias=bias, **kw)
        assert torch.equal(w1[0], w[t]) and torch.equal(idx1[0], idx[t])


def test_ties_go_to_the_lower_expert_id():
    w, idx = moe_route.route(torch.zeros(2, 8), top_k=3, scoring="softmax")
    assert idx.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 8))


def test_bad_inputs_are_named():
    x = torch.randn(3, 8)
    with pytest.raises(KernelInputError, match=r"logits must be a float32 CPU tensor \[T, E\]"):
        moe_route.route(x.double(), top_k=2, scoring="softmax")
    with pytest.raises(KernelInputError, match="scoring must be one of"):
        moe_route.route(x, top_k=2, scoring="relu")
    with pytest.raises(KernelInputError, match="top_k=9, n_group=1, topk_group=1 do not fit 8 experts"):
        moe_route.route(x, top_k=9, scoring="softmax")
    with pytest.raises(KernelInputError, match="do not fit 8 experts"):
        moe_route.route(x, top_k=4, scoring="sigmoid", n_group=4, topk_group=1)  # 1 group of 2 cannot give 4
    with pytest.raises(KernelInputError, match=r"bias must be float32 CPU \[8\]"):
        moe_route.route(x, top_k=2, scoring="sigmoid", bias=torch.zeros(7))
