"""What travels between the engine process and its expert-parallel workers over their pipes: a
ForwardBatch as a dict of numpy arrays (pickled inline: no shared-memory segments per tensor, so a
dead worker leaves nothing behind) and logits back the same way."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from deepinfer.engine.forward_batch import ForwardBatch


def pack_batch(batch: ForwardBatch, **override) -> dict:
    out = {}
    for f in fields(ForwardBatch):
        v = override.get(f.name, getattr(batch, f.name))
        out[f.name] = v.cpu().numpy() if isinstance(v, torch.Tensor) else v
    return out


def unpack_batch(d: dict) -> ForwardBatch:
    return ForwardBatch(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in d.items()})


def pack_tensor(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def unpack_tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)
