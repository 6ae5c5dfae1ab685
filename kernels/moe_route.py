"""Mixture-of-experts routing on CPU in one native call (csrc/moe_route.c): router logits [T, E] ->
(weights [T, k] fp32, expert ids [T, k] int64), best choice first. `route_reference` is the torch
definition (models/moe.py's MoeBlock.route runs the native one on fp32 CPU logits, torch elsewhere).
Each row is routed alone, so a token's route does not depend on its batch (batch-invariant)."""

from __future__ import annotations

import ctypes

import torch

from . import native
from .errors import KernelInputError


def _configure(lib) -> None:
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    lib.di_moe_route_f32.argtypes = [fp, i64, i64, i64, fp, ctypes.c_int, i64, i64, ctypes.c_int, i64,
                                     ctypes.c_int, ctypes.c_float, ctypes.c_float, fp, fp]
    lib.di_moe_route_f32.restype = ctypes.c_int
    lib.di_sigmoid_f32.argtypes = [fp, i64, fp]
    lib.di_sigmoid_f32.restype = None


def _lib():
    return native.require(_configure)


def available() -> bool:
    return native.available()


SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


def route(logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, group_score: str = "top2_sum", norm: bool = False,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, ids [T, top_k] int64): see csrc/moe_route.c for the steps."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32 \
            or logits.device.type != "cpu":
        raise KernelInputError(f"route: logits must be a float32 CPU tensor [T, E], got "
                               f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    T, E = logits.shape
    if scoring not in SCORINGS or group_score not in GROUP_SCORES:
        raise KernelInputError(f"route: scoring must be one of {SCORINGS} and group_score one of {GROUP_SCORES}, "
                               f"got {scoring!r}, {group_score!r}")
    if not 0 < top_k <= E or n_group < 1 or E % n_group or not 0 < topk_group <= n_group \
            or (n_group > 1 and top_k > topk_group * (E // n_group)):
        raise KernelInputError(f"route: top_k={top_k}, n_group={n_group}, topk_group={topk_group} do not fit {E} experts")
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or tuple(bias.shape) != (E,)):
        raise KernelInputError(f"route: bias must be float32 CPU [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = bias.contiguous() if bias is not None else None
    w = torch.empty(T, top_k, dtype=torch.float32)
    idx = torch.empty(T, top_k, dtype=torch.int64)
    rc = _lib().di_moe_route_f32(logits.data_ptr(), logits.stride(0), T, E, bias.data_ptr() if bias is not None else None,
                                 SCORINGS.index(scoring), n_group, topk_group, GROUP_SCORES.index(group_score), top_k,
                                 int(norm), 1e-20 if scoring == "sigmoid" else 0.0, float(scale), w.data_ptr(), idx.data_ptr())
    if rc != 0:
        raise MemoryError(f"route: the native kernel could not allocate its scratch (code {rc})")
    return w, idx


def route_reference(logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None = None,
                    n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum", norm: bool = False,
                    scale: float = 1.0, sigmoid=torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch definition of `route` (any device; what MoeBlock.route runs where the native one does
    not, with its row-invariant sigmoid as `sigmoid`)."""
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    if n_group > 1:
        T = choice.shape[0]
        grouped = choice.view(T, n_group, -1)
        gs = grouped.topk(2, dim=-1).values.sum(-1) if group_score == "top2_sum" else grouped.amax(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool)
        keep.scatter_(1, torch.topk(gs, topk_group, dim=-1).indices, True)
        # (a [T, groups, 1] mask broadcast over each group's experts: repeat_interleave of the mask
        # was the slowest routing op at 32 tokens)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
    idx = torch.topk(choice, top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return (w * scale if scale != 1.0 else w), idx


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) elementwise, fp32 on CPU: the routing's sigmoid (csrc/moe_route.c), which the
    decode stack also computes for Qwen2-MoE's shared-expert gate."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelInputError(f"moe_route.sigmoid needs a float32 CPU tensor, got "
                               f"{getattr(x, 'dtype', type(x).__name__)} on {getattr(x, 'device', '?')}")
    x = x.contiguous()
    y = torch.empty_like(x)
    _lib().di_sigmoid_f32(x.data_ptr(), x.numel(), y.data_ptr())
    return y
