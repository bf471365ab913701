"""Prefill in row blocks and in chunks against prefill in one piece, and the GLM-5 families' sparse prefill
against the same selection as a dense mask.

CPU tests (the row blocks also on a GPU, where there is a CUDA device):
  - layers.prefill_blocks covers the rows (PREFILL_ROWS, PREFILL_SCORES, PREFILL_MIN_ROWS); a prefill in row
    blocks matches one block; engine.prefill_chunks cuts the packed prompts; a chunked prefill matches one
    forward (glm4_moe, GLM-5, GLM-5.3-Flash);
  - GLM-5.3-Flash's and GLM-5's sparse prefill against dense attention under the same selection; GLM-5's two
    forms of a prefill block agree.
"""
from __future__ import annotations

import pytest
import torch


def test_prefill_blocks_cover_the_rows(monkeypatch):
    from rocket_mpi.model import layers
    assert layers.prefill_blocks(0) == [] and layers.prefill_blocks(5) == [(0, 5)]
    monkeypatch.setattr(layers, "PREFILL_ROWS", 4)
    assert layers.prefill_blocks(10) == [(0, 4), (4, 8), (8, 10)] and layers.prefill_blocks(8) == [(0, 4), (4, 8)]
    monkeypatch.setattr(layers, "PREFILL_ROWS", 512)
    # fewer rows where a block's scores would pass PREFILL_SCORES, never fewer than PREFILL_MIN_ROWS
    assert layers.prefill_blocks(1000, 96 * 1000) == [(0, 512), (512, 1000)]               # 96 heads, 1000 keys
    assert layers.prefill_blocks(400, 96 * 16384) == [(0, 170), (170, 340), (340, 400)]   # 16384 keys: 170 rows
    assert layers.prefill_blocks(100, 96 * 2 ** 20)[:2] == [(0, 16), (16, 32)]            # 1M keys: the floor
    assert layers.prefill_blocks(100, 96 * 1000) == [(0, 100)]


def _cache_tensors(c) -> list[torch.Tensor]:
    """Every state tensor of a model's cache (KVCache, LatentCache, Glm5NextCache)."""
    if hasattr(c, "mla"):
        return list(c.conv.values()) + list(c.rec.values()) + [t for m in c.mla.values() for t in m.tensors()]
    if hasattr(c, "kv"):
        return c.kv + [t for t in c.index_k if t is not None]
    return c.k + c.v


@pytest.mark.parametrize("cut", ["rows", "scores"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", id="gpu", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=f"the GPU form needs a CUDA device (torch {torch.__version__})"))])
@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "dsa_ckpt", "glm5_ckpt"])
def test_prefill_in_row_blocks_matches_one_block(ckpt_name, device, cut, request, monkeypatch):
    """A prefill in blocks of 4 query rows (layers.PREFILL_ROWS; 512 in use) against the same prefill in one block:
    prompts of 13, 7 and 22 tokens after the streams already hold 1, 5 and 1 positions; logits within 2^-8 of their
    scale (a bf16 rounding: the CPU gives the same bits for glm4_moe and GLM-5.3-Flash, one ulp for GLM-5, whose
    top-k runs over a block's width), the same next tokens, every cache state within 2^-7 of its scale (GLM-5's
    indexer keys, GLM-5.3-Flash's pools and KDA states too). Planted by hand, each fails it: glm4_moe's blocks all
    taking the first block's queries (logits off by 2^-6, states by 2^-5.7), GLM-5.3-Flash's selection taking the
    first block's positions (2^-6), GLM-5's blocks seeing one key too many (a shape error). On a GPU (gpu) the
    same bounds, with the extension's kernels where the engine takes them. cut=scores: the blocks' rows set by
    PREFILL_SCORES (heads x rows x keys) instead."""
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.model import layers
    torch.set_num_threads(1)
    eng = Engine(request.getfixturevalue(ckpt_name), device=device)
    gen = torch.Generator().manual_seed(7)
    first = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 1)]
    prompts = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (13, 7, 22)]

    def prefill():
        with torch.inference_mode():
            cache = eng.model.new_cache(3, 40)
            for ps in (first, prompts):
                logits = eng.model.forward(torch.tensor([t for p in ps for t in p], device=eng.device), cache,
                                           [len(p) for p in ps], eng.moe)
            return logits, _cache_tensors(cache)

    want, states_w = prefill()
    if cut == "rows":
        monkeypatch.setattr(layers, "PREFILL_ROWS", 4)
    else:  # blocks cut by their scores' size (a long context's rule): 1-7 rows here, by layer and stream
        monkeypatch.setattr(layers, "PREFILL_MIN_ROWS", 1)
        monkeypatch.setattr(layers, "PREFILL_SCORES", 400)
    got, states_g = prefill()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    err = float((got - want).abs().max())
    assert err <= 2.0 ** -8 * float(want.abs().max()), f"max |diff| {err:.3e} of {float(want.abs().max()):.3e}"
    assert len(states_w) == len(states_g) > 0
    for a, b in zip(states_w, states_g):
        scale = max(float(a.float().abs().max()), 1.0)
        assert float((a.float() - b.float()).abs().max()) <= 2.0 ** -7 * scale


