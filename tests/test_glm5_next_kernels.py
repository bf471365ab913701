"""GLM-5.3-Flash's hyper-connection kernels (csrc/hc.cu) and KDA kernels (csrc/kda.cu) against the torch ops of
glm5_next_hc and glm5_next_kda.

CPU tests (always run):
  - hc_pre with the block's input norm;
  - KDA's packed launches (b beside q/k/v and the gates where it tiles) give the unpacked layer's bits;
  - mla_decode's fused form wired as on a GPU, its kernels' contracts written in torch.
GPU tests (skip, saying why, without a GPU or the extension):
  - hc_pre / hc_post within rounding of the torch ops and row invariant, the norm in hc_finish's launch;
  - KDA decode within rounding of the torch loop, three steps in a row; a prefill's tokens in one launch give
    the bits of one launch per token;
  - the MLA decode glue (csrc/mla.cu): the cache writes and completed pools' keys against mla_decode's torch
    writes and _pool_decode, the picks against _pick and _pool_cols, the softmax against latent_attention's mask
    and softmax, each stream's bits alone as in its batch; mla_decode fused against its torch form.
"""
import pytest
import torch

from helpers import gpu
from rocket_mpi import ops


def _hc_case(t, n, h, seed):
    from rocket_mpi.model.glm5_next_hc import HcArgs, HyperConnection
    gen = torch.Generator().manual_seed(seed)
    j = (2 + n) * n
    hc = HyperConnection(fn=(torch.randn(j, n * h, generator=gen) * 0.02).to(torch.bfloat16).float(),
                         base=torch.randn(j, generator=gen) * 0.5, scale=torch.rand(3, generator=gen) + 0.5)
    streams = (torch.randn(t, n, h, generator=gen) * 2).to(torch.bfloat16)
    y = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    return hc, HcArgs(mult=n, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-5), streams, y


def test_hc_pre_with_norm_cpu():
    """hc_pre(..., norm=(w, eps)) on the CPU: post and comb as without it, the collapsed row through layers.rms_norm."""
    from rocket_mpi.model.glm5_next_hc import hc_pre
    from rocket_mpi.model.layers import rms_norm
    hc, a, streams, _ = _hc_case(3, 4, 64, seed=5)
    w = (torch.randn(64, generator=torch.Generator().manual_seed(6)) + 1).bfloat16()
    post, comb, collapsed = hc_pre(hc, streams, a)
    got = hc_pre(hc, streams, a, norm=(w, 1e-5))
    assert torch.equal(got[0], post) and torch.equal(got[1], comb)
    assert torch.equal(got[2], rms_norm(collapsed, w, 1e-5)) and not torch.equal(got[2], collapsed)


@gpu
@pytest.mark.parametrize("t,n,h", [(1, 4, 4096), (8, 4, 4096), (37, 4, 64), (3, 2, 520), (5, 3, 96), (2, 1, 128),
                                   (2, 2, 100)])   # 100: the norm does not fuse (not whole 16-byte chunks)
