"""The fixed-shape step's small fused kernels against the torch ops they replace: RMSNorm, RoPE (its table, GLM-5's
interleaved form, RoPE with the cache write, the table read at each position), the embedding with the first
RMSNorm, argmax with the position advance.

GPU tests (skip, saying why, without a GPU or the extension): every test here.
"""
import pytest
import torch

from helpers import gpu
from rocket_mpi import ops


@gpu
@pytest.mark.parametrize("rows,n", [(8, 4096), (64, 128), (5, 80), (96, 128), (3, 36), (2, 12288)])
def test_gpu_fused_rms_norm(rows, n):
    from rocket_mpi.model.layers import rms_norm
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, n, generator=gen) * 3).to(torch.bfloat16).cuda()
    w = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    got, ref = ops.rms_norm(x, w, 1e-5).float(), rms_norm(x, w, 1e-5).float()
    # only the fp32 sum's order differs: at most one bf16 rounding step apart, in each of the two roundings
    assert ((got - ref).abs() <= ref.abs() * 2.0 ** -6 + 1e-30).all(), float((got - ref).abs().max())


@gpu
@pytest.mark.parametrize("tokens,hq,hk,d,rot", [(8, 12, 2, 128, 64), (1, 4, 4, 64, 64), (3, 6, 1, 80, 40)])
def test_gpu_fused_rope_bitwise(tokens, hq, hk, d, rot):
    from rocket_mpi.model.layers import Rope
    rope = Rope(rot, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(tokens, hq, d, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(tokens, hk, d, generator=gen).to(torch.bfloat16).cuda()
    cos, sin = rope.cos_sin(torch.tensor([5, 900, 17, 3, 0, 1, 2, 33][:tokens], device="cuda"))
    want_q, want_k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    ops.rope_(q, k, cos, sin, rot)
    assert torch.equal(q.view(torch.int16), want_q.view(torch.int16))
    assert torch.equal(k.view(torch.int16), want_k.view(torch.int16))


@gpu
@pytest.mark.parametrize("rot,theta", [(64, 10000.0), (40, 1e6), (128, 5e5)])
def test_gpu_rope_table_rows_are_cos_sin_bitwise(rot, theta):
    """Rope.table (the fixed-shape GPU step gathers its rows) holds, for every position, the bits cos_sin computes
    for that position alone or in any batch."""
    from rocket_mpi.model.layers import Rope
    rope = Rope(rot, theta, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    n = 4097
    tab = rope.table(n, torch.device("cuda"))
    assert tab.shape == (2, n, rot) and rope.table(n, torch.device("cuda")) is tab   # made once
    gen = torch.Generator().manual_seed(rot)
    for pos in (torch.arange(n), torch.randint(0, n, (1,), generator=gen), torch.randint(0, n, (37,), generator=gen),
                torch.tensor([n - 1, 0, 5])):
        pos = pos.cuda()
        cos, sin = tab[:, pos]
        want_cos, want_sin = rope.cos_sin(pos)
        assert cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos.view(torch.int16), want_cos.view(torch.int16))
        assert torch.equal(sin.view(torch.int16), want_sin.view(torch.int16))


@gpu
@pytest.mark.parametrize("t", [1, 5, 37])
def test_gpu_rope_interleaved_bitwise(t):
    """GLM-5's interleaved RoPE in one launch (ops.rope_interleaved) gives the bits of its torch ops on the GPU,
    on the views the model passes: q's rope channels (a head's rows one stride apart), the latent key's [T, 1, r]
    slice, the indexer's q and k; the input is left as it was."""
    from rocket_mpi.model import glm_moe_dsa
    from rocket_mpi.model.layers import Rope
    rope = Rope(64, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    gen = torch.Generator().manual_seed(t)
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (t,), generator=gen).cuda())
    q = torch.randn(t, 16, 192 + 64, generator=gen).bfloat16().cuda()
    kv = torch.randn(t, 512 + 64, generator=gen).bfloat16().cuda()
    iq = torch.randn(t, 32, 128, generator=gen).bfloat16().cuda()
    views = {"q rope": q.split([192, 64], dim=-1)[1], "latent key": kv[:, None, 512:], "indexer q": iq[..., :64],
             "indexer k": iq[:, 0, None, :64], "contiguous": iq[:, :3, 64:].contiguous()}
    for name, x in views.items():
        before = x.clone()
        got = glm_moe_dsa.rope_interleaved(x, cos, sin)
        want = glm_moe_dsa.rope_interleaved_ops(x, cos, sin)   # the torch ops on the same GPU tensors
        assert got.shape == want.shape and got.is_contiguous(), name
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        assert torch.equal(x, before), name


@gpu
@pytest.mark.parametrize("m,hq,hk,d,rot,cap", [(8, 12, 2, 128, 64, 40), (1, 4, 4, 64, 64, 3), (3, 6, 1, 80, 40, 9)])
def test_gpu_rope_kv_bitwise(m, hq, hk, d, rot, cap):
    """rope_kv_ (one launch) gives the bits of rope_ then kv_append: q and k rotated, k and v in the caches at
    pos, nothing written for a position past the cache."""
    from rocket_mpi.model.layers import Rope
    rope = Rope(rot, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    gen = torch.Generator().manual_seed(m + d)
    q, k, v = (torch.randn(m, h, d, generator=gen).to(torch.bfloat16).cuda() for h in (hq, hk, hk))
    kc, vc = (torch.randn(m, hk, cap, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    pos = torch.tensor([0, cap - 1, cap, 2, 5, 1, 7, 3][:m], device="cuda").clamp(max=cap)   # cap: past the end
    cos, sin = rope.cos_sin(pos)
    want = [t.clone() for t in (q, k, kc, vc)]
    ops.rope_(want[0], want[1], cos, sin, rot)
    ops.kv_append(want[2], want[3], want[1], v, pos)
    ops.rope_kv_(q, k, v, cos, sin, rot, kc, vc, pos)
    for name, got, w in zip(("q", "k", "k cache", "v cache"), (q, k, kc, vc), want):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16)), name


@gpu
@pytest.mark.parametrize("n,ids", [(4096, [5, 0, 77, 5]), (80, [3]), (36, [1, 2]), (4096, [2, 1000, -1])])
def test_gpu_embed_rms_norm_bitwise(n, ids):
    """embed_rms_norm (the step's embedding and first norm in one launch) = table[ids] and ops.rms_norm, bit for
    bit; an id outside the table reads as a zero row (the step's ids come from its argmax, always inside)."""
    gen = torch.Generator().manual_seed(n)
    table = (torch.randn(100, n, generator=gen) * 2).to(torch.bfloat16).cuda()
    w = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    ids_t = torch.tensor(ids, device="cuda")
    x, h = ops.embed_rms_norm(table, ids_t, w, 1e-6)
    inside = (ids_t >= 0) & (ids_t < 100)
    want = torch.where(inside[:, None], table[ids_t.clamp(0, 99)], torch.zeros((), dtype=table.dtype, device="cuda"))
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))
    assert torch.equal(h.view(torch.int16), ops.rms_norm(want, w, 1e-6).view(torch.int16))


