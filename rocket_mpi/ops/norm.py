"""RMSNorm (kernel and torch reference) and the fixed-shape decode step's glue kernels (csrc/decode_ops.cu):
the embedding with the first norm, RoPE, the KV append, the decode softmax and the argmax. CUDA only but for
rms_norm_ref; each is the same bits as the torch ops it replaces (GPU tests)."""
from __future__ import annotations

import torch

from rocket_mpi.ops import _ext


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, cast back, then scale (transformers' RMSNorm order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.rms_norm in one kernel (fp32 statistics; the sum's order is the kernel's)."""
    return _ext.require().rms_norm(x.contiguous(), w, eps)

def embed_rms_norm(table: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table[ids], rms_norm(table[ids], w, eps)) in one launch: the decode step's embedding and first norm, the
    same bits as the gather and then ops.rms_norm (an id outside the table reads as a zero row)."""
    return _ext.require().rms_norm(table, w, eps, index=ids)

def argmax_(logits: torch.Tensor, tokens: torch.Tensor, ticket: torch.Tensor, pos: torch.Tensor | None = None
            ) -> torch.Tensor:
    """tokens[:] = torch.argmax(logits, dim=-1) (the first maximum; a NaN counts as the largest) of bf16 logits
    [M, V] in one launch, and pos += 1 where given. ticket: one zero int32 on the device (left zero)."""
    _ext.require().argmax_(logits.contiguous(), tokens, ticket, pos)
    return tokens

def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> None:
    """layers.Rope.apply on q [T, hq, d] and k [T, hk, d] in place, bitwise torch's bf16 ops."""
    _ext.require().rope_(q, k, cos.contiguous(), sin.contiguous(), rot)

def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """glm_moe_dsa.rope_interleaved (x [T, H, r], cos / sin [T, r]) in one launch: the same bits as its torch ops."""
    if x.stride(-1) != 1 or (x.shape[1] > 1 and x.stride(0) != x.shape[1] * x.stride(1)):
        x = x.contiguous()
    return _ext.require().rope_interleaved(x, cos.contiguous(), sin.contiguous())

def kv_append(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """kc[s, :, pos[s]] = k[s] (and v) for every stream s."""
    _ext.require().kv_append(kc, vc, k.contiguous(), v.contiguous(), pos)

def rope_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int,
             kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, table: bool = False) -> None:
    """rope_(q, k, ...) then kv_append(kc, vc, k, v, pos) in one launch: the same bits. table: cos / sin are
    [n, rot] tables (Rope.table's halves) read at each stream's position, instead of the step's rows."""
    _ext.require().rope_kv_(q, k, v.contiguous(), cos.contiguous(), sin.contiguous(), rot, kc, vc, pos, table)

def decode_softmax(scores: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [M, heads, 1, span] bf16 (one query per stream) -> probabilities bf16: softmax in fp32 of
    bf16(scores * scale) with the keys past pos[m] hidden (exactly 0), rounded to bf16; as glm4_moe's _attend
    does it with torch ops (mul, masked_fill, softmax, cast: four kernels), but for the order of the fp32 sums."""
    return _ext.require().decode_softmax(scores.contiguous(), pos, scale)