def test_prefill_chunks_cut_the_packed_prompts():
    """Each stream's prompt is cut at multiples of the chunk from its own start (batch invariance), and a forward
    packs the pieces that fit."""
    from rocket_mpi.runtime.engine import prefill_chunks
    assert prefill_chunks([3, 5, 2], 4) == [[3, 0, 0], [0, 4, 0], [0, 1, 2]]
    assert prefill_chunks([10], 4) == [[4], [4], [2]] and prefill_chunks([1, 1, 1], 8) == [[1, 1, 1]]
    assert prefill_chunks([4, 4], 4) == [[4, 0], [0, 4]]
    for lens, c in (([7, 1, 12, 3], 5), ([1] * 9, 2), ([30], 7)):
        chunks = prefill_chunks(lens, c)
        assert [sum(col) for col in zip(*chunks)] == lens and all(0 < sum(ch) <= c for ch in chunks)
        for s, n in enumerate(lens):  # the stream's own cuts: pieces of c tokens, then the rest
            pieces = [ch[s] for ch in chunks if ch[s]]
            assert pieces == [c] * (n // c) + ([n % c] if n % c else [])
    with pytest.raises(ValueError, match="at least 1"):
        prefill_chunks([3], 0)


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "dsa_ckpt", "glm5_ckpt"])
def test_chunked_prefill_matches_one_forward(ckpt_name, request, monkeypatch):
    """Engine._forward with prefill_chunk 9 on prompts of 13, 4 and 22 tokens (after 1, 5 and 1 positions held):
    5 forwards, each stream's logits from the chunk where its prompt ends, within 2^-7 of one forward's (a bf16
    rounding: GEMMs of other shapes), the same next tokens, every cache state within 2^-6 of its scale. Logits
    taken from the last chunk for every stream (a planted bug) are off by far more than that."""
    from rocket_mpi.runtime.engine import Engine
    torch.set_num_threads(1)
    eng = Engine(request.getfixturevalue(ckpt_name))
    gen = torch.Generator().manual_seed(9)
    first = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 1)]
    prompts = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (13, 4, 22)]
    calls = []
    forward = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a: calls.append(a[2]) or forward(*a))

    def prefill(chunk):
        eng.prefill_chunk = chunk
        with torch.inference_mode():
            cache = eng.model.new_cache(3, 48)
            for ps in (first, prompts):
                logits = eng._forward(torch.tensor([t for p in ps for t in p]), cache, [len(p) for p in ps])[0]
            return logits, _cache_tensors(cache)

    want, states_w = prefill(4096)
    assert len(calls) == 2
    got, states_g = prefill(9)
    assert len(calls) == 2 + 1 + 5 and calls[3:] == [[9, 0, 0], [4, 4, 0], [0, 0, 9], [0, 0, 9], [0, 0, 4]]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    err = float((got - want).abs().max())
    assert err <= 2.0 ** -7 * float(want.abs().max()), f"max |diff| {err:.3e} of {float(want.abs().max()):.3e}"
    for a, b in zip(states_w, states_g):
        scale = max(float(a.float().abs().max()), 1.0)
        assert float((a.float() - b.float()).abs().max()) <= 2.0 ** -6 * scale


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "glm5_ckpt"])
def test_chunked_prefill_feeds_each_stream_its_own_tokens(ckpt_name, request, monkeypatch):
    """Prompts of 3, 12 and 2 tokens with prefill_chunk 9: the first forward takes stream 0's prompt and stream 2's
    beside it (stream 1's first piece does not fit), so a forward's tokens are not a slice of the packed prompts.
    Each stream still gets the tokens it gets alone with the same chunk (a forward fed the packed prompts in order
    gave streams 1 and 2 each other's continuations)."""
    from rocket_mpi.runtime.engine import Engine
    torch.set_num_threads(1)
    eng = Engine(request.getfixturevalue(ckpt_name))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 12, 2)]
    eng.prefill_chunk = 9
    alone = [eng.generate([p], 4).tokens[0] for p in prompts]
    calls = []
    forward = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a: calls.append(list(a[2])) or forward(*a))
    got = eng.generate(prompts, 4).tokens
    assert calls[0] == [3, 0, 2] and calls[1:3] == [[0, 9, 0], [0, 3, 0]], calls
    assert got == alone


