"""Decode attention and the cache writes.

CPU tests (always run):
  - layers.distinct_writes restores torch's deterministic mode.
GPU tests (skip, saying why, without a GPU or the extension):
  - decode_softmax and kv_append against glm4_moe's torch path;
  - layers.matmul_fp32 and layers.latent_attention (MLA decode over the latent rows) against their CPU forms;
  - a cache write with distinct indices gives the same bits through the plain kernel as the deterministic one.
"""
import pytest
import torch

from helpers import gpu
from rocket_mpi import ops


@gpu
@pytest.mark.parametrize("m,heads,span", [(1, 96, 16), (8, 12, 40), (3, 4, 300), (2, 2, 1000), (1, 1, 1)])
def test_gpu_decode_softmax(m, heads, span):
    """decode_softmax against glm4_moe's torch ops (scale, mask past pos, fp32 softmax, bf16): hidden keys exactly
    0; the rest within one bf16 rounding of torch's (only the fp32 sums' order differs)."""
    gen = torch.Generator().manual_seed(span)
    scores = (torch.randn(m, heads, 1, span, generator=gen) * 8).to(torch.bfloat16).cuda()
    pos = torch.randint(0, span, (m,), generator=gen).cuda()
    pos[0] = span - 1
    scale = 128 ** -0.5
    hide = (torch.arange(span, device="cuda")[None, :] > pos[:, None])[:, None, None, :]
    want = torch.softmax((scores * scale).masked_fill(hide, float("-inf")), dim=-1, dtype=torch.float32)
    want = want.to(torch.bfloat16).float()
    got = ops.decode_softmax(scores, pos, scale).float()
    assert (got[hide.expand_as(got)] == 0).all(), "a hidden key got a non-zero probability"
    err = (got - want).abs()
    assert (err <= want.abs() * 2.0 ** -7 + 1e-30).all(), f"max |diff| {float(err.max()):.3e}"
    sums = got.sum(-1)
    assert ((sums - 1).abs() < 2e-2).all(), sums


ATTN_CASES = [(2, 96, 8, 128, 40), (8, 8, 2, 64, 100), (3, 4, 2, 16, 7), (1, 12, 1, 128, 1000), (2, 4, 4, 128, 2048),
              (5, 16, 1, 24, 33), (16, 96, 8, 128, 24)]


@gpu
def test_gpu_kv_append():
    m, h, cap, d = 4, 2, 9, 16
    kc, vc = (torch.randn(m, h, cap, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    want_k, want_v = kc.clone(), vc.clone()
    k, v = (torch.randn(m, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    pos = torch.tensor([0, 8, 3, 3], device="cuda")
    want_k[torch.arange(m), :, pos] = k
    want_v[torch.arange(m), :, pos] = v
    ops.kv_append(kc, vc, k, v, pos)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@gpu
def test_gpu_matmul_fp32_matches_cpu():
    """layers.matmul_fp32 on the GPU (bf16 tensor cores, fp32 sums: the indexers' scores, latent_attention) against
    the CPU's fp32 GEMM on the same bf16 values, for a b per batch and one b for every batch (GLM-5's prefill
    scores against its stream's keys): fp32 results within 2^-16 of each element's sum of |products|."""
    from rocket_mpi.model.layers import matmul_fp32
    gen = torch.Generator().manual_seed(29)
    a = torch.randn(6, 32, 128, generator=gen).to(torch.bfloat16)
    for b in (torch.randn(6, 128, 700, generator=gen), torch.randn(128, 700, generator=gen)):
        b = b.to(torch.bfloat16)
        cpu = matmul_fp32(a, b)
        got = matmul_fp32(a.cuda(), b.cuda())
        assert got.dtype == torch.float32 and got.shape == cpu.shape == (6, 32, 700)
        bound = matmul_fp32(a.abs(), b.abs()) * 2.0 ** -16
        assert bool(((got.cpu() - cpu).abs() <= bound).all())


@gpu
@pytest.mark.parametrize("m,heads,d,dv,n", [(1, 64, 512, 512, 2064), (8, 64, 576, 512, 2064), (5, 4, 48, 32, 37)])
def test_gpu_latent_attention_matches_cpu(m, heads, d, dv, n):
    """layers.latent_attention (MLA decode over the latent rows) on the GPU, bf16 GEMMs with fp32 scores, against
    its CPU form (fp32 copies) on the same inputs: within a bf16 rounding of the output (both round the
    probabilities to bf16; the scores' sums differ in order). Masked rows add nothing: other values there leave
    every bit as it was."""
    from rocket_mpi.model.layers import latent_attention
    gen = torch.Generator().manual_seed(m * 131 + d)
    q = torch.randn(m, heads, d, generator=gen).to(torch.bfloat16)
    rows = torch.randn(m, n, d, generator=gen).to(torch.bfloat16)
    valid = torch.rand(m, n, generator=gen) < 0.8
    valid[:, 0] = True
    scale = 256 ** -0.5
    cpu = latent_attention(q, rows, rows[..., :dv], valid, scale)
    dev = torch.device("cuda")
    qg, rg, vg = q.to(dev), rows.to(dev), valid.to(dev)
    out = latent_attention(qg, rg, rg[..., :dv], vg, scale)
    assert out.shape == (m, heads, dv) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), cpu.float(), rtol=1.6e-2, atol=1e-2)
    noisy = torch.where(vg[..., None], rg, torch.full_like(rg, 1e4))
    assert torch.equal(latent_attention(qg, noisy, noisy[..., :dv], vg, scale), out)


def test_distinct_writes_restores_the_mode():
    """layers.distinct_writes turns torch's deterministic mode off inside only, and back as it was (warn_only too),
    also when the block raises."""
    from rocket_mpi.model.layers import distinct_writes
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.raises(KeyError):
            with distinct_writes():
                assert not torch.are_deterministic_algorithms_enabled()
                raise KeyError("inside")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@gpu
def test_gpu_distinct_writes_same_bits():
    """A cache write with one row per stream (distinct indices) gives the same bits through the plain kernel
    (layers.distinct_writes) as through torch's deterministic, sorted one."""
    from rocket_mpi.model.layers import distinct_writes
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    cache = torch.randn(8, 300, 576, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.randperm(300, device=dev, generator=gen)[:8]
    idx = torch.arange(8, device=dev)
    x = torch.randn(8, 576, device=dev, generator=gen).to(torch.bfloat16)
    a, b = cache.clone(), cache.clone()
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        a[idx, pos] = x
        with distinct_writes():
            b[idx, pos] = x
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
    assert torch.equal(a, b) and torch.equal(a[idx, pos], x) and not torch.equal(a, cache)
