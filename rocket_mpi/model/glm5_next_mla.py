"""MLA layers of GLM-5.3-Flash with the DSA indexer over k-pools (NoPE: no rotary embedding at all).

Attention: queries through the q LoRA (q_a -> RMSNorm -> q_b); keys and values from one cached latent
per token (kv_a -> RMSNorm, kv_lora_rank wide) expanded by kv_b. The cache holds the latent only. A prefill in a
short context (every query sees all of its past) expands its latents through kv_b once; past that, each prefill
row, like each decode step, attends over just the latents it selects, gathered, in the absorbed form (kv_b's key
half folded into the query, its value half applied after the weighted sum): the work per row stays index_topk's
whatever the context, and nothing is expanded.

Which tokens a query at position p sees is decided by the indexer, not by a causal mask:
  - tokens are grouped in pools of `kpool` from position 0; a pool is a candidate once complete and
    its last token <= p;
  - each pool has one key: a per-channel softmax-weighted mean of its tokens' indexer keys (weights
    from a gate projection plus a learned per-slot bias `ape`), computed once when the pool completes;
  - score(pool) = sum_h w_h(x) * relu(q_h . k_pool / sqrt(d)), fp32; the best index_topk/kpool pools
    are taken whole;
  - plus the incomplete tail [kpool*floor((p+1)/kpool), p] (index_kpool_always_select_tail).
So a context of at most index_topk + (p+1) % kpool tokens is attended in full. A "shared" layer reuses
the previous (full) layer's selection instead of running its own indexer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.model.layers import (dense_linears, distinct_writes, latent_attention, latent_input_linears,
                                     linear_rows, linears, matmul_fp32, norm_of, prefill_blocks, rms_norm)
from rocket_mpi.ops.select import topk_first

DT = torch.bfloat16


@dataclass
class Indexer:
    wq_b: torch.Tensor          # [ih*d, q_lora]
    wk: torch.Tensor            # [d, H]
    k_norm_w: torch.Tensor      # [d] LayerNorm (eps 1e-6)
    k_norm_b: torch.Tensor      # [d]
    weights: torch.Tensor       # [ih, H] per-head weights of the score
    ape: torch.Tensor           # [kpool, d] fp32 (BF16 values): per-slot bias of the pool softmax
    gate: torch.Tensor          # [d, H] pool softmax logits
    stored: dict = field(default_factory=dict)  # NVFP4 parts of wq_b / wk (layers: held as stored)


@dataclass
class MLA:
    q_a: torch.Tensor; q_a_bias: torch.Tensor | None; q_a_norm: torch.Tensor         # noqa: E702
    q_b: torch.Tensor                                                                 # [heads*dq, q_lora]
    kv_a: torch.Tensor; kv_a_bias: torch.Tensor | None; kv_a_norm: torch.Tensor      # noqa: E702
    kv_b: torch.Tensor                                                                # [heads*(dq+dv), kv_lora]
    o: torch.Tensor; o_bias: torch.Tensor | None                                     # noqa: E702
    indexer: Indexer | None     # None: a "shared" layer
    # Glm5NextModel.pack_stack: copies in the expert kernel's BF16 tiles (layers.pack_linears; None where a shape
    # does not fit): "h" q_a | kv_a (| the indexer's wk), "ix" the indexer's gate | weights (each one launch over
    # the normed input), "q_b", "wq_b", "o"
    packed: dict | None = None
    stored: dict = field(default_factory=dict)  # NVFP4 parts of q_a / kv_a / q_b / o (layers: held as stored)


@dataclass(frozen=True)
class MlaArgs:
    heads: int
    qk_dim: int                 # qk_nope_head_dim (qk_rope_head_dim is 0)
    v_dim: int
    kv_lora: int
    eps: float
    index_heads: int
    index_dim: int
    index_topk: int
    kpool: int
    select_tail: bool


class MlaCache:
    """One MLA layer's cache for M streams: latents, indexer keys and gates, and complete pools' keys."""

    def __init__(self, streams: int, capacity: int, a: MlaArgs, has_indexer: bool, device="cpu"):
        self.latent = torch.zeros(streams, capacity, a.kv_lora, dtype=DT, device=device)
        if has_indexer:
            self.index_k = torch.zeros(streams, capacity, a.index_dim, dtype=DT, device=device)
            self.index_gate = torch.zeros(streams, capacity, a.index_dim, dtype=DT, device=device)
            self.pool_k = torch.zeros(streams, capacity // a.kpool + 1, a.index_dim, dtype=DT, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.latent, getattr(self, "index_k", None), getattr(self, "index_gate", None),
                            getattr(self, "pool_k", None)) if t is not None]


@dataclass
class PoolSelection:
    """One stream's selection in a prefill of n rows at positions p0.. (_select), which a "shared" layer reuses.
    blocks: (r0, r1, chosen, taken) per block of query rows: chosen None where every row sees all of its past
    (the top-k takes every complete pool: a short context), else each row's index_topk // kpool chosen pools
    [r1 - r0, K] and taken [r1 - r0, K], which of them are candidates (complete, last token <= the row's
    position)."""
    p0: int
    n: int
    blocks: list

    def rows(self, r0: int, r1: int, chosen, taken, a: MlaArgs) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows r0..r1 - 1's visible columns (_pool_cols: what a decode step at those rows would gather)."""
        return _pool_cols(chosen, taken, torch.arange(self.p0 + r0, self.p0 + r1, device=chosen.device), a)

    def mask(self, a: MlaArgs) -> torch.Tensor:
        """The selection as a dense mask [n, p0 + n] (tests and inspection; the forward never builds it)."""
        out = torch.zeros(self.n, self.p0 + self.n, dtype=torch.bool)  # host
        for r0, r1, chosen, taken in self.blocks:
            if chosen is None:
                out[r0:r1] = _chosen_all(torch.arange(self.p0 + r0, self.p0 + r1), self.p0 + self.n, a)  # host
            else:
                cols, valid = (t.cpu() for t in self.rows(r0, r1, chosen, taken, a))
                out[torch.arange(r0, r1)[:, None].expand_as(cols)[valid], cols[valid]] = True  # host
        return out