def test_gpu_hc_kernels_match_torch(t, n, h):
    """csrc/hc.cu against glm5_next_hc's torch ops on the same inputs: post / comb within fp32 rounding of the
    different sum order, the collapse and the new streams within one bf16 rounding; and a token alone gets the same
    bits as inside the launch (no token depends on another)."""
    from dataclasses import replace
    from rocket_mpi.model.glm5_next_hc import hc_post, hc_pre
    hc, a, streams, y = _hc_case(t, n, h, seed=t * 31 + n * 7 + h)
    hc_c = replace(hc, fn=hc.fn.cuda(), base=hc.base.cuda(), scale=hc.scale.cuda())
    sc, yc = streams.cuda(), y.cuda()
    ref = [x.cuda() for x in hc_pre(hc_c, sc, a)]
    got = hc_pre(hc_c, sc, a, fuse=True)
    for name, g, r, tol in (("post", got[0], ref[0], 1e-5), ("comb", got[1], ref[1], 1e-5)):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert torch.allclose(g, r, rtol=tol, atol=tol), (name, float((g - r).abs().max()))
    # bf16 results: within a couple of roundings of the size of the terms they sum (cancellation makes a result
    # small, not its error)
    xs = sc.float().abs()
    c, cr = got[2].float(), ref[2].float()
    size = (xs * 2).sum(dim=1)  # every pre weight is below 1 + eps
    assert ((c - cr).abs() <= size * 2.0 ** -7 + 1e-6).all(), float((c - cr).abs().max())
    out = hc_post(got[0], got[1], yc, sc, fuse=True).float()
    out_ref = hc_post(got[0], got[1], yc, sc).float()
    size = got[0][:, :, None] * yc.float().abs()[:, None, :] + torch.einsum("tij,tih->tjh", got[1], xs)
    assert ((out - out_ref).abs() <= size * 2.0 ** -6 + 1e-6).all(), float((out - out_ref).abs().max())
    # row invariance: the last token alone
    alone = hc_pre(hc_c, sc[-1:].contiguous(), a, fuse=True)
    for g, al in zip(got, alone):
        assert torch.equal(g[-1:], al)
    assert torch.equal(hc_post(got[0][-1:], got[1][-1:], yc[-1:], sc[-1:], fuse=True),
                       hc_post(got[0], got[1], yc, sc, fuse=True)[-1:])
    # with the block's input norm in hc_finish's launch (or after it where the row does not fit norm.cuh's layout):
    # the bits of ops.rms_norm on the collapsed row; post / comb / collapse unchanged
    w = (torch.randn(h, generator=torch.Generator().manual_seed(h)) + 1).bfloat16().cuda()
    four = ops.hc_pre(sc, hc_c.fn, hc_c.base, hc_c.scale, a.sinkhorn_iters, a.eps, a.norm_eps, (w, 1e-5))
    for g, r in zip(four[:3], got):
        assert torch.equal(g, r)
    assert torch.equal(four[3].view(torch.int16), ops.rms_norm(got[2], w, 1e-5).view(torch.int16))
    assert torch.equal(hc_pre(hc_c, sc, a, fuse=True, norm=(w, 1e-5))[2], four[3])


def _kda_case(heads, dk, hidden, streams, seed, lower_bound):
    from rocket_mpi.model.glm5_next_kda import KDA, KdaArgs
    gen = torch.Generator().manual_seed(seed)
    d = heads * dk

    def w(*shape, std=0.05):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)
    a = KDA(qkv=w(3 * d, hidden), conv=torch.randn(3 * d, 4, generator=gen) * 0.3, f_a=w(dk, hidden, std=0.2),
            f_b=w(d, dk, std=0.2), dt_bias=torch.randn(d, generator=gen) * 0.5, A_log=torch.randn(heads, generator=gen) * 0.5,
            b=w(heads, hidden, std=0.2), g_a=w(dk, hidden, std=0.2), g_b=w(d, dk, std=0.2),
            o_norm=(torch.rand(dk, generator=gen) + 0.5).to(torch.bfloat16).float(), o=w(hidden, d))
    args = KdaArgs(heads=heads, head_dim=dk, conv_kernel=4, lower_bound=lower_bound, eps=1e-5)
    conv = (torch.randn(streams, 3 * d, 4, generator=gen)).to(torch.bfloat16)   # the last K = 4 inputs
    rec = torch.randn(streams, heads, dk, dk, generator=gen) * 0.1
    return a, args, conv, rec


@pytest.mark.parametrize("heads", [16, 2])
def test_kda_packed_launches_cpu(heads):
    """pack_kda with q/k/v, f_a, g_a and b held as stored (NVFP4): beta's projection b joins the f_a | g_a launch where
    it is whole tiles of 16 (16 heads; 2 heads keep it apart, in F.linear); either way the packed layer gives the bits
    of the unpacked one (the dequantised weights), for decode tokens and a prefill."""
    from dataclasses import replace
    from rocket_mpi.model.glm5_next_kda import kda_forward, pack_kda
    from rocket_mpi.ops import nvfp4
    a, args, conv, rec = _kda_case(heads, 16, 64, 3, seed=heads, lower_bound=-5.0)
    d = heads * 16
    parts = {n: nvfp4.quantize(w.float()) for n, w in (("q", a.qkv[:d]), ("k", a.qkv[d:2 * d]), ("v", a.qkv[2 * d:]),
                                                        ("f_a", a.f_a), ("g_a", a.g_a), ("b", a.b))}
    dq = {n: nvfp4.dequantize(*p, dtype=torch.bfloat16) for n, p in parts.items()}
    dense = replace(a, qkv=torch.cat([dq["q"], dq["k"], dq["v"]]), f_a=dq["f_a"], g_a=dq["g_a"], b=dq["b"])
    stored = {"qkv": [parts["q"], parts["k"], parts["v"]], **{n: parts[n] for n in ("f_a", "g_a", "b")}}
    held = replace(dense, stored=stored)
    packed = replace(held, packed=pack_kda(replace(held), "cpu"))
    n_parts = sum(len(p.ends) for p in packed.packed["h"])
    assert n_parts == (6 if heads == 16 else 5) and packed.packed["b"] is None  # 2 heads: not whole tiles
    gen = torch.Generator().manual_seed(heads)
    for idx, segments, t in ((torch.tensor([2, 0]), [], 2), (None, [(1, 0, 5)], 5)):
        h = torch.randn(t, 64, generator=gen).bfloat16()
        outs = []
        for layer in (dense, packed):
            c, r = conv.clone(), rec.clone()
            outs.append((kda_forward(layer, h, c, r, segments, args, idx=idx), c, r))
        assert all(torch.equal(x, y) for x, y in zip(*outs)), (heads, t)