def test_glm5_next_sparse_prefill_matches_dense():
    """GLM-5.3-Flash's prefill past a short context (_prefill_attention): each row over its own chosen pools and
    tail, gathered, in the absorbed form, against the same selection as a dense mask (PoolSelection.mask) over
    every latent expanded through kv_b (SDPA), on random weights: three streams' prompts after positions already
    held, blocks of 3 rows, pools picked by _pick from random indexer scores (early rows with fewer candidate
    pools than picks, rows whose tail is empty). The mask is, row by row, the best index_topk // kpool complete
    pools ending at or before the row by index score, and the tail; the outputs agree within bf16 rounding and are
    not the same bits (two forms ran). kv_b's halves swapped, or each block taking the first block's selection,
    fail it."""
    import torch.nn.functional as F
    from rocket_mpi.model.glm5_next_mla import MLA, MlaArgs, PoolSelection, _pick, _prefill_attention
    gen = torch.Generator().manual_seed(17)
    heads, dq, dv, kl, ql, hid, cap = 4, 16, 16, 32, 48, 64, 40

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
    a = MLA(w(ql, hid), None, torch.ones(ql, dtype=torch.bfloat16), w(heads * dq, ql), w(kl, hid), None,
            torch.ones(kl, dtype=torch.bfloat16), w(heads * (dq + dv), kl), w(hid, heads * dv), None, None)
    args = MlaArgs(heads, dq, dv, kl, 1e-6, 2, 8, 8, 4, True)       # index_topk 8 in pools of 4: 2 picks per row
    for p0, n in ((9, 6), (13, 11), (2, 16)):
        end, pools = p0 + n, (p0 + n) // args.kpool
        latents = torch.randn(cap, kl, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, heads, dq, generator=gen).to(torch.bfloat16)
        iq, iw = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, generator=gen)
        keys_t = torch.randn(8, pools, generator=gen)
        pos = torch.arange(p0, end)
        blocks = [(r0, min(r0 + 3, n), *_pick(iq[r0:r0 + 3], iw[r0:r0 + 3], keys_t, pos[r0:r0 + 3], pools, args))
                  for r0 in range(0, n, 3)]
        sel = PoolSelection(p0, n, blocks)
        mask = sel.mask(args)                                                                  # [n, end]
        score = (iw[:, :, None] * F.relu(iq @ keys_t * 8 ** -0.5)).sum(1)                   # [n, pools]
        kp = args.kpool
        for j, p in enumerate(pos.tolist()):
            cand = [i for i in range(pools) if (i + 1) * kp - 1 <= p]
            best = sorted(cand, key=lambda i: -float(score[j, i]))[:args.index_topk // kp]
            want = {t for i in best for t in range(i * kp, (i + 1) * kp)} | set(range((p + 1) // kp * kp, p + 1))
            assert set(mask[j].nonzero().squeeze(1).tolist()) == want, f"stream at {p0}, row {j}"
        got = torch.cat(_prefill_attention(a, q, latents, sel, args)).float()
        kv = F.linear(latents[:end], a.kv_b).view(end, heads, dq + dv)
        k, v = (x.transpose(0, 1)[None] for x in kv.split([dq, dv], dim=-1))
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=dq ** -0.5)
        want = o[0].transpose(0, 1).reshape(n, -1).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        assert not torch.equal(got, want)


def test_dsa_sparse_prefill_matches_dense(dsa_ckpt, monkeypatch):
    """GLM-5's prefill (_prefill_selection, _prefill_attend) in blocks of 4 rows after 2 positions held: blocks
    whose rows see at most index_topk keys attend over their prefix, later blocks each row over its own top-k rows,
    gathered. The selection (PrefillSelection.mask) is each row's index_topk best keys at or before it, computed
    here row by row; the attention agrees within bf16 rounding with a dense block over the whole prefix under
    that mask (_prefill_block), the prefix blocks bit for bit. A gathered block taking the first block's
    columns fails it."""
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.model import layers
    model = Engine(dsa_ckpt).model
    monkeypatch.setattr(layers, "PREFILL_ROWS", 4)
    gen = torch.Generator().manual_seed(13)
    k, p0, n, d = model.index_topk, 2, 14, model.latent + model.rope_dim
    end = p0 + n
    iq = torch.randn(n, model.index_heads, model.index_dim, generator=gen).to(torch.bfloat16)
    iw = torch.randn(n, model.index_heads, generator=gen)
    keys = torch.randn(end + 3, model.index_dim, generator=gen).to(torch.bfloat16)
    sel = model._prefill_selection(iq, iw, keys, p0, n)
    assert [c is None for _, _, c, _ in sel.blocks] == [True, False, False, False] and k == 8
    scores = model._index_scores(iq, iw, keys[None, :end])                                    # [n, end]
    mask = sel.mask()
    for j in range(n):
        p = p0 + j
        want = set(scores[j, :p + 1].topk(min(k, p + 1)).indices.tolist())
        assert set(mask[j].nonzero().squeeze(1).tolist()) == want, f"row {j}"
    q = torch.randn(n, model.heads, d, generator=gen).to(torch.bfloat16)
    rows = torch.randn(end + 3, d, generator=gen).to(torch.bfloat16)
    got = model._prefill_attend(q, rows, sel)
    for (r0, r1, cols, _), g in zip(sel.blocks, got):
        want = model._prefill_block(q[r0:r1], rows[:p0 + r1], mask[r0:r1, :p0 + r1])
        if cols is None:
            assert torch.equal(g, want)
        else:
            torch.testing.assert_close(g.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


