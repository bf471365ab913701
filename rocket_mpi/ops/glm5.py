"""GLM-5.3-Flash's decode-step kernels: hyper-connections (csrc/hc.cu), the KDA token (csrc/kda.cu) and the MLA
layers' cache writes, pool picks and softmax (csrc/mla.cu). Their torch references are the model's own code
(model/glm5_next_hc.py, model/glm5_next_kda.py, model/glm5_next_mla.py)."""
from __future__ import annotations

import itertools

import torch

from rocket_mpi.ops import _ext


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, norm: tuple[torch.Tensor, float] | None = None):
    """glm5_next_hc.hc_pre in two launches (csrc/hc.cu): (post [T, N], comb [T, N, N] fp32, collapsed [T, H] bf16).
    With norm = (weight, eps): (post, comb, collapsed, rms_norm(collapsed, weight, eps)), the norm in the second
    launch where the row fits norm.cuh's layout (the bits of ops.rms_norm after it, which runs otherwise)."""
    if norm is None:
        return _ext.require().hc_pre(streams.contiguous(), fn, base, scale, iters, eps, norm_eps)
    return _ext.require().hc_pre(streams.contiguous(), fn, base, scale, iters, eps, norm_eps, norm[0], float(norm[1]))

def hc_post(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """glm5_next_hc.hc_post in one launch (csrc/hc.cu): the new streams [T, N, H] bf16."""
    return _ext.require().hc_post(post.contiguous(), comb.contiguous(), y.contiguous(), streams.contiguous())

def kda_decode(mixed: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
               gate: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, o_norm: torch.Tensor, state: torch.Tensor,
               index: torch.Tensor, heads: int, dk: int, lower_bound: float | None, eps: float,
               counts: list[int] | None = None) -> torch.Tensor:
    """glm5_next_kda's tokens from the q|k|v projection to o_proj's input in one launch (csrc/kda.cu); the conv and
    recurrent state rows at index are updated in place. Without counts: one decode token per stream (row i of mixed
    is stream index[i]'s); with counts (host ints, one per entry of index): stream index[i]'s next counts[i] tokens,
    the rows after stream index[i - 1]'s, run in order (a prefill), the same bits as one launch per token."""
    offsets = None
    if counts is not None:
        if len(counts) != index.numel() or any(n < 0 for n in counts) or sum(counts) != mixed.shape[0]:
            raise ValueError(f"kda_decode: counts {counts} for {index.numel()} streams and {mixed.shape[0]} rows")
        offsets = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int64).to(mixed.device)
    return _ext.require().kda_decode(mixed.contiguous(), conv_state, conv_w, f.contiguous(), b.contiguous(),
                                     gate.contiguous(), dt_bias, a_log, o_norm, state, index, heads, dk, dk ** -0.5,
                                     lower_bound, eps, offsets)

def mla_cache_step(cache, latent: torch.Tensor, pos: torch.Tensor, index: torch.Tensor | None = None,
                   key: torch.Tensor | None = None, gate: torch.Tensor | None = None, indexer=None) -> None:
    """One MLA decode token per stream into its layer's MlaCache in one launch (csrc/mla.cu): latent [M, kv_lora]
    at pos [M] of cache rows index (None: row r); with the layer's Indexer, key [M, d] through its LayerNorm and
    gate [M, d] too, and the keys of the pools the tokens complete (glm5_next_mla's writes and _pool_decode)."""
    ext = _ext.require()
    if indexer is None:
        ext.mla_cache_step(latent, cache.latent, pos, index)
        return
    ext.mla_cache_step(latent, cache.latent, pos, index, key, gate, indexer.k_norm_w, indexer.k_norm_b,
                       indexer.ape, cache.index_k, cache.index_gate, cache.pool_k, 1e-6)

def mla_softmax(scores: torch.Tensor, scale: float, valid: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                kpool: int = 1, tail: bool = True) -> torch.Tensor:
    """fp32 scores [M, heads, span] -> bf16 softmax(scores x scale) over each stream's visible columns, 0 elsewhere
    (NaN where none is), in one launch (csrc/mla.cu): valid [M, span], or the prefix that pos [M] gives (positions
    up to pos with tail, else the complete pools' positions, kpool each). layers.latent_attention's mask, softmax
    and cast."""
    return _ext.require().mla_softmax(scores.contiguous(), None if valid is None else valid.contiguous(), pos,
                                      float(scale), int(kpool), bool(tail))

def mla_pick(scores: torch.Tensor, pos: torch.Tensor, k: int, kpool: int, tail: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Index scores [M, pools] fp32 -> (cols int64, valid bool) [M, (k + tail) x kpool] in one launch (csrc/mla.cu):
    glm5_next_mla._pick then _pool_cols (the same pools: topk_first's order of the scores, the pools that are not
    candidates for pos as its masked ones), but the chosen pools in ascending order."""
    cols, valid = _ext.require().mla_pick(scores.contiguous(), pos, int(k), int(kpool), bool(tail))
    return cols, valid