@gpu
@pytest.mark.parametrize("heads,dk,lb", [(4, 16, -5.0), (2, 128, -5.0), (3, 64, None), (2, 32, -5.0)])
def test_gpu_kda_decode_matches_torch(heads, dk, lb):
    """csrc/kda.cu against glm5_next_kda's torch ops for decode tokens of 3 of 5 streams, three steps in a row: the
    layer output within a few bf16 roundings of its size, the recurrent state within fp32 rounding of the other sum
    orders, the conv state bit for bit (both take the same torch ops there); a token alone gets the same bits."""
    from dataclasses import fields
    from rocket_mpi.model.glm5_next_kda import kda_forward
    hidden = 64
    a, args, conv, rec = _kda_case(heads, dk, hidden, 5, seed=heads * 100 + dk, lower_bound=lb)
    a = type(a)(**{f.name: getattr(a, f.name).cuda() for f in fields(a) if f.name not in ("packed", "stored")})
    idx = torch.tensor([4, 0, 2], device="cuda")
    gen = torch.Generator().manual_seed(dk)
    state = {name: (conv.cuda(), rec.cuda()) for name in ("torch", "kernel")}
    for step in range(3):
        h = (torch.randn(3, hidden, generator=gen)).to(torch.bfloat16).cuda()
        ref = kda_forward(a, h, *state["torch"], [], args, idx=idx)
        got = kda_forward(a, h, *state["kernel"], [], args, idx=idx, fuse=True)
        size = ref.float().abs().amax(dim=-1, keepdim=True)
        assert ((got.float() - ref.float()).abs() <= size * 2.0 ** -5).all(), (step, float((got - ref).abs().max()))
        assert torch.equal(state["kernel"][0], state["torch"][0])
        s_got, s_ref = state["kernel"][1], state["torch"][1]
        assert torch.allclose(s_got, s_ref, rtol=1e-4, atol=1e-5), (step, float((s_got - s_ref).abs().max()))
    # a token alone: the same output and state row as inside the launch
    conv2, rec2 = state["kernel"][0].clone(), state["kernel"][1].clone()
    h = (torch.randn(3, hidden, generator=gen)).to(torch.bfloat16).cuda()
    both = kda_forward(a, h, *state["kernel"], [], args, idx=idx, fuse=True)
    alone = kda_forward(a, h[1:2].contiguous(), conv2, rec2, [], args, idx=idx[1:2].contiguous(), fuse=True)
    assert torch.equal(both[1:2], alone) and torch.equal(state["kernel"][1][0], rec2[0])