def _select(ix: Indexer, c: MlaCache, s: int, p0: int, n: int, q: torch.Tensor | None, w: torch.Tensor | None,
            a: MlaArgs) -> PoolSelection:
    """Stream s's n queries at positions p0.. (indexer q [n, ih, d], weights w [n, ih] fp32): the keys of the pools
    they complete, then their selection (PoolSelection). While the stream's pools number at most index_topk //
    kpool every row sees all of its past (no scores: q and w may be None); past that each row picks its pools."""
    kp, end = a.kpool, p0 + n
    done, pools = p0 // kp, end // kp                                  # complete pools before / after this step
    if pools > done:
        keys = c.index_k[s, done * kp:pools * kp].view(pools - done, kp, -1)
        logits = c.index_gate[s, done * kp:pools * kp].view(pools - done, kp, -1).float() + ix.ape
        c.pool_k[s, done:pools] = (logits.softmax(dim=1).to(DT) * keys).sum(dim=1)
    k = a.index_topk // kp
    if pools <= k:
        return PoolSelection(p0, n, [(r0, r1, None, None) for r0, r1 in prefill_blocks(n, a.heads * end)])
    per_row = max(a.index_heads * pools, (k + 1) * kp * max(a.heads, a.kv_lora))   # scores; gathered rows
    keys_t, pos = c.pool_k[s, :pools].t(), torch.arange(p0, end, device=q.device)
    return PoolSelection(p0, n, [(r0, r1, *_pick(q[r0:r1], w[r0:r1], keys_t, pos[r0:r1], pools, a))
                                 for r0, r1 in prefill_blocks(n, per_row)])


