"""FP8 (e4m3) weights with their scales, decoded to BF16 at load: W[n, k] = float(code[n, k]) * scale[...], in fp32,
rounded once to BF16.

The scale's shape says how it covers the weight [N, K]: one for all ([] or [1]); one per output row ([N, 1] or [N]);
one per block of bn x bk ([ceil(N / bn), ceil(K / bk)], DeepSeek's and GLM's FP8 releases: `weight_scale_inv`, 128 x
128, the edge blocks cut short); one per group of g along K ([N, K / g]). Nothing runs FP8 here: an FP8 checkpoint
loads as BF16 (twice its stored bytes) and is exact to its own decoding, the same on every rank.
"""
from __future__ import annotations

import torch


def layout(shape: tuple[int, ...], n: int, k: int, block: tuple[int, int] | None) -> str | None:
    """How a scale of `shape` covers an [n, k] weight ('tensor', 'row', 'block', 'group'), or None if it cannot."""
    numel = 1
    for d in shape:
        numel *= d
    if numel == 1:
        return "tensor"
    if tuple(shape) in ((n, 1), (n,)):
        return "row"
    if len(shape) == 2 and block is not None and tuple(shape) == (-(-n // block[0]), -(-k // block[1])):
        return "block"
    if len(shape) == 2 and shape[0] == n and shape[1] > 1 and k % shape[1] == 0:
        return "group"
    return None


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[n, k] float8_e4m3fn codes and their scale (a shape `layout` takes) -> [n, k] in `dtype`."""
    n, k = w.shape
    s = scale.float()
    kind = layout(tuple(scale.shape), n, k, block)
    if kind == "tensor":
        s = s.reshape(())
    elif kind == "row":
        s = s.reshape(n, 1)
    elif kind == "block":
        s = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    elif kind == "group":
        s = s.repeat_interleave(k // scale.shape[1], 1)
    else:
        raise ValueError(f"a scale of shape {list(scale.shape)} does not cover a weight of shape [{n}, {k}]")
    return (w.float() * s).to(dtype)

