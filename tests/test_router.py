"""The router kernels (router_logits, moe_route) against moe/router.py: logits within 2^-20 and row-invariant, the
same experts chosen from the same logits (with and without group limits), weights within 2^-18 (the sum order of
up to 32 picks), ties to the lower id.

GPU tests (skip, saying why, without a GPU or the extension): every test here.
"""
import pytest
import torch

from helpers import gpu
from rocket_mpi import ops


def _router_cfg(e, k, n_group=1, topk_group=1, norm=True, scale=2.5):
    from types import SimpleNamespace
    return SimpleNamespace(n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                           norm_topk_prob=norm, routed_scaling_factor=scale)


@gpu
@pytest.mark.parametrize("tokens,hidden,e", [(1, 256, 16), (11, 4096, 128), (40, 1600, 260), (130, 512, 64)])
def test_gpu_router_logits(tokens, hidden, e):
    """Logits (partials over slices of hidden, summed) within 2^-20 of F.linear (only the sum order
    differs); each token's partials the same bits whatever other tokens share the launch (the engine's
    streams come and go); and the two kernels end to end choose route()'s experts."""
    import torch.nn.functional as F
    from rocket_mpi.ops.route import route_ref as route
    C = ops._ext.require()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(e, hidden, generator=gen) / hidden ** 0.5).cuda()
    part = C.router_logits(x, w)
    assert part.shape == ((hidden + 511) // 512, tokens, e)
    got = part[0].clone()
    for s_ in range(1, part.shape[0]):
        got += part[s_]
    want = F.linear(x.float(), w)
    scale = x.float().abs() @ w.abs().T  # bound of the sum's rounding, per (t, e)
    assert float(((got - want).abs() / scale).max()) < 2 ** -20
    for lo, hi in ((0, 1), (tokens // 2, tokens), (tokens - 1, tokens)):
        assert torch.equal(C.router_logits(x[lo:hi].contiguous(), w), part[:, lo:hi])
    bias = (torch.randn(e, generator=gen) * 0.1).cuda()
    cfg = _router_cfg(e, 8)
    ex = ops.route(x, w, bias, cfg)[1].sort(dim=-1).values
    assert torch.equal(ex, route(x, w, bias, cfg)[1].sort(dim=-1).values)


@gpu
@pytest.mark.parametrize("tokens,e,k,n_group,topk_group,norm", [(1, 16, 4, 1, 1, True), (9, 128, 8, 1, 1, True),
                                                               (33, 256, 8, 8, 4, True), (7, 64, 6, 4, 1, False),
                                                               (5, 1024, 32, 32, 5, True), (3, 288, 8, 1, 1, True),
                                                               (4, 320, 8, 4, 2, True)])
def test_gpu_moe_route_matches_router(tokens, e, k, n_group, topk_group, norm):
    from rocket_mpi.ops.route import route_logits
    C = ops._ext.require()
    cfg = _router_cfg(e, k, n_group, topk_group, norm)
    gen = torch.Generator().manual_seed(e + tokens)
    logits = (torch.randn(tokens, e, generator=gen) * 3).cuda()
    bias = (torch.randn(e, generator=gen) * 0.1).cuda()
    w, ex = C.moe_route(logits[None], bias, n_group, topk_group, k, norm, 2.5)
    want_w, want_ex = route_logits(logits, bias, cfg)
    ex_sorted, order = ex.sort(dim=-1)
    want_sorted, want_order = want_ex.sort(dim=-1)
    assert torch.equal(ex_sorted, want_sorted)
    got_w, ref_w = w.gather(1, order), want_w.gather(1, want_order)
    assert float(((got_w - ref_w).abs() / ref_w.abs()).max()) < 2 ** -18
    if n_group > 1:  # every choice inside at most topk_group groups
        assert all(len(set(r)) <= topk_group for r in (ex // (e // n_group)).tolist())


@gpu
def test_gpu_moe_route_ties_and_nan():
    """Equal choices go to the lower expert id; a NaN logit is never chosen while numbers are left."""
    C = ops._ext.require()
    logits = torch.zeros(2, 32, device="cuda")
    logits[1, 3] = float("nan")
    bias = torch.zeros(32, device="cuda")
    w, ex = C.moe_route(logits[None], bias, 1, 1, 4, True, 1.0)
    assert ex.tolist() == [[0, 1, 2, 3], [0, 1, 2, 4]]
    assert torch.equal(w, torch.full((2, 4), 0.25, device="cuda"))
