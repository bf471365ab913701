"""NVFP4 (ModelOpt layout): E2M1 codes packed two per byte, e4m3 block scales of 16, fp32 global scale.

W[n, k] = E2M1[code(n, k)] * float(weight_scale[n, k // 16]) * weight_scale_2
Element 2j sits in the low nibble of byte j, element 2j+1 in the high nibble; bit 3 of a code is
the sign.
"""
from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# code -> value for codes 0..15 (bit 3 = sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes 0..15 -> [..., K/2] bytes; element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to the nearest E2M1 code, ties to even."""
    a = x.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag.to(torch.uint8) | sign


def quantize(w: torch.Tensor, global_amax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 []).

    As ModelOpt: weight_scale_2 = amax / (6 * 448); block scale = block_amax / 6 / weight_scale_2 in e4m3.
    `global_amax` lets gate and up of one expert share one weight_scale_2.
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"quantize: need [N, K] with K a multiple of {BLOCK}, got {tuple(w.shape)}")
    w = w.float()
    n, k = w.shape
    amax = float(w.abs().max()) if global_amax is None else float(global_amax)
    s2 = torch.tensor(amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0, dtype=torch.float32)
    blocks = w.view(n, k // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (block_amax / E2M1_MAX / s2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale.float() * s2).unsqueeze(-1)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    codes = torch.where(denom > 0, e2m1_codes(blocks / safe), torch.zeros_like(blocks, dtype=torch.uint8))
    return pack_e2m1(codes.view(n, k)), scale, s2


def _byte_values(device) -> torch.Tensor:
    """[256, 2] fp32: the two E2M1 values a packed byte holds (low nibble first)."""
    b = torch.arange(256)
    return torch.stack((E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]), dim=-1).to(device)


DEQUANT_CHUNK = 1 << 24   # values per pass of dequantize: its fp32 temporaries stay at 64 MiB


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float = 1.0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed NVFP4 -> [N, K] in `dtype`. Pass weight_scale_2=1.0 to leave the global scale out. In row chunks:
    each packed byte looks up its two values, times the block scale (exact in fp32), times weight_scale_2 (one
    rounding), then one rounding to `dtype`."""
    n, k2 = weight.shape
    k = 2 * k2
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    table = _byte_values(weight.device)
    s2 = None if isinstance(weight_scale_2, float) and weight_scale_2 == 1.0 else \
        torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    rows = max(1, DEQUANT_CHUNK // max(k, 1))
    for r0 in range(0, n, rows):
        w = torch.nn.functional.embedding(weight[r0:r0 + rows].long(), table).view(-1, k // BLOCK, BLOCK)
        w.mul_(weight_scale[r0:r0 + rows].float().unsqueeze(-1))
        if s2 is not None:
            w.mul_(s2)
        out[r0:r0 + rows] = w.view(-1, k)
    return out
