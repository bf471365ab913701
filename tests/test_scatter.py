"""moe_scatter_add (rocket_mpi.ops, csrc) against rocket_mpi/moe/scatter.py.

CPU tests (always run):
  - the CPU path is the reference; the row checksum of the graphed step's CPU mode is ops.row_sum of the
    rows in canonical order.
GPU tests (skip, with the reason, without a GPU or the extension):
  - moe_scatter_add bitwise equal to rocket_mpi/moe/scatter.py, with and without residuals;
  - its row checksum equal to ops.row_sum over the rows in canonical order;
  - with the next layer's RMSNorm in its launch: the bits of the scatter and then ops.rms_norm.
"""
from __future__ import annotations

import sys

import torch

from helpers import gpu, pytest, run_without_pytest  # first: it puts the tree's package on sys.path
from rocket_mpi import ops  # noqa: E402
from rocket_mpi.ops.scatter import moe_scatter_add  # noqa: E402
from rocket_mpi.ops.scatter import moe_scatter_add as scatter_ref  # noqa: E402


def test_scatter_cpu_is_reference():
    rows = torch.randn(12, 40).to(torch.bfloat16)
    by_token = torch.tensor([[0, 5, 7], [1, 2, 11], [3, 4, 6], [8, 9, 10]])
    coef = torch.rand(4, 3)
    assert torch.equal(ops.moe_scatter_add(rows, by_token, coef), scatter_ref(rows, by_token, coef))


def test_scatter_sums_row_checksum_cpu():
    """CPU mode of the graphed step: moe_scatter_add's checksum is ops.row_sum of the rows in canonical
    order, whatever slots they sit in, and leaves the scatter's result as it is."""
    from rocket_mpi.ops.scatter import row_sum
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(30, 16, generator=gen).to(torch.bfloat16)
    slot_of_canon = torch.randperm(30, generator=gen)[:12]
    by_canon = torch.randperm(12, generator=gen).view(3, 4).to(torch.int32)
    by_token = slot_of_canon[by_canon.long()]
    coef = torch.rand(3, 4, generator=gen)
    check = torch.zeros((), dtype=torch.long)
    got = ops.moe_scatter_add(rows, by_token, coef, by_canon, check)
    assert torch.equal(got, moe_scatter_add(rows, by_token, coef))
    assert int(check) == int(row_sum(rows[slot_of_canon])) != int(row_sum(rows[slot_of_canon.flip(0)]))


@gpu
@pytest.mark.parametrize("tokens,topk,hidden,rows", [(1, 8, 4096, 8), (37, 8, 4096, 296), (5, 3, 40, 15),
                                                     (4, 2, 13, 9), (0, 8, 64, 0)])
def test_gpu_scatter_bitwise(tokens, topk, hidden, rows):
    gen = torch.Generator().manual_seed(tokens * 31 + hidden)
    r = (torch.randn(max(rows, 1), hidden, generator=gen) * 4).to(torch.bfloat16)[:rows] if rows else \
        torch.zeros(0, hidden, dtype=torch.bfloat16)
    if tokens:
        by_token = torch.stack([torch.randperm(rows, generator=gen)[:topk] for _ in range(tokens)]) \
            if rows >= topk else torch.randint(0, rows, (tokens, topk), generator=gen)
        coef = torch.rand(tokens, topk, generator=gen) * 3 - 1
        coef[0, 0] = -0.0
    else:
        by_token = torch.zeros(0, topk, dtype=torch.long)
        coef = torch.zeros(0, topk)
    want = scatter_ref(r, by_token, coef)
    got = ops.moe_scatter_add(r.cuda(), by_token.cuda(), coef.cuda()).cpu()
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"scatter differs in {(got.view(torch.int16) != want.view(torch.int16)).sum().item()} elements"
    # + residuals (the graphed step's x + (routed + shared)): torch's adds, bit for bit
    shared, x = ((torch.randn(tokens, hidden, generator=gen) * s).to(torch.bfloat16) for s in (2, 8))
    for res in ((shared, x), (shared,)):
        got = ops.moe_scatter_add(r.cuda(), by_token.cuda(), coef.cuda(), residual=[t.cuda() for t in res]).cpu()
        ref = x + (shared + want) if len(res) == 2 else shared + want
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), \
            f"scatter + {len(res)} residuals differs in {(got.view(torch.int16) != ref.view(torch.int16)).sum().item()}"