@gpu
@pytest.mark.parametrize("heads,dk,lb", [(4, 16, -5.0), (2, 128, -5.0), (3, 64, None)])
def test_gpu_kda_prefill_in_one_launch(heads, dk, lb):
    """A prefill's KDA tokens in one launch of csrc/kda.cu (each stream's tokens in order, the state in registers):
    the same bits as one launch per token (outputs, conv state, recurrent state), for 4 of 5 streams with 1, 11, 2
    and 37 tokens (fewer and more than the conv's window); and within the decode test's bounds of glm5_next_kda's
    torch loop. Streams not in the launch keep their states bit for bit."""
    from dataclasses import fields

    import torch.nn.functional as F

    from rocket_mpi.model.glm5_next_kda import kda_forward
    hidden, counts, streams = 64, [1, 11, 2, 37], [3, 0, 4, 1]
    a, args, conv, rec = _kda_case(heads, dk, hidden, 5, seed=heads * 10 + dk, lower_bound=lb)
    a = type(a)(**{f.name: getattr(a, f.name).cuda() for f in fields(a) if f.name not in ("packed", "stored")})
    offs = [sum(counts[:i]) for i in range(len(counts))]
    segments = list(zip(streams, offs, counts))
    h = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(dk)).to(torch.bfloat16).cuda()
    state = {name: (conv.cuda(), rec.cuda()) for name in ("torch", "one", "tokens", "layer")}
    # the kernel's inputs once (a GEMM of 1 row need not give a GEMM of 52 rows' bits), then the segments in one
    # launch against the same tokens one launch (one token of one stream) each
    lin = (F.linear(h, a.qkv), F.linear(F.linear(h, a.f_a), a.f_b), F.linear(h, a.b), F.linear(F.linear(h, a.g_a), a.g_b))
    tail = (a.dt_bias, a.A_log, a.o_norm)
    one = ops.kda_decode(lin[0], state["one"][0], a.conv, *lin[1:], *tail, state["one"][1],
                             torch.tensor(streams, device="cuda"), heads, dk, lb, args.eps, counts)
    steps = torch.empty_like(one)
    for s, off, n in segments:
        for j in range(off, off + n):
            steps[j] = ops.kda_decode(*(x[j:j + 1] for x in lin[:1]), state["tokens"][0], a.conv,
                                          *(x[j:j + 1] for x in lin[1:]), *tail, state["tokens"][1],
                                          torch.tensor([s], device="cuda"), heads, dk, lb, args.eps)[0]
    assert torch.equal(one, steps)
    assert torch.equal(state["one"][0], state["tokens"][0]) and torch.equal(state["one"][1], state["tokens"][1])
    # the layer (kda_forward with fuse: the kernel, then o_proj) against the torch loop
    ref = kda_forward(a, h, *state["torch"], segments, args)
    got = kda_forward(a, h, *state["layer"], segments, args, fuse=True)
    assert torch.equal(state["layer"][1], state["one"][1])
    size = ref.float().abs().amax(dim=-1, keepdim=True)
    assert ((got.float() - ref.float()).abs() <= size * 2.0 ** -5).all(), float((got - ref).abs().max())
    assert torch.equal(state["layer"][0], state["torch"][0])
    s_got, s_ref = state["layer"][1], state["torch"][1]
    assert torch.allclose(s_got, s_ref, rtol=1e-3, atol=1e-4), float((s_got - s_ref).abs().max())
    assert torch.equal(state["one"][1][2], rec[2].cuda()) and torch.equal(state["one"][0][2], conv[2].cuda())
    with pytest.raises(ValueError, match="not packed one after another"):
        kda_forward(a, h, *state["one"], [(s, off + 1, n) for s, off, n in segments], args, fuse=True)
    with pytest.raises(ValueError, match="counts"):
        ops.kda_decode(lin[0], state["one"][0], a.conv, *lin[1:], *tail, state["one"][1],
                           torch.tensor(streams, device="cuda"), heads, dk, lb, args.eps, [1, 11, 2, 36])


def _mla_case(streams, kv_lora, d, kp, cap, seed):
    from rocket_mpi.model.glm5_next_mla import Indexer, MlaArgs, MlaCache
    gen = torch.Generator().manual_seed(seed)
    args = MlaArgs(heads=4, qk_dim=16, v_dim=16, kv_lora=kv_lora, eps=1e-5, index_heads=2, index_dim=d,
                   index_topk=2 * kp, kpool=kp, select_tail=True)
    bf = torch.bfloat16
    ix = Indexer(wq_b=None, wk=None, k_norm_w=(torch.rand(d, generator=gen) + 0.5).to(bf),
                 k_norm_b=(torch.randn(d, generator=gen) * 0.1).to(bf), weights=None,
                 ape=torch.randn(kp, d, generator=gen).to(bf).float(), gate=None)
    cache = MlaCache(streams, cap, args, True)
    for t in cache.tensors():  # earlier tokens' rows: the pools read them
        t.copy_(torch.randn(t.shape, generator=gen))
    return gen, args, ix, cache