def _pick(q: torch.Tensor, w: torch.Tensor, keys_t: torch.Tensor, pos: torch.Tensor, pools: int,
          a: MlaArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries at positions pos [R] (q [R, ih, d], w [R, ih] fp32) against the first `pools` pool keys (keys_t
    [d, P], or one set per query row [R, d, P]) -> (chosen [R, K] pool ids, taken [R, K]): the best
    K = min(index_topk // kpool, pools) by index score, and which of them are candidates (complete pools whose
    last token <= p; a row with fewer candidates pads with others, not taken)."""
    kp, dev = a.kpool, q.device
    index = _index_scores(q, w, keys_t, a)                                           # [R, P]
    candidate = (torch.arange(pools, device=dev) + 1) * kp - 1 <= pos[:, None]       # pool's last token <= p
    index = index.masked_fill(~candidate, torch.finfo(index.dtype).min)
    chosen = topk_first(index, min(a.index_topk // kp, pools))[1]
    return chosen, candidate.gather(1, chosen)


def _index_scores(q: torch.Tensor, w: torch.Tensor, keys_t: torch.Tensor, a: MlaArgs) -> torch.Tensor:
    """The indexer's score of each pool for queries q [R, ih, d] with weights w [R, ih] fp32 against keys_t ([d, P] or
    [R, d, P]) -> [R, P] fp32: sum_h w_h relu(q_h . k / sqrt(d))."""
    scores = matmul_fp32(q, keys_t).mul_(a.index_dim ** -0.5).relu_()               # [R, ih, P]
    return torch.matmul(w.unsqueeze(1), scores).squeeze(1)


def _pool_cols(chosen: torch.Tensor, taken: torch.Tensor, pos: torch.Tensor,
               a: MlaArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries at positions pos [R] with their picks (_pick) -> the latent positions they attend over, cols
    [R, n_cols], and which are real, valid [R, n_cols]: the chosen pools' tokens (the taken ones), then the
    incomplete tail [kpool * floor((p + 1) / kpool), p] (index_kpool_always_select_tail; its unused slots point at p
    and are masked). n_cols = (index_topk // kpool + 1) x kpool at most, whatever the context."""
    kp = a.kpool
    slot = torch.arange(kp, device=chosen.device)
    cols = (chosen[:, :, None] * kp + slot).flatten(1)                                   # [R, K * kp]
    valid = taken.repeat_interleave(kp, dim=1)
    if a.select_tail:
        tail = ((pos + 1) // kp * kp)[:, None] + slot                                      # [R, kp]
        cols = torch.cat((cols, torch.minimum(tail, pos[:, None])), dim=1)
        valid = torch.cat((valid, tail <= pos[:, None]), dim=1)
    return cols, valid


def _pool_decode(ix: Indexer, c: MlaCache, pos: torch.Tensor, a: MlaArgs, idx: torch.Tensor) -> None:
    """The key of every pool that this step's token completes (one token for each stream idx [M] at pos [M])."""
    kp, dev = a.kpool, pos.device
    j = pos // kp                                                    # the pool this token falls in
    complete = (pos + 1) % kp == 0
    rows = (j[:, None] * kp + torch.arange(kp, device=dev)).clamp(max=c.index_k.shape[1] - 1)  # [M, kp]
    keys = c.index_k[idx[:, None], rows]                             # [M, kp, d]
    logits = c.index_gate[idx[:, None], rows].float() + ix.ape
    pooled = (logits.softmax(dim=1).to(DT) * keys).sum(dim=1)        # [M, d]
    with distinct_writes():
        c.pool_k[idx, j] = torch.where(complete[:, None], pooled, c.pool_k[idx, j])


def _chosen_all(pos: torch.Tensor, span: int, a: MlaArgs) -> torch.Tensor:
    """The selection where the top-k takes every pool (span // kpool <= index_topk // kpool: no scores needed) as a
    mask over the first span positions: the complete pools up to pos, and the tail -> visible [M, span]."""
    col = torch.arange(span, device=pos.device)[None, :]
    visible = col < ((pos + 1) // a.kpool * a.kpool)[:, None]
    return visible | (col <= pos[:, None]) if a.select_tail else visible


def mla_decode(a: MLA, h: torch.Tensor, c: MlaCache, pos: torch.Tensor, span: int, args: MlaArgs,
               shared: tuple[torch.Tensor, torch.Tensor] | None, fused: bool = False,
               streams: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """One new token per stream at positions pos [M] (device), batched over streams with fixed shapes (streams: the
    cache's streams they are, default all of them in order; a host-path step of the streams that go on):
    h [M, H] -> ([M, H] BF16, its selection (cols, valid) [M, n_cols], which a "shared" layer reuses). Each
    stream's chosen pools and tail (_pool_cols: at most index_topk + kpool latents, a fixed number of columns, the
    unused ones masked) are gathered and attended in the absorbed form (layers.latent_attention): the same tokens and
    weights as mla_forward, other sum orders; nothing of the step is O(span) but the indexer's pool scores. While
    span // kpool <= index_topk // kpool the indexer's top-k takes every complete pool, so it is not scored (its
    keys and pools are still kept for later steps) and the step attends over the span in order under a mask.
    The linears take their packed copies where the model has them (pack_stack) and h has at most
    ops.STACK_KERNEL_MAX_ROWS rows; fused (the fixed-shape step on a GPU): the RMSNorms in ops.rms_norm, the
    cache writes and the pools' keys in ops.mla_cache_step, the picks and their positions in ops.mla_pick (the
    same pools, in ascending order), the softmax in ops.mla_softmax, and where the top-k takes every pool, the
    selection is (None, None): the span's first positions, each stream's up to its own, read in place (no gather,
    no mask)."""
    m, dev = h.shape[0], h.device
    norm, P, ix = norm_of(fused), a.packed or {}, a.indexer
    qa, kv, *wk_h = linears(h, *latent_input_linears(a), P.get("h"))
    q_resid = norm(qa, a.q_a_norm, args.eps)                                          # [M, q_lora]
    q = linears(q_resid, [a.q_b], packs=P.get("q_b"))[0].view(m, args.heads, args.qk_dim)
    latent = norm(kv, a.kv_a_norm, args.eps)                                          # [M, kv_lora]
    idx = torch.arange(m, device=dev) if streams is None and not fused else streams
    ig = iw_h = None
    if ix is not None:
        ig, iw_h = linears(h, [ix.gate, ix.weights], packs=P.get("ix"))
    if fused:
        ops.mla_cache_step(c, latent, pos, streams, wk_h[0] if ix is not None else None, ig, ix)
    else:
        with distinct_writes():
            c.latent[idx, pos] = latent
    if ix is not None:
        if not fused:
            ik = F.layer_norm(wk_h[0], (args.index_dim,), ix.k_norm_w, ix.k_norm_b, 1e-6)
            with distinct_writes():
                c.index_k[idx, pos] = ik
                c.index_gate[idx, pos] = ig
            _pool_decode(ix, c, pos, args, idx)
        pools = span // args.kpool                                    # pools that can be complete in span
        if pools <= args.index_topk // args.kpool:                    # the top-k takes them all: no scores needed
            shared = (None, None) if fused else (torch.arange(span, device=dev).expand(m, span),
                                                 _chosen_all(pos, span, args))
        else:  # pools past a stream's position are never candidates: any span >= the longest stream + 1 will do
            iq = linears(q_resid, [ix.wq_b], packs=P.get("wq_b"))[0].view(m, args.index_heads, args.index_dim)
            iw = iw_h.float() * args.index_heads ** -0.5
            keys = c.pool_k[:m, :pools] if streams is None else c.pool_k[streams, :pools]
            if fused:  # the picks and their positions in one launch (the chosen pools in ascending order)
                shared = ops.mla_pick(_index_scores(iq, iw, keys.transpose(-1, -2), args), pos,
                                      min(args.index_topk // args.kpool, pools), args.kpool, args.select_tail)
            else:
                chosen, taken = _pick(iq, iw, keys.transpose(-1, -2), pos, pools, args)
                shared = _pool_cols(chosen, taken, pos, args)
    cols, valid = shared
    probs = None
    if cols is None:  # fused, every pool taken: positions 0..span - 1 in place, each stream's prefix visible
        rows = c.latent[:m, :span] if streams is None else c.latent[streams, :span]   # [M, span, kv_lora]
        probs = partial(_visible_probs, pos=pos, args=args)
    else:
        rows = c.latent[(torch.arange(m, device=dev) if idx is None else idx)[:, None], cols]  # [M, n_cols, kv_lora]
        if fused:
            probs = partial(_visible_probs, valid=valid)
    # q . (W_uk l) == (q W_uk) . l and sum_j p_j (W_uv l_j) == W_uv (sum_j p_j l_j): the selected latents are
    # the keys and values of one shared head, read once per stream; kv_b's halves are applied to 64 heads' q
    # and output instead of to every selected latent (2064 of them at index_topk 2048: ~69 GFLOP per stream
    # and MLA layer at the Flash width, against ~0.3 here).
    return linears(_absorbed(a, q, rows, valid, args, probs), [a.o], [a.o_bias], P.get("o"))[0], shared


def _visible_probs(scores: torch.Tensor, scale: float, valid: torch.Tensor | None = None,
                   pos: torch.Tensor | None = None, args: MlaArgs | None = None) -> torch.Tensor:
    """The fused step's softmax (ops.mla_softmax) over the columns valid marks, or over each stream's prefix that
    _chosen_all would mark (its complete pools and, with select_tail, the rest up to pos)."""
    if valid is not None:
        return ops.mla_softmax(scores, scale, valid=valid)
    return ops.mla_softmax(scores, scale, pos=pos, kpool=args.kpool, tail=args.select_tail)


def mla_forward(a: MLA, h: torch.Tensor, c: MlaCache, starts: list[int], seqlens: list[int], args: MlaArgs,
                shared: list[PoolSelection | None] | tuple | None) -> tuple[torch.Tensor, list | tuple]:
    """h [T, H] BF16 packed; returns ([T, H] BF16, per stream the PoolSelection it used, None for a stream with
    no rows). A decode step (one token for every stream) runs batched (mla_decode; its selection is one
    (cols, valid) pair for all streams)."""
    if seqlens and all(n == 1 for n in seqlens):
        return mla_decode(a, h, c, torch.tensor(starts, device=h.device), max(starts) + 1, args, shared)
    live = [s for s, n in enumerate(seqlens) if n]
    if live and all(seqlens[s] == 1 for s in live):  # a decode step of the streams that go on (the others ended)
        return mla_decode(a, h, c, torch.tensor([starts[s] for s in live], device=h.device),
                          max(starts[s] for s in live) + 1, args, shared, streams=torch.tensor(live, device=h.device))
    t = h.shape[0]
    # the dense weights: as loaded, or where the device holds NVFP4 ones as stored (pack_stack released them), their
    # packed copies dequantised for this prefill (the same bits)
    P = a.packed or {}
    q_a, kv_a, *wk = dense_linears(latent_input_linears(a)[0], P.get("h"))
    q_resid = rms_norm(linear_rows(h, q_a, a.q_a_bias), a.q_a_norm, args.eps)             # [T, q_lora]
    q = linear_rows(q_resid, dense_linears([a.q_b], P.get("q_b"))[0]).view(t, args.heads, args.qk_dim)
    latent = rms_norm(linear_rows(h, kv_a, a.kv_a_bias), a.kv_a_norm, args.eps)           # [T, kv_lora]
    ix, iq, iw = a.indexer, None, None
    if ix is not None:
        ik = F.layer_norm(linear_rows(h, wk[0]), (args.index_dim,), ix.k_norm_w, ix.k_norm_b, 1e-6)
        ig = linear_rows(h, ix.gate)
        if any((p0 + n) // args.kpool > args.index_topk // args.kpool for p0, n in zip(starts, seqlens)):
            wq_b = dense_linears([ix.wq_b], P.get("wq_b"))[0]
            iq = linear_rows(q_resid, wq_b).view(t, args.index_heads, args.index_dim)      # some rows pick pools
            iw = linear_rows(h, ix.weights).float() * args.index_heads ** -0.5         # [T, ih]
    sels, outs, off = [], [], 0
    for s, (p0, n) in enumerate(zip(starts, seqlens)):
        if n == 0:
            sels.append(None)
            continue
        c.latent[s, p0:p0 + n] = latent[off:off + n]
        if ix is not None:
            c.index_k[s, p0:p0 + n] = ik[off:off + n]
            c.index_gate[s, p0:p0 + n] = ig[off:off + n]
            sel = _select(ix, c, s, p0, n, None if iq is None else iq[off:off + n],
                          None if iw is None else iw[off:off + n], args)
        else:
            sel = shared[s]
        sels.append(sel)
        outs += _prefill_attention(a, q[off:off + n], c.latent[s], sel, args)
        off += n
    return linear_rows(torch.cat(outs), dense_linears([a.o], P.get("o"))[0], a.o_bias), sels


def _prefill_attention(a: MLA, q: torch.Tensor, latents: torch.Tensor, sel: PoolSelection,
                       args: MlaArgs) -> list[torch.Tensor]:
    """One stream's prefill rows q [n, heads, dq] over its cached latents [capacity, kv_lora] under its selection
    -> per block [rows, heads * dv]. A short context (every row sees all of its past, at most index_topk + kpool
    positions): its latents expanded through kv_b once and the blocks attend over their prefix. Past that each row
    attends over its own chosen pools and tail, gathered, in the absorbed form (as a decode step does): the
    work and memory per row stay index_topk's, whatever the context."""
    outs = []
    if sel.blocks[0][2] is None:
        end = sel.p0 + sel.n
        kv = linear_rows(latents[:end], a.kv_b).view(end, args.heads, args.qk_dim + args.v_dim)
        k, v = (x.transpose(0, 1)[None] for x in kv.split([args.qk_dim, args.v_dim], dim=-1))  # [1, heads, end, .]
        for r0, r1, _, _ in sel.blocks:
            w = sel.p0 + r1
            mask = _chosen_all(torch.arange(sel.p0 + r0, w, device=q.device), w, args)  # [rows, w]
            o = F.scaled_dot_product_attention(q[r0:r1].transpose(0, 1)[None], k[:, :, :w], v[:, :, :w],
                                               attn_mask=mask, scale=args.qk_dim ** -0.5)
            outs.append(o[0].transpose(0, 1).reshape(r1 - r0, -1))                   # [rows, heads * dv]
        return outs
    for r0, r1, chosen, taken in sel.blocks:
        cols, valid = sel.rows(r0, r1, chosen, taken, args)                          # [rows, n_cols]
        outs.append(_absorbed(a, q[r0:r1], latents[cols], valid, args))
    return outs


def _absorbed(a: MLA, q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None, args: MlaArgs,
              probs=None) -> torch.Tensor:
    """MLA attention in the absorbed form: queries q [R, heads, dq], each over its own latent rows [R, n, kv_lora]
    (valid [R, n]; a decode step's streams, a prefill's rows past a short context; probs: latent_attention's).
    kv_b's key half folded into q, its value half applied to the weighted latent sums. -> [R, heads * dv], o_proj's
    input."""
    r, nh = q.shape[:2]
    w = a.kv_b.view(nh, args.qk_dim + args.v_dim, -1)                                  # [heads, dq + dv, kv_lora]
    q_abs = torch.bmm(q.transpose(0, 1), w[:, :args.qk_dim]).transpose(0, 1)           # [R, heads, kv_lora]
    o_lat = latent_attention(q_abs, rows, rows, valid, args.qk_dim ** -0.5, probs)
    o = torch.bmm(o_lat.view(r, nh, -1).transpose(0, 1), w[:, args.qk_dim:].transpose(1, 2))  # [heads, R, dv]
    return o.transpose(0, 1).reshape(r, -1)
