"""MLA layers of GLM-5.3-Flash with the DSA indexer over k-pools (NoPE: no rotary embedding at all).

Attention: queries through the q LoRA (q_a -> RMSNorm -> q_b); keys and values from one cached latent
per token (kv_a -> RMSNorm, kv_lora_rank wide) expanded by kv_b. The cache holds the latent only. Prefill
expands just the latents its queries select (in a long context, past MLA_EXPAND_MAX, it attends in the absorbed
form instead); a decode step attends in the absorbed form (kv_b's key half folded into the query, its value half
applied after the weighted sum), so its cost does not grow with the selected latents' expansion.

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rocket_mpi.model.layers import distinct_writes, latent_attention, latent_decode, prefill_blocks, rms_norm

DT = torch.bfloat16
# a prefill expands its selected latents through kv_b (heads x (dq + dv) values each: 32768 at the Flash width)
# while that takes at most this many elements (8192 columns, 512 MiB in bf16); past it (a long context) it attends
# over the latent rows in the absorbed form instead (_latent_block): twice the attention's products, no expansion
MLA_EXPAND_MAX = 1 << 28


@dataclass
class Indexer:
    wq_b: torch.Tensor          # [ih*d, q_lora]
    wk: torch.Tensor            # [d, H]
    k_norm_w: torch.Tensor      # [d] LayerNorm (eps 1e-6)
    k_norm_b: torch.Tensor      # [d]
    weights: torch.Tensor       # [ih, H] per-head weights of the score
    ape: torch.Tensor           # [kpool, d] fp32 (BF16 values): per-slot bias of the pool softmax
    gate: torch.Tensor          # [d, H] pool softmax logits


@dataclass
class MLA:
    q_a: torch.Tensor; q_a_bias: torch.Tensor | None; q_a_norm: torch.Tensor         # noqa: E702
    q_b: torch.Tensor                                                                 # [heads*dq, q_lora]
    kv_a: torch.Tensor; kv_a_bias: torch.Tensor | None; kv_a_norm: torch.Tensor      # noqa: E702
    kv_b: torch.Tensor                                                                # [heads*(dq+dv), kv_lora]
    o: torch.Tensor; o_bias: torch.Tensor | None                                     # noqa: E702
    indexer: Indexer | None     # None: a "shared" layer


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


def _select(ix: Indexer, c: MlaCache, s: int, p0: int, q: torch.Tensor, w: torch.Tensor, a: MlaArgs) -> torch.Tensor:
    """Stream s's n queries at positions p0.. (indexer q [n, ih, d], weights w [n, ih] fp32) -> visible [n, p0+n]."""
    n, kp, dev = q.shape[0], a.kpool, q.device
    end = p0 + n
    done, pools = p0 // kp, end // kp                                  # complete pools before / after this step
    if pools > done:
        keys = c.index_k[s, done * kp:pools * kp].view(pools - done, kp, -1)
        logits = c.index_gate[s, done * kp:pools * kp].view(pools - done, kp, -1).float() + ix.ape
        c.pool_k[s, done:pools] = (logits.softmax(dim=1).to(DT) * keys).sum(dim=1)
    keys_t, pos = c.pool_k[s, :pools].t(), torch.arange(p0, end, device=dev)
    return torch.cat([_choose(q[r0:r1], w[r0:r1], keys_t, pos[r0:r1], pools, end, a)
                      for r0, r1 in prefill_blocks(n, a.index_heads * pools)])


