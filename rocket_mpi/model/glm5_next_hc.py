"""GLM-5.3-Flash manifold-constrained hyper-connections: `hc_mult` residual streams per token.

Each block (attention, then MLP) sees one collapsed stream and writes back into all of them:

    pre, post, comb = f(streams)                       one fp32 projection of the flattened streams
    x      = sum_i pre[i] * streams[i]                 collapse, fp32 accumulation, rounded to BF16
    y      = block(x)
    out[j] = post[j] * y + sum_i comb[i, j] * streams[i]   BF16, as transformers runs it in BF16

comb is pushed towards doubly stochastic by Sinkhorn iterations so the mixed streams keep their norm.
The weights are fp32 (transformers keeps base and scale in fp32; `fn` is BF16 on disk, used in fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocket_mpi import ops
from rocket_mpi.model.layers import linear_rows


@dataclass
class HyperConnection:
    fn: torch.Tensor       # [(2+N)*N, N*H] fp32 (BF16 values)
    base: torch.Tensor     # [(2+N)*N] fp32
    scale: torch.Tensor    # [3] fp32: pre, post, comb


@dataclass(frozen=True)
class HcArgs:
    mult: int              # N streams
    sinkhorn_iters: int
    eps: float             # hc_eps: floor of pre/comb and of the Sinkhorn denominators
    norm_eps: float        # rms_norm_eps of the unweighted input norm


def hc_pre(hc: HyperConnection, streams: torch.Tensor, a: HcArgs, fuse: bool = False,
           norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H] BF16 -> (post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, H] BF16). fuse: the same in
    csrc/hc.cu's kernels (sums in their own order: within rounding of this, tests/test_glm5_next_kernels.py). norm =
    (weight, eps): the block's input RMSNorm of collapsed in place of it; with fuse in the kernels' launch (the bits
    of ops.rms_norm after them), else layers.rms_norm."""
    if fuse:  # in torch hc_pre is ~140 kernels per call (the Sinkhorn loop), in csrc/hc.cu two
        out = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, a.sinkhorn_iters, a.eps, a.norm_eps, norm)
        return out if norm is None else (out[0], out[1], out[3])
    if norm is not None:
        post, comb, collapsed = hc_pre(hc, streams, a)
        return post, comb, ops.rms_norm_ref(collapsed, *norm)
    t, n, _ = streams.shape
    flat = streams.reshape(t, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + a.norm_eps)      # unweighted RMSNorm
    mix = linear_rows(flat, hc.fn)                                                      # [T, (2+N)*N]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre_s, post_s, comb_s = hc.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + a.eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + a.eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + a.eps)
    for _ in range(a.sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + a.eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + a.eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, streams: torch.Tensor, fuse: bool = False
            ) -> torch.Tensor:
    """post [T, N], comb [T, N, N] fp32; y [T, H] and streams [T, N, H] BF16 -> new streams [T, N, H]. fuse: one
    kernel (csrc/hc.cu), rounding where these BF16 ops round."""
    if fuse:
        return ops.hc_post(post, comb, y, streams)
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