@gpu
@pytest.mark.parametrize("streams,kv_lora,d,kp", [(3, 32, 16, 4), (8, 512, 128, 16), (2, 96, 200, 5)])
def test_gpu_mla_cache_step_matches_torch(streams, kv_lora, d, kp):
    """ops.mla_cache_step against mla_decode's torch writes and _pool_decode on copies of one cache, at positions
    that complete a pool and that do not, streams in another order than the rows: the latent and gate rows are the
    same bits, the LayerNorm'd key and the pools' keys within a bf16 rounding, nothing else in the caches moves;
    and each row alone writes the bits it writes in the launch."""
    from dataclasses import replace
    from rocket_mpi.model.glm5_next_mla import _pool_decode
    import torch.nn.functional as F
    gen, args, ix, cache = _mla_case(streams, kv_lora, d, kp, cap=8 * kp + 3, seed=streams * 7 + d)
    m = streams - 1 if streams > 2 else streams
    index = torch.randperm(streams, generator=gen)[:m]
    pos = torch.tensor([(kp - 1 + i * kp) if i % 2 == 0 else (i * 3 + 1) % (4 * kp) for i in range(m)])
    latent = torch.randn(m, kv_lora, generator=gen).bfloat16()
    wide = torch.randn(m, 2 * d + 8, generator=gen).bfloat16()   # key and gate: views of one output, as linears'
    cu = lambda t: t.cuda()  # noqa: E731
    ixc = replace(ix, k_norm_w=cu(ix.k_norm_w), k_norm_b=cu(ix.k_norm_b), ape=cu(ix.ape))
    ref, got = _mla_cache_copy(cache), _mla_cache_copy(cache)
    ic, pc, lc, kc, gc = cu(index), cu(pos), cu(latent), cu(wide)[:, :d], cu(wide)[:, d + 8:]
    ref.latent[ic, pc] = lc
    ref.index_k[ic, pc] = F.layer_norm(kc, (d,), ixc.k_norm_w, ixc.k_norm_b, 1e-6)
    ref.index_gate[ic, pc] = gc
    _pool_decode(ixc, ref, pc, args, ic)
    ops.mla_cache_step(got, lc, pc, ic, kc, gc, ixc)
    assert torch.equal(got.latent, ref.latent) and torch.equal(got.index_gate, ref.index_gate)
    for name in ("index_k", "pool_k"):
        g, r = getattr(got, name).float(), getattr(ref, name).float()
        assert torch.allclose(g, r, rtol=2 ** -7, atol=2 ** -7), (name, float((g - r).abs().max()))
    assert not torch.equal(got.pool_k, cu(cache.pool_k))  # some token completed a pool
    for r in range(m):  # a row alone: the bits of the launch
        one = _mla_cache_copy(cache)
        ops.mla_cache_step(one, lc[r:r + 1], pc[r:r + 1], ic[r:r + 1], kc[r:r + 1], gc[r:r + 1], ixc)
        s, p = int(index[r]), int(pos[r])
        assert torch.equal(one.latent[s, p], got.latent[s, p]) and torch.equal(one.index_k[s, p], got.index_k[s, p])
        assert torch.equal(one.pool_k[s], got.pool_k[s])
    plain = _mla_cache_copy(cache)  # no indexer: the latent rows only
    ops.mla_cache_step(plain, lc, pc, ic)
    assert torch.equal(plain.latent, ref.latent) and torch.equal(plain.index_k, cu(cache.index_k))


def _mla_cache_copy(cache):
    import copy
    out = copy.copy(cache)
    for name in ("latent", "index_k", "index_gate", "pool_k"):
        setattr(out, name, getattr(cache, name).cuda().clone())
    return out


@gpu
@pytest.mark.parametrize("m,heads,span,kp,tail", [(3, 4, 24, 4, True), (8, 64, 256, 16, True), (2, 8, 37, 4, False),
                                                  (1, 64, 2064, 16, True)])
