"""GGUF's k-quants (Q4_K, Q6_K) in torch: the reference decoder the native kernels are tested against,
and this project's own encoder (round to nearest with one scale search per sub-block; llama.cpp's
converter searches harder, the layout is the same).

Super-blocks of 256 weights ([N, K / 256, bytes]):

* Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
  4-bit quants. Sub-block j (32 weights): w = d * sc_j * q - dmin * m_j. Byte 32c + l of the quants
  holds element l of sub-block 2c (low nibble) and of 2c + 1 (high nibble).
* Q6_K, 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales, fp16 d.
  Sub-block i (16 weights): w = d * sc_i * (q - 32). Element 32t + l of half h takes its low bits
  from byte 64h + l + 32 (t & 1) (low nibble for t < 2, else high) and its high bits from bits
  2t, 2t + 1 of byte 128 + 32h + l.
"""

from __future__ import annotations

import torch

QK_K = 256
Q4_K, Q6_K = 12, 14  # ggml type ids
BYTES = {Q4_K: 144, Q6_K: 210}


def _half(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed bytes -> (sc, m), each [..., 8] integers 0..63."""
    s = s.long()
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], -1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return sc, m


def dequantize(data: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """fp32 [n, k] from the super-blocks in data (uint8 [n, k / 256 * bytes])."""
    b = data.view(n, k // QK_K, BYTES[fmt])
    if fmt == Q4_K:
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, m = _q4k_scales(b[..., 4:16])
        qs = b[..., 16:].long().view(n, -1, 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], 3).view(n, -1, 8, 32).float()  # sub-block 2c, then 2c + 1
        w = (d.unsqueeze(-1) * sc).unsqueeze(-1) * q - (dmin.unsqueeze(-1) * m).unsqueeze(-1)
        return w.reshape(n, k)
    ql = b[..., 0:128].long().view(n, -1, 2, 2, 32)  # [half, which 32 bytes, l]
    qh = b[..., 128:192].long().view(n, -1, 2, 1, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _half(b[..., 208:210])
    low = torch.cat([ql & 0xF, ql >> 4], 3)  # t = 0..3: bytes 0-31 low, 32-63 low, 0-31 high, 32-63 high
    high = (qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)) & 3
    q = ((low | (high << 4)) - 32).float().view(n, -1, 16, 16)
    return ((d.unsqueeze(-1) * sc).unsqueeze(-1) * q).reshape(n, k)


def _q4k_pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(sc, m) [..., 8] integers 0..63 -> [..., 12] bytes (the inverse of `_q4k_scales`)."""
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return torch.cat([lo, mid, hi], -1).to(torch.uint8)


def pack(w: torch.Tensor, fmt: int) -> torch.Tensor:
    """Encode fp32 [n, k] (k a multiple of 256) as uint8 [n, k / 256 * bytes]."""
    n, k = w.shape
    if fmt == Q4_K:
        x = w.float().reshape(n, k // QK_K, 8, 32)
        lo = x.amin(-1).clamp(max=0)  # the offset is -dmin * m with m >= 0: cover the sub-block's minimum
        scale = (x.amax(-1) - lo) / 15
        d = (scale.amax(-1) / 63).to(torch.float16).float()
        dmin = ((-lo).amax(-1) / 63).to(torch.float16).float()
        inv_d = torch.where(d > 0, 1 / d, torch.zeros_like(d)).unsqueeze(-1)
        inv_m = torch.where(dmin > 0, 1 / dmin, torch.zeros_like(dmin)).unsqueeze(-1)
        sc = (scale * inv_d).round().clamp(0, 63).long()
        m = (-lo * inv_m).round().clamp(0, 63).long()
        step = d.unsqueeze(-1) * sc  # the decoder's own values
        off = dmin.unsqueeze(-1) * m
        inv = torch.where(step > 0, 1 / step, torch.zeros_like(step)).unsqueeze(-1)
        q = ((x + off.unsqueeze(-1)) * inv).round().clamp(0, 15).long().view(n, -1, 4, 2, 32)
        qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).to(torch.uint8).reshape(n, -1, 128)
        raw = torch.cat([_half_bytes(d), _half_bytes(dmin), _q4k_pack_scales(sc, m), qs], -1)
        return raw.reshape(n, -1).contiguous()
    x = w.float().reshape(n, k // QK_K, 16, 16)
    idx = x.abs().argmax(-1, keepdim=True)
    scale = x.gather(-1, idx).squeeze(-1) / -32  # the signed extreme maps to q - 32 = -32
    amax = scale.abs().amax(-1)
    d = (amax / 127).to(torch.float16).float()
    inv_d = torch.where(d > 0, 1 / d, torch.zeros_like(d)).unsqueeze(-1)
    sc = (scale * inv_d).round().clamp(-128, 127)
    step = d.unsqueeze(-1) * sc
    inv = torch.where(step != 0, 1 / step, torch.zeros_like(step)).unsqueeze(-1)
    q = ((x * inv).round() + 32).clamp(0, 63).long().view(n, -1, 2, 4, 32)  # [half, t, l]
    low, high = q & 0xF, q >> 4
    ql = torch.cat([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    raw = torch.cat([ql.reshape(n, -1, 128).to(torch.uint8), qh.reshape(n, -1, 64).to(torch.uint8),
                     sc.to(torch.int8).view(torch.uint8), _half_bytes(d)], -1)
    return raw.reshape(n, -1).contiguous()