def _choose(q: torch.Tensor, w: torch.Tensor, keys_t: torch.Tensor, pos: torch.Tensor, pools: int, width: int,
            a: MlaArgs) -> torch.Tensor:
    """Queries at positions pos [R] (q [R, ih, d], w [R, ih] fp32) against the first `pools` pool keys
    (keys_t [d, P], or one set per query row [R, d, P]) -> visible [R, width]: the best index_topk/kpool
    complete pools whose last token <= p, taken whole, plus the incomplete tail."""
    kp, dev = a.kpool, q.device
    visible = torch.zeros(q.shape[0], width, dtype=torch.bool, device=dev)
    if pools:
        scores = torch.matmul(q.float(), keys_t.float())                             # [R, ih, P]
        scores = F.relu(scores * a.index_dim ** -0.5)
        index = torch.matmul(w.unsqueeze(1), scores).squeeze(1)                      # [R, P]
        candidate = (torch.arange(pools, device=dev) + 1) * kp - 1 <= pos[:, None]   # pool's last token <= p
        index = index.masked_fill(~candidate, torch.finfo(index.dtype).min)
        chosen = index.topk(min(a.index_topk // kp, pools), dim=-1).indices
        take = torch.zeros(q.shape[0], pools, dtype=torch.bool, device=dev)
        with distinct_writes():
            take.scatter_(1, chosen, candidate.gather(1, chosen))
        visible[:, :pools * kp] = take.repeat_interleave(kp, dim=1)
    if a.select_tail:
        tail_start = (pos + 1) // kp * kp
        col = torch.arange(width, device=dev)
        visible |= (col[None, :] >= tail_start[:, None]) & (col[None, :] <= pos[:, None])
    return visible


def _pool_decode(ix: Indexer, c: MlaCache, pos: torch.Tensor, a: MlaArgs) -> None:
    """The key of every pool that this step's token completes (one token per stream at pos [M])."""
    m, kp, dev = pos.shape[0], a.kpool, pos.device
    idx = torch.arange(m, device=dev)
    j = pos // kp                                                    # the pool this token falls in
    complete = (pos + 1) % kp == 0
    rows = (j[:, None] * kp + torch.arange(kp, device=dev)).clamp(max=c.index_k.shape[1] - 1)  # [M, kp]
    keys = c.index_k[idx[:, None], rows]                             # [M, kp, d]
    logits = c.index_gate[idx[:, None], rows].float() + ix.ape
    pooled = (logits.softmax(dim=1).to(DT) * keys).sum(dim=1)        # [M, d]
    with distinct_writes():
        c.pool_k[idx, j] = torch.where(complete[:, None], pooled, c.pool_k[idx, j])


def _chosen_all(pos: torch.Tensor, span: int, a: MlaArgs) -> torch.Tensor:
    """_choose's answer where its top-k takes every pool (span // kpool <= index_topk // kpool): the complete
    pools up to pos, and the tail -> visible [M, span]."""
    col = torch.arange(span, device=pos.device)[None, :]
    visible = col < ((pos + 1) // a.kpool * a.kpool)[:, None]
    return visible | (col <= pos[:, None]) if a.select_tail else visible


def mla_decode(a: MLA, h: torch.Tensor, c: MlaCache, pos: torch.Tensor, span: int, args: MlaArgs,
               shared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per stream at positions pos [M] (device), batched over streams with fixed shapes:
    h [M, H] -> ([M, H] BF16, visible [M, span]). Each stream's visible latents (at most index_topk +
    kpool of them) are gathered in ascending order into a fixed number of columns, the rest masked, and
    attended in the absorbed form (layers.latent_decode): the same tokens and weights as mla_forward's
    per-stream loop, other sum orders. While span // kpool <= index_topk // kpool the indexer's top-k takes
    every complete pool, so it is not scored (its keys and pools are still kept for later steps)."""
    m, dev = h.shape[0], h.device
    q_resid = rms_norm(F.linear(h, a.q_a, a.q_a_bias), a.q_a_norm, args.eps)          # [M, q_lora]
    q = F.linear(q_resid, a.q_b).view(m, args.heads, args.qk_dim)
    latent = rms_norm(F.linear(h, a.kv_a, a.kv_a_bias), a.kv_a_norm, args.eps)        # [M, kv_lora]
    idx = torch.arange(m, device=dev)
    with distinct_writes():
        c.latent[idx, pos] = latent
    ix, every = a.indexer, False
    if ix is not None:
        ik = F.layer_norm(F.linear(h, ix.wk), (args.index_dim,), ix.k_norm_w, ix.k_norm_b, 1e-6)
        ig = F.linear(h, ix.gate)
        with distinct_writes():
            c.index_k[idx, pos] = ik
            c.index_gate[idx, pos] = ig
        _pool_decode(ix, c, pos, args)
        pools = span // args.kpool                                    # pools that can be complete in span
        every = pools <= args.index_topk // args.kpool                # the top-k takes them all: no scores needed
        if every:
            visible = _chosen_all(pos, span, args)
        else:  # pools past a stream's position are never candidates: any span >= the longest stream + 1 will do
            iq = F.linear(q_resid, ix.wq_b).view(m, args.index_heads, args.index_dim)
            iw = F.linear(h, ix.weights).float() * args.index_heads ** -0.5
            visible = _choose(iq, iw, c.pool_k[:, :pools].transpose(-1, -2), pos, pools, span, args)
    else:
        visible = shared
    n_cols = min(span, (args.index_topk // args.kpool + 1) * args.kpool)
    if every:  # span <= n_cols: every column in order (visible ones first where they are a prefix, as the tail makes)
        cols, valid = torch.arange(span, device=dev).expand(m, span), visible
    else:
        cols = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)[:, :n_cols]  # visible first, ascending
        valid = visible.gather(1, cols)                                                   # [M, n_cols]
    rows = c.latent[idx[:, None], cols]                                               # [M, n_cols, kv_lora]
    if latent_decode():
        # q . (W_uk l) == (q W_uk) . l and sum_j p_j (W_uv l_j) == W_uv (sum_j p_j l_j): the selected latents are
        # the keys and values of one shared head, read once per stream; kv_b's halves are applied to 64 heads' q
        # and output instead of to every selected latent (2064 of them at index_topk 2048: ~69 GFLOP per stream
        # and MLA layer at the Flash width, against ~0.3 here).
        return F.linear(_absorbed(a, q, rows, valid, args), a.o, a.o_bias), visible
    kv = F.linear(rows, a.kv_b).view(m, n_cols, args.heads, args.qk_dim + args.v_dim)
    k, v = kv.split([args.qk_dim, args.v_dim], dim=-1)
    o = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=valid[:, None, None, :], scale=args.qk_dim ** -0.5)
    return F.linear(o[:, :, 0].reshape(m, -1), a.o, a.o_bias), visible


def mla_forward(a: MLA, h: torch.Tensor, c: MlaCache, starts: list[int], seqlens: list[int], args: MlaArgs,
                shared: list[torch.Tensor] | torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """h [T, H] BF16 packed; returns ([T, H] BF16, per stream the visible mask [n, start+n] it used).
    A decode step (one token for every stream) runs batched (mla_decode; its selection is one
    [M, longest + 1] mask)."""
    if seqlens and all(n == 1 for n in seqlens):
        return mla_decode(a, h, c, torch.tensor(starts, device=h.device), max(starts) + 1, args, shared)
    t = h.shape[0]
    q_resid = rms_norm(F.linear(h, a.q_a, a.q_a_bias), a.q_a_norm, args.eps)          # [T, q_lora]
    q = F.linear(q_resid, a.q_b).view(t, args.heads, args.qk_dim)
    latent = rms_norm(F.linear(h, a.kv_a, a.kv_a_bias), a.kv_a_norm, args.eps)        # [T, kv_lora]
    ix = a.indexer
    if ix is not None:
        iq = F.linear(q_resid, ix.wq_b).view(t, args.index_heads, args.index_dim)
        ik = F.layer_norm(F.linear(h, ix.wk), (args.index_dim,), ix.k_norm_w, ix.k_norm_b, 1e-6)
        ig = F.linear(h, ix.gate)
        iw = F.linear(h, ix.weights).float() * args.index_heads ** -0.5             # [T, ih]
    masks, outs, off = [], [], 0
    for s, (p0, n) in enumerate(zip(starts, seqlens)):
        if n == 0:
            masks.append(torch.zeros(0, p0, dtype=torch.bool, device=h.device))
            continue
        c.latent[s, p0:p0 + n] = latent[off:off + n]
        if ix is not None:
            c.index_k[s, p0:p0 + n] = ik[off:off + n]
            c.index_gate[s, p0:p0 + n] = ig[off:off + n]
            vis = _select(ix, c, s, p0, iq[off:off + n], iw[off:off + n], args)
        else:
            vis = shared[s]
        masks.append(vis)
        cols = vis.any(dim=0).nonzero().squeeze(1)                                   # the latents used
        blocks = prefill_blocks(n, args.heads * len(cols))                           # [heads, rows, cols] scores
        if len(cols) * args.heads * (args.qk_dim + args.v_dim) <= MLA_EXPAND_MAX:
            kv = F.linear(c.latent[s, cols], a.kv_b).view(-1, args.heads, args.qk_dim + args.v_dim)
            k, v = kv.split([args.qk_dim, args.v_dim], dim=-1)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]                   # [1, heads, cols, .]
            for r0, r1 in blocks:
                o = F.scaled_dot_product_attention(q[off + r0:off + r1].transpose(0, 1)[None], k, v,
                                                   attn_mask=vis[r0:r1, cols], scale=args.qk_dim ** -0.5)
                outs.append(o[0].transpose(0, 1).reshape(r1 - r0, -1))               # [rows, heads * dv]
        else:
            outs += [_latent_block(a, q[off + r0:off + r1], c.latent[s, cols], vis[r0:r1, cols], args)
                     for r0, r1 in blocks]
        off += n
    return F.linear(torch.cat(outs), a.o, a.o_bias), masks


def _latent_block(a: MLA, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, args: MlaArgs) -> torch.Tensor:
    """A prefill block's queries q [r, heads, dq] over the selected latent rows [cols, kv_lora] under its mask
    [r, cols] in the absorbed form (mla_decode's, one mask per query row: the r x heads queries as one stream's
    query rows of latent_attention) -> [r, heads * dv]. Taken where expanding the columns through kv_b would pass
    MLA_EXPAND_MAX (a long context)."""
    r, nh = q.shape[:2]
    return _absorbed(a, q, rows[None], mask[:, None, :].expand(r, nh, mask.shape[1]).reshape(1, r * nh, -1), args)


def _absorbed(a: MLA, q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, args: MlaArgs) -> torch.Tensor:
    """MLA attention in the absorbed form: queries q [R, heads, dq] over B sets of latent rows [B, n, kv_lora]
    (a decode step: one set per stream, B = R, valid [R, n]; a prefill block: one set, B = 1, valid [1, R x heads,
    n], a mask per query row). kv_b's key half folded into q, its value half applied to the weighted latent sums.
    -> [R, heads * dv], o_proj's input."""
    r, nh = q.shape[:2]
    w = a.kv_b.view(nh, args.qk_dim + args.v_dim, -1)                                  # [heads, dq + dv, kv_lora]
    q_abs = torch.bmm(q.transpose(0, 1), w[:, :args.qk_dim]).transpose(0, 1)           # [R, heads, kv_lora]
    o_lat = latent_attention(q_abs.reshape(rows.shape[0], -1, q_abs.shape[-1]), rows, rows, valid,
                             args.qk_dim ** -0.5)
    o = torch.bmm(o_lat.view(r, nh, -1).transpose(0, 1), w[:, args.qk_dim:].transpose(1, 2))  # [heads, R, dv]
    return o.transpose(0, 1).reshape(r, -1)