def test_gpu_mla_softmax_matches_torch(m, heads, span, kp, tail):
    """ops.mla_softmax against latent_attention's mask and softmax (fp32, then bf16): with a mask, and with the
    visible prefix from pos as _chosen_all marks it (a stream with nothing visible NaN, as torch gives); within a
    bf16 rounding, exactly 0 where hidden; a stream alone gets its bits in the batch."""
    from rocket_mpi.model.glm5_next_mla import MlaArgs, _chosen_all
    gen = torch.Generator().manual_seed(m * 131 + span)
    scores = (torch.randn(m, heads, span, generator=gen) * 8).cuda()
    scale = 0.0625
    args = MlaArgs(heads=heads, qk_dim=16, v_dim=16, kv_lora=16, eps=1e-5, index_heads=1, index_dim=16,
                   index_topk=span, kpool=kp, select_tail=tail)
    pos = torch.randint(0, span, (m,), generator=gen)
    pos[0] = 0 if not tail else span - 1                       # no complete pool yet without the tail: NaN
    valid = torch.rand(m, span, generator=gen) < 0.7
    for mask, kw in ((valid.cuda(), {"valid": valid.cuda()}),
                     (_chosen_all(pos.cuda(), span, args), {"pos": pos.cuda(), "kpool": kp, "tail": tail})):
        ref = (scores * scale).masked_fill(~mask[:, None, :], float("-inf")).softmax(dim=-1).to(torch.bfloat16)
        got = ops.mla_softmax(scores, scale, **kw)
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert torch.equal(got.isnan(), ref.isnan())
        g, r = got.float().nan_to_num(), ref.float().nan_to_num()
        assert torch.allclose(g, r, rtol=2 ** -7, atol=1e-6), float((g - r).abs().max())
        assert torch.all(g[~mask[:, None, :].expand_as(g)] == 0)
        for s in range(m):
            one = ops.mla_softmax(scores[s:s + 1], scale, **{k: (v[s:s + 1] if torch.is_tensor(v) else v)
                                                            for k, v in kw.items()})
            assert torch.equal(one.nan_to_num(), got[s:s + 1].nan_to_num())


def _mla_decode_fused_against_torch(dev, exact=False):
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.model.glm5_next_mla import MlaCache, mla_decode
    from rocket_mpi.runtime.engine import Engine
    eng = Engine("preset:glm5-tiny", reader=SyntheticReader("preset:glm5-tiny", dev), device=dev)
    model, args = eng.model, eng.model.mla_args
    full = next(i for i, L in enumerate(model.layers) if L.mla is not None and L.shares_next)
    gen = torch.Generator().manual_seed(11)
    m, cap = 3, 40
    base = MlaCache(m, cap, args, True)
    for t in base.tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    h = torch.randn(m, model.cfg.hidden_size, generator=gen).bfloat16().to(dev)
    # span 8: two pools, the top-k's 8 // 4: every pool taken (no scores, read in place); span 32: scored picks
    for span, pos in ((8, [7, 3, 5]), (32, [31, 12, 19])):
        out = {}
        for fused in (False, True):
            c = MlaCache(m, cap, args, True, device=dev)
            for t, b in zip(c.tensors(), base.tensors()):
                t.copy_(b)
            p = torch.tensor(pos, device=dev)
            y, sel = mla_decode(model.layers[full].mla, h, c, p, span, args, None, fused)
            y2, _ = mla_decode(model.layers[full + 1].mla, h, c, p, span, args, sel, fused)  # the shared layer
            out[fused] = (y, y2, c, sel)
        assert (out[True][3][0] is None) == (span == 8)
        if exact:  # the kernels' contracts in torch: the same caches; in place of the gather, the same attention
            assert all(torch.equal(g, r) for g, r in zip(out[True][2].tensors(), out[False][2].tensors()))
            if span == 8:
                assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
        for name, g, r in (("y", out[True][0], out[False][0]), ("shared y", out[True][1], out[False][1])):
            g, r = g.float(), r.float()
            assert torch.allclose(g, r, rtol=2e-2, atol=2e-2 * float(r.abs().max())), (span, name,
                                                                                          float((g - r).abs().max()))
        for t_got, t_ref in zip(out[True][2].tensors(), out[False][2].tensors()):
            assert torch.allclose(t_got.float(), t_ref.float(), rtol=2e-2, atol=2e-2), span