@gpu
@pytest.mark.parametrize("hidden", [96, 100])  # the 16-byte path and the scalar one
def test_gpu_scatter_sums_row_checksum(hidden):
    """The graphed step's row checksum comes from moe_scatter_add (it reads every canonical row once):
    same scatter bits as without it, and the sum ops.row_sum gives over the rows in canonical order;
    the CPU path of the same call (graph.py's CPU mode) agrees."""
    from rocket_mpi.ops.scatter import row_sum
    t, k = 5, 4
    rows = torch.randn(40, hidden, device="cuda").to(torch.bfloat16)
    slot_of_canon = torch.randperm(40, device="cuda")[:t * k]        # canonical row i lives at slot_of_canon[i]
    by_canon = torch.randperm(t * k).view(t, k).to(torch.int32).cuda()
    by_token = slot_of_canon[by_canon.long()]
    coef = torch.rand(t, k, device="cuda")
    check = torch.zeros(2, dtype=torch.long, device="cuda")
    got = ops.moe_scatter_add(rows, by_token, coef, by_canon, check[1])
    assert torch.equal(got, ops.moe_scatter_add(rows, by_token, coef))
    assert int(check[0]) == 0 and int(check[1]) == int(row_sum(rows[slot_of_canon]))
    cpu = torch.zeros((), dtype=torch.long)
    got_cpu = ops.moe_scatter_add(rows.cpu(), by_token.cpu(), coef.cpu(), by_canon.cpu(), cpu)
    assert torch.equal(got_cpu, got.cpu()) and int(cpu) == int(check[1])


@gpu
@pytest.mark.parametrize("hidden,t,n_res", [(4096, 1, 2), (4096, 9, 2), (96, 5, 0), (100, 5, 1), (12288, 2, 1)])
def test_gpu_scatter_with_next_norm_bitwise(hidden, t, n_res):
    """moe_scatter_add with norm (the graphed step's scatter making the next layer's input norm in its launch) gives
    the bits of the scatter and then ops.rms_norm: out, normed and the rows' checksum (4096 and 96: one fused
    launch; 100 and 12288: the scalar or too-long rows take the two launches)."""
    from rocket_mpi.model.layers import rms_norm as rms_norm_ref
    k = 8
    gen = torch.Generator().manual_seed(hidden + t)
    rows = (torch.randn(3 * t * k, hidden, generator=gen) * 2).to(torch.bfloat16).cuda()
    slot_of_canon = torch.randperm(3 * t * k, generator=gen)[:t * k].cuda()
    by_canon = torch.randperm(t * k, generator=gen).view(t, k).to(torch.int32).cuda()
    by_token = slot_of_canon[by_canon.long()]
    coef = torch.rand(t, k, generator=gen).cuda()
    res = tuple((torch.randn(t, hidden, generator=gen) * 4).to(torch.bfloat16).cuda() for _ in range(n_res))
    w = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    check = torch.zeros(2, dtype=torch.long, device="cuda")
    out, normed = ops.moe_scatter_add(rows, by_token, coef, by_canon, check[0], res, norm=(w, 1e-5))
    want = ops.moe_scatter_add(rows, by_token, coef, by_canon, check[1], res)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(normed.view(torch.int16), ops.rms_norm(want, w, 1e-5).view(torch.int16))
    assert int(check[0]) == int(check[1])
    cpu = ops.moe_scatter_add(rows.cpu(), by_token.cpu(), coef.cpu(), residual=tuple(r.cpu() for r in res),
                                  norm=(w.cpu(), 1e-5))
    assert torch.equal(cpu[0], out.cpu())
    assert torch.equal(cpu[1], rms_norm_ref(out.cpu(), w.cpu(), 1e-5))


if __name__ == "__main__":
    sys.exit(run_without_pytest(globals(), __file__))