@gpu
@pytest.mark.parametrize("m,vocab", [(1, 151552), (8, 151552), (3, 1000), (2, 5), (70, 4099)])
def test_gpu_argmax_is_torch_argmax(m, vocab):
    """argmax_ (the step's next tokens and pos += 1 in one launch) picks torch.argmax's token: the first of equal
    maxima (+0 and -0 equal), a NaN before any number, a row of -inf its first entry; twice in a row (the ticket
    left zero for the next launch)."""
    gen = torch.Generator().manual_seed(m * vocab)
    logits = torch.randn(m, vocab, generator=gen).to(torch.bfloat16)
    r = list(range(m))
    if m > 1:
        i, j = sorted(torch.randint(0, vocab, (2,), generator=gen).tolist())
        logits[r[1], i] = logits[r[1], j] = 100.0                       # a tie: the lower index
    if m > 2:
        logits[r[2]] = float("-inf")                                   # nothing but -inf: index 0
        logits[r[2], vocab - 1] = float("nan")                         # ... but a NaN comes first
        logits[r[2], vocab // 2] = float("nan")
    if m > 3:
        logits[r[3]] = -1.0
        logits[r[3], vocab - 2], logits[r[3], vocab - 3] = 0.0, -0.0   # -0 == +0: the lower index
    if m > 4:
        logits[r[4]] = float("-inf")
    logits = logits.cuda()
    want = torch.argmax(logits, dim=-1)
    tokens = torch.full((m,), -7, dtype=torch.long, device="cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.arange(m, device="cuda") * 3
    for rep in range(2):
        tokens.fill_(-7)
        ops.argmax_(logits, tokens, ticket, pos)
        assert tokens.tolist() == want.tolist(), rep
        assert pos.tolist() == [3 * i + rep + 1 for i in range(m)] and int(ticket) == 0


@gpu
@pytest.mark.parametrize("m,cap", [(8, 40), (1, 3), (3, 9)])
def test_gpu_rope_kv_reads_table_at_pos(m, cap):
    """rope_kv_ with table=True (cos / sin read at pos from Rope.table's halves) = the gathered rows, bit for bit,
    a position at the table's last row (pos = cap: nothing written) included."""
    from rocket_mpi.model.layers import Rope
    rot, d, hq, hk = 64, 128, 12, 2
    rope = Rope(rot, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    tab = rope.table(cap + 1, torch.device("cuda"))
    gen = torch.Generator().manual_seed(m + cap)
    q, k, v = (torch.randn(m, h, d, generator=gen).to(torch.bfloat16).cuda() for h in (hq, hk, hk))
    kc, vc = (torch.randn(m, hk, cap, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    pos = torch.tensor([0, cap - 1, cap, 2, 5, 1, 7, 3][:m], device="cuda").clamp(max=cap)
    want = [t.clone() for t in (q, k, kc, vc)]
    cos, sin = tab[:, pos]
    ops.rope_kv_(want[0], want[1], v, cos, sin, rot, want[2], want[3], pos)
    ops.rope_kv_(q, k, v, tab[0], tab[1], rot, kc, vc, pos, table=True)
    for name, got, w in zip(("q", "k", "k cache", "v cache"), (q, k, kc, vc), want):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16)), name