def test_mla_decode_fused_wiring_cpu(monkeypatch):
    """mla_decode's fused form on the CPU, its three kernels replaced by their contracts written in torch (the
    writes and _pool_decode; _pick's pools in ascending order through _pool_cols; the masked softmax), against its
    torch form: the same caches; with every pool taken (the span read in place, the visible prefix from pos) the
    same outputs bit for bit; with scored picks (other gather order) within rounding."""
    import types
    import torch.nn.functional as F
    from rocket_mpi.model import layers
    from rocket_mpi.model.glm5_next_mla import _pool_cols, _pool_decode
    from rocket_mpi.ops.select import topk_first

    def cache_step(c, latent, pos, index=None, key=None, gate=None, ix=None):
        idx = torch.arange(pos.numel()) if index is None else index
        c.latent[idx, pos] = latent
        if ix is not None:
            c.index_k[idx, pos] = F.layer_norm(key, (key.shape[-1],), ix.k_norm_w, ix.k_norm_b, 1e-6)
            c.index_gate[idx, pos] = gate
            _pool_decode(ix, c, pos, types.SimpleNamespace(kpool=ix.ape.shape[0]), idx)

    def pick(scores, pos, k, kpool, tail):
        candidate = (torch.arange(scores.shape[1]) + 1) * kpool - 1 <= pos[:, None]
        chosen = topk_first(scores.masked_fill(~candidate, torch.finfo(scores.dtype).min), k)[1].sort(dim=1).values
        return _pool_cols(chosen, candidate.gather(1, chosen), pos, types.SimpleNamespace(kpool=kpool,
                                                                                           select_tail=tail))

    def softmax(scores, scale, valid=None, pos=None, kpool=1, tail=True):
        if valid is None:
            n = pos + 1 if tail else (pos + 1) // kpool * kpool
            valid = torch.arange(scores.shape[-1])[None, :] < n[:, None]
        return (scores * scale).masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1).to(torch.bfloat16)

    for name, fn in (("mla_cache_step", cache_step), ("mla_pick", pick), ("mla_softmax", softmax),
                     ("rms_norm", layers.rms_norm)):
        monkeypatch.setattr(ops, name, fn)
    _mla_decode_fused_against_torch("cpu", exact=True)


@gpu
def test_gpu_mla_decode_fused_matches_torch():
    """mla_decode with its glue fused (the fixed-shape step on a GPU: ops.mla_cache_step, ops.mla_softmax, and where
    every pool is taken, the span read in place with no selection tensors) against its torch ops, glm5-tiny's full
    indexed layer and the shared layer after it, every pool taken and scored picks: outputs and caches within the
    roundings the kernels move."""
    _mla_decode_fused_against_torch("cuda")


@gpu
@pytest.mark.parametrize("m,pools,k,kp,tail", [(4, 40, 8, 4, True), (8, 300, 128, 16, True), (3, 129, 128, 16, False),
                                               (2, 5000, 128, 16, True), (5, 17, 2, 4, True)])
def test_gpu_mla_pick_matches_torch(m, pools, k, kp, tail):
    """ops.mla_pick against _pick's selection (topk_first over the scores, the pools that are not candidates masked)
    and _pool_cols: the same pools, in ascending order, their positions and validity, and the tail; on scores with
    many exact ties, zeros of both signs and NaN, for streams with fewer candidate pools than k; a stream alone
    gets its batch's answer."""
    from rocket_mpi.model.glm5_next_mla import MlaArgs, _pool_cols
    from rocket_mpi.ops.select import topk_first
    gen = torch.Generator().manual_seed(pools * 7 + k)
    args = MlaArgs(heads=4, qk_dim=16, v_dim=16, kv_lora=16, eps=1e-5, index_heads=2, index_dim=16,
                   index_topk=k * kp, kpool=kp, select_tail=tail)
    scores = torch.randint(-3, 4, (m, pools), generator=gen).float() * 0.5       # many exact ties
    scores[:, ::7] = -0.0
    scores[0, 3] = float("nan")
    scores[-1] = torch.randn(pools, generator=gen)
    span = pools * kp
    pos = torch.randint(0, span, (m,), generator=gen)
    pos[0] = span - 1
    if m > 2:
        pos[1] = kp * (k // 2) + 1                                                 # fewer candidates than k
    candidate = (torch.arange(pools) + 1) * kp - 1 <= pos[:, None]
    chosen = topk_first(scores.masked_fill(~candidate, torch.finfo(torch.float32).min), k)[1]
    chosen = chosen.sort(dim=1).values
    ref_cols, ref_valid = _pool_cols(chosen, candidate.gather(1, chosen), pos, args)
    cols, valid = ops.mla_pick(scores.cuda(), pos.cuda(), k, kp, tail)
    assert torch.equal(cols.cpu(), ref_cols) and torch.equal(valid.cpu(), ref_valid)
    for s in range(m):
        one = ops.mla_pick(scores[s:s + 1].cuda(), pos[s:s + 1].cuda(), k, kp, tail)
        assert torch.equal(one[0], cols[s:s + 1]) and torch.equal(one[1], valid[s:s + 1])
