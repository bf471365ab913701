"""GLM-4.x decode attention (GQA, one query per stream), batch-invariant: the CUDA kernel (csrc/decode_attention.cu)
and its torch reference.

A stream's output depends only on its query, its own cache rows up to its position, and the model's shapes: never
on the other streams of the launch, their lengths, its row in the launch or the span the launch covers. Its
positions are cut into chunks of ATTN_CHUNK from position 0, so the chunks a stream has are set by its own length:

    per chunk c   t = (q . k) x scale (fp32), m_c = max t, p = bf16(exp(t - m_c)), l_c = sum p, o_c = p . v (fp32)
    one chunk     out = bf16(o_0 / l_0)
    more          M = max m_c; out = bf16(sum_c o_c exp(m_c - M) / sum_c l_c exp(m_c - M)), chunks in order

The probabilities are rounded to bf16 before p . v, as transformers' eager attention rounds its softmax (here
unnormalised, the division last, in fp32). The reference computes the same values with torch's sums; the kernel's
sums run in their own fixed order (the tensor cores', then its warps' and chunks' in ascending order), so the two
agree within a bf16 rounding of the output (GPU tests), and the kernel agrees with itself bitwise across batches.
"""
from __future__ import annotations

import torch

from rocket_mpi.ops import _ext

ATTN_CHUNK = 256  # positions per chunk: csrc/rocket.h kDecodeAttentionChunk


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, scale: float,
                     span: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, hq, d] bf16 (one query per stream), caches kc / vc [S, hkv, cap, d] bf16, pos [M] int64 on q's device:
    row m attends cache row rows[m] (m where rows is None) at its positions 0..pos[m], at most `span` of them
    (default the capacity; a graphed step passes its span, a bound on what the launch reads, not a length) ->
    [M, hq, d] bf16. On a GPU one or two launches with fixed grids (CUDA-graph safe); head dims 16, 32, 64, 128."""
    span = kc.shape[2] if span is None else int(span)
    if not q.is_cuda:
        return decode_attention_ref(q, kc, vc, pos, scale, span, rows)
    return _ext.require().decode_attention(q.contiguous(), kc, vc, pos, rows, float(scale), span)


def decode_attention_ref(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, scale: float,
                         span: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention in torch ops (module docstring), one stream at a time; a row with no position (pos < 0) or
    an out-of-range cache row gets zeros, as from the kernel."""
    m, hq, d = q.shape
    streams, hkv, cap = kc.shape[:3]
    span = cap if span is None else int(span)
    grp = hq // hkv
    out = torch.zeros(m, hq, d, dtype=torch.bfloat16, device=q.device)
    which = rows.tolist() if rows is not None else list(range(m))
    for r, (s, p) in enumerate(zip(which, pos.tolist())):
        n = max(0, min(p + 1, span))
        if n == 0 or not 0 <= s < streams:
            continue
        keys, vals = kc[s, :, :n].float(), vc[s, :, :n].float()                  # [hkv, n, d]
        t = torch.matmul(q[r].float().view(hkv, grp, d), keys.transpose(1, 2)) * scale  # [hkv, grp, n]
        parts = []
        for c0 in range(0, n, ATTN_CHUNK):
            tc = t[..., c0:c0 + ATTN_CHUNK]
            mc = tc.amax(dim=-1)
            p_c = torch.exp(tc - mc[..., None]).to(torch.bfloat16).float()
            parts.append((mc, p_c.sum(dim=-1), torch.matmul(p_c, vals[:, c0:c0 + ATTN_CHUNK])))
        if len(parts) == 1:
            o = parts[0][2] / parts[0][1][..., None]
        else:
            top = torch.stack([mc for mc, _, _ in parts]).amax(dim=0)
            total, acc = torch.zeros_like(top), torch.zeros_like(parts[0][2])
            for mc, lc, oc in parts:
                w = torch.exp(mc - top)
                total, acc = total + lc * w, acc + oc * w[..., None]
            o = acc / total[..., None]
        out[r] = o.reshape(hq, d).to(torch.bfloat16)
    return out
